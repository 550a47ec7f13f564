"""``python -m profiler sweep …``: the offline cost sweep (see ``profiler.sweep``)."""

from __future__ import annotations

import argparse
from pathlib import Path

from mita.argtypes import NONNEGATIVE_INT, POSITIVE_FLOAT, POSITIVE_INT, bounded

from .sweep import SweepConfig, markdown, run_sweep, write_outputs


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m profiler")
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
    s.add_argument("--mita-backend", default="auto", choices=["auto", "torch", "cpu", "triton"],
                   help="auto: fused Triton kernel on CUDA (stage 'attention' includes "
                        "'gather'), compiled kernels on CPU (fewer stages, see "
                        "mita_attention); torch: every stage timed apart")
    s.add_argument("--warmup", type=NONNEGATIVE_INT, default=1)
    s.add_argument("--repeats", type=POSITIVE_INT, default=3)
    s.add_argument("--budget-s", type=POSITIVE_FLOAT, default=60.0, help="time budget per point")
    s.add_argument("--out", type=Path, default=Path("runs/sweep"))
    a = p.parse_args(argv)
    try:
        cfg = SweepConfig(ns=a.n, variants=a.variants, settings=a.settings, depth=a.depth,
                          dim=a.dim, num_heads=a.heads, ffn_dim=a.ffn_dim,
                          route_topk=a.route_topk, batch=a.batch, device=a.device,
                          dtype=a.dtype, warmup=a.warmup, repeats=a.repeats,
                          budget_s=a.budget_s, mita_backend=a.mita_backend)
        a.out.mkdir(parents=True, exist_ok=True)  # a bad --out fails now, not after the sweep
    except (OSError, ValueError) as e:
        p.error(str(e))
    rows = run_sweep(cfg)
    files = write_outputs(rows, cfg, a.out)
    print(markdown(rows))
    print("wrote " + ", ".join(str(f) for f in files.values()))


if __name__ == "__main__":
    main()
