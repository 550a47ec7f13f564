"""``python -m profiler sweep …``: the offline cost sweep (``profiler.sweep``);
``python -m profiler advise CHECKPOINT …``: the (m, k, s) advisor (``profiler.advise``)."""

from __future__ import annotations

import argparse
from pathlib import Path

from mita.config import BACKENDS
from mita.tools.argtypes import (
    NONNEGATIVE_INT,
    POSITIVE_FLOAT,
    POSITIVE_INT,
    Parser,
    bounded,
    output_folder,
)
from mita.tools.scores import HEADLINE
from service.engine import pick_device

from . import advise, advise_config, advise_report
from .sweep import SweepConfig, markdown, run_sweep, write_outputs


def main(argv: list[str] | None = None) -> None:
    p = Parser(prog="python -m profiler")
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("sweep", help="per-stage time vs N for MiTA and dense",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    s.add_argument("--n", type=bounded(int, 1, 1_048_576), nargs="+",
                   default=[1024, 4096, 16384, 65536])
    s.add_argument("--variants", nargs="+", choices=["mita", "dense"], default=["mita", "dense"])
    s.add_argument("--settings", nargs="+", default=["fig5", "64x64"],
                   help="'fig5' (m = k ≈ √(N/4)) and/or fixed 'MxK'")
    s.add_argument("--depth", type=POSITIVE_INT, default=3)
    s.add_argument("--dim", type=POSITIVE_INT, default=128)
    s.add_argument("--heads", type=POSITIVE_INT, default=2)
    s.add_argument("--ffn-dim", type=POSITIVE_INT, default=256)
    s.add_argument("--route-topk", type=POSITIVE_INT, default=1)
    s.add_argument("--batch", type=POSITIVE_INT, default=1)
    s.add_argument("--device", default="cpu")
    s.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    s.add_argument("--mita-backend", default="auto", choices=BACKENDS,
                   help="auto: fused Triton kernel on CUDA (stage 'attention' includes "
                        "'gather'), compiled kernels on CPU (fewer stages, see "
                        "mita_attention); torch: every stage timed apart")
    s.add_argument("--warmup", type=NONNEGATIVE_INT, default=1)
    s.add_argument("--repeats", type=POSITIVE_INT, default=3)
    s.add_argument("--budget-s", type=POSITIVE_FLOAT, default=60.0, help="time budget per point")
    s.add_argument("--out", type=Path, default=Path("runs/sweep"))
    advise_parser = _advise_parser(sub)
    a = p.parse_args(argv)
    if a.command == "advise":
        _advise(advise_parser, a)
        return
    _sweep(s, a)


def _sweep(p: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    """``sweep``: every check before the sweep, refused with ``p`` (the sweep subparser)."""
    try:
        cfg = SweepConfig(ns=a.n, variants=a.variants, settings=a.settings, depth=a.depth,
                          dim=a.dim, num_heads=a.heads, ffn_dim=a.ffn_dim,
                          route_topk=a.route_topk, batch=a.batch, device=a.device,
                          dtype=a.dtype, warmup=a.warmup, repeats=a.repeats,
                          budget_s=a.budget_s, mita_backend=a.mita_backend)
        output_folder("--out", a.out)  # a bad --out fails now, not after the sweep
    except ValueError as e:
        p.error(str(e))
    rows = run_sweep(cfg)
    files = write_outputs(rows, cfg, a.out)
    print(markdown(rows))
    print("wrote " + ", ".join(str(f) for f in files.values()))


class _HelpFormatter(argparse.RawDescriptionHelpFormatter,
                     argparse.ArgumentDefaultsHelpFormatter):
    """The module docstring as written, and every option's default."""


def _advise_parser(sub) -> argparse.ArgumentParser:
    s = sub.add_parser("advise", help="which (m, k, s) pays off for my data and N",
                       description=advise.__doc__, formatter_class=_HelpFormatter)
    s.add_argument("checkpoint", help="checkpoint folder (relative to the project root "
                                      "unless absolute)")
    s.add_argument("--data", default="generated",
                   help="'generated' (LRA-procedure ListOps, see --min/--max-length) or a "
                        "file: LRA ListOps TSV (--format lra), label<TAB>text with integer "
                        "labels (--format text, byte-level) or your labelled file as "
                        "python -m mita.training --train reads it (--format own, the default for "
                        "a checkpoint trained on one)")
    s.add_argument("--format", dest="data_format", choices=["lra", "text", "own"],
                   default=None, help="a --data file's format (default: own for a checkpoint "
                                      "with a task, else lra)")
    s.add_argument("--size", type=POSITIVE_INT, default=1000,
                   help="labelled sequences used (the first SIZE of a file)")
    s.add_argument("--min-length", type=POSITIVE_INT, default=500)
    s.add_argument("--max-length", type=POSITIVE_INT, default=2000)
    s.add_argument("--seed", type=NONNEGATIVE_INT, default=1_000_003,
                   help="generated data's seed (default: the test seed no training run uses)")
    s.add_argument("--n", type=bounded(int, 1, 1_048_576), nargs="+",
                   default=[1024, 4096, 16384], help="sequence lengths served (latency)")
    s.add_argument("--grid", nargs="+", metavar="MxK[xS]",
                   help="settings to try (default: Fig. 5's m = k ≈ √(N/4) for each N and "
                        "m = k ∈ 8, 16, 32, 64; s = 1 and 2)")
    s.add_argument("--shared-scales", nargs="+", choices=["paper", "official"],
                   help="shared-branch scalings to try (default: the checkpoint's)")
    q = s.add_mutually_exclusive_group()
    q.add_argument("--min-agreement", type=bounded(float, 0.0, 1.0),
                   help="predicted labels equal dense's on at least this fraction "
                        "(default 0.99)")
    q.add_argument("--max-accuracy-drop", type=bounded(float, 0.0, 100.0),
                   help="the --metric at most this many points (100 × the score) below "
                        "dense's")
    s.add_argument("--metric", choices=HEADLINE, default="accuracy",
                   help="the score --max-accuracy-drop reads and the report's drop column "
                        "shows: accuracy, macro_f1 (the mean of the per-class F1) or "
                        "balanced_accuracy (the mean per-class recall); the latter two do not "
                        "reward always answering the majority class")
    s.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    s.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="auto: float32 on CPU, bfloat16 on CUDA (as the service)")
    s.add_argument("--mita-backend", default="auto", choices=BACKENDS,
                   help="as the service's mita_backend")
    s.add_argument("--repeats", type=POSITIVE_INT, default=5,
                   help="timed forwards per setting and N (dense interleaved)")
    s.add_argument("--budget-min", type=POSITIVE_FLOAT, default=10.0,
                   help="stop starting new work after this many minutes (resumable)")
    s.add_argument("--out", type=Path, default=Path("runs/advise"))
    s.add_argument("--fresh", action="store_true", help="discard a previous run in --out")
    return s


def _advise(p: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    from mita.model import checkpoint_metadata
    from service.engine import resolve_checkpoint

    try:
        meta = checkpoint_metadata(resolve_checkpoint(a.checkpoint))
        scales = a.shared_scales or [meta["config"]["shared_scale"]]
        ns = sorted(set(a.n))
        grid = ([advise_config.parse_setting(g, sc) for sc in scales for g in a.grid] if a.grid
                else advise_config.default_grid(ns, scales))
        grid = list(dict.fromkeys(grid))  # a setting given twice runs once
        constraint = (advise_config.Constraint("accuracy_drop", a.max_accuracy_drop, a.metric)
                      if a.max_accuracy_drop is not None else
                      advise_config.Constraint("agreement", 0.99 if a.min_agreement is None
                                               else a.min_agreement, a.metric))
        if a.data != "generated" and not Path(a.data).is_file():
            raise ValueError(f"--data {a.data}: " + ("a folder, not a file"
                                                     if Path(a.data).is_dir() else "no such file"))
        pick_device(a.device, "the advisor", auto=False)
        cfg = advise_config.AdviseConfig(
            checkpoint=a.checkpoint, ns=ns, grid=grid, constraint=constraint, data=a.data,
            data_format=a.data_format or ("own" if "task" in meta or "pretrained" in meta
                                          else "lra"),
            size=a.size, min_length=a.min_length,
            max_length=a.max_length, seed=a.seed, device=a.device, dtype=a.dtype,
            mita_backend=a.mita_backend, repeats=a.repeats, budget_s=60 * a.budget_min,
            out=a.out)
        try:
            a.out.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ValueError(f"--out {a.out}: {e.strerror}") from None
        rep = advise.run_advise(cfg, fresh=a.fresh)
    except (OSError, ValueError) as e:
        p.error(str(e))
    except KeyboardInterrupt:
        raise SystemExit(f"\ninterrupted: the finished units are in {a.out / advise.RUN_FILE}; "
                         "run the same command again to resume") from None
    files = advise_report.write_outputs(rep, a.out)
    print(advise_report.markdown(rep))
    print("wrote " + ", ".join(str(f) for f in files.values()))


if __name__ == "__main__":
    main()
