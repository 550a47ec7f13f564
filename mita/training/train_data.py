"""Training on your own labelled file: ``python -m mita.training --train FILE --out DIR``.

``FILE`` is ``label<TAB>text`` lines (``.tsv``) or JSON lines with ``text`` or ``ids`` and
``label`` (``.jsonl``; ``mita.data.labelled``). Validation is ``--valid FILE`` or a seeded
``--valid-share`` (default 0.1) of ``FILE``. Text is byte-level (UTF-8 bytes, 257 ids); ids
rows keep their ids (``--vocab-size``, default the largest id + 1). Longer than ``--max-len``
tokens: cut at the end (``--truncate tail``, default) or the start (``--truncate head``), and
counted. ``--landmark-grid HxW``: every sequence is an H×W grid (an image's pixels row by
row, ``python -m mita.data.images``), pooled to landmarks in 2-D.

``DIR`` gets a checkpoint the service serves (``args.checkpoint: DIR``): ``config.json`` with
the model config, ``task`` (name, label names, tokenizer, max length) and ``id2label`` /
``label2id``; ``model.safetensors``; ``data_card.json`` (files' SHA-256, rows, class counts,
lengths, split, validation scores per attention, warnings); ``metrics.json``. The validation
scores (``mita.tools.scores``: accuracy, macro-F1 and balanced accuracy with their errors,
per-class precision / recall / F1, the confusion matrix, the validation majority rate) are
printed, with a warning where accuracy cannot be told from always answering the majority
class. ``--class-weight balanced`` weights the loss by class for skewed data.

``--compare``: the three ways to get a MiTA model, side by side on the same data, budget and
seed (the MiTA paper's appendix C): dense; drop-in (the dense weights run with MiTA); dense
fine-tuned with MiTA for ``--finetune-share`` of the budget more; MiTA from scratch; and
``mixed`` (one set of weights trained with both). Each run has the budget ``--steps`` /
``--time-budget-min``. Written to ``compare.{md,json,png}``; every way's weights are kept as a
checkpoint of its own in ``DIR/ways/WAY`` (``--keep-ways`` picks fewer).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import re
import sys
from pathlib import Path

import numpy as np
import torch

from ..config import ModelConfig
from ..cost import activation_bytes_estimate
from ..data import labelled
from ..data.task import Task, label_maps
from ..data.tokenizers import SUBWORD_FILE
from ..model import EncoderClassifier, load_checkpoint, save_checkpoint, tied_variant
from ..tools.argtypes import POSITIVE_INT, bounded
from ..tools.scores import classification_scores, pct, report_text, score_warnings
from .compare_report import add_retention, markdown, median_ms, way_row, write_compare
from .fit import STATE_FILES, Result, Run, fit, predict

DEFAULTS = {"valid_share": 0.1, "truncate": "tail", "finetune_share": 0.25}
SHARE = bounded(float, 0.0, 1.0, above_lo=True)
WAYS = ("dense", "drop-in", "fine-tuned", "mita", "mixed")


def grid(text: str) -> tuple[int, int]:
    """``--landmark-grid``: ``HxW`` → (H, W), both ≥ 1."""
    m = re.fullmatch(r"([1-9]\d*)[xX]([1-9]\d*)", text)
    if not m:
        raise argparse.ArgumentTypeError(f"{text!r} is not HxW (e.g. 28x28)")
    return int(m[1]), int(m[2])


def add_arguments(g) -> tuple[str, ...]:
    """The options of training on your file, added to argparse group ``g``; returns the
    dests of those that mean nothing without ``--train``."""
    actions = []

    def add(*flags, **kwargs):
        actions.append(g.add_argument(*flags, **kwargs))

    add("--train", type=Path, metavar="FILE", default=None,
        help="your labelled file (.tsv: label<TAB>text; .jsonl: text or ids, label)")
    add("--valid", type=Path, metavar="FILE", default=None,
        help="validation file (default: --valid-share of --train)")
    add("--valid-share", type=SHARE, default=None,
        help=f"share of --train held out, seeded (default {DEFAULTS['valid_share']})")
    add("--max-len", type=POSITIVE_INT, default=None,
        help="cut longer sequences to this many tokens")
    add("--truncate", choices=labelled.TRUNCATE_SIDES, default=None,
        help="the end --max-len cuts off: tail (default) keeps the start")
    add("--subword-vocab", type=POSITIVE_INT, default=None, metavar="V",
        help="text: a sentencepiece tokenizer of V pieces learned from the "
             "training split (default: byte-level)")
    add("--vocab-size", type=POSITIVE_INT, default=None,
        help="ids data: ids 1 … V-1 (default: the largest id + 1)")
    add("--task-name", default=None, help="default: the file's name")
    add("--landmark-grid", type=grid, default=None, metavar="HxW",
        help="2-D landmark pooling of H×W sequences (images)")
    add("--model", type=Path, default=None, metavar="DIR",
        help="fine-tune this transformers model folder (config.json, model.safetensors, "
             "tokenizer) instead of training the product's own encoder (docs/pretrained.md)")
    add("--setting", default=None, metavar="MxK[xS]",
        help="--model: its MiTA setting (default: the folder's, else m = k = 16 for text, "
             "25 for images)")
    add("--compare", action="store_true",
        help="dense, drop-in, fine-tuned, MiTA and mixed side by side")
    add("--keep-ways", nargs="+", choices=WAYS, default=None, metavar="WAY",
        help=f"--compare: the ways whose weights are kept in --out/ways/WAY (default all: "
             f"{' '.join(WAYS)})")
    add("--class-weight", choices=("balanced",), default=None,
        help="weight the loss by class: balanced = rows / (classes × the class's rows), "
             "for skewed data")
    add("--finetune-share", type=SHARE, default=None,
        help=f"fine-tuning steps as a share of --steps "
             f"(default {DEFAULTS['finetune_share']})")
    add("--resume", action="store_true",
        help="go on from the training state in --out")
    add("--init", type=Path, default=None, metavar="DIR",
        help="start from this checkpoint's weights (same model config), e.g. a "
             "dense-trained one to fine-tune with MiTA")
    return tuple(a.dest for a in actions if a.dest != "train")


def main(p, args, argv) -> dict:
    """``python -m mita.training --train FILE …`` (``p``: the parser, for its errors)."""
    if args.valid is not None and args.valid_share is not None:
        p.error("--valid and --valid-share: give one (a validation file, or a share of "
                "--train)")
    if args.setting is not None:
        p.error("--setting is the MiTA setting of a --model folder (the product's own encoder: "
                "--num-landmarks, --topk, --route-topk)")
    if args.resume and args.compare:
        p.error("--resume resumes one training run; --compare runs five")
    if args.init is not None and args.compare:
        p.error("--init starts one run from a checkpoint; --compare trains each way from "
                "--seed")
    if args.keep_ways is not None and not args.compare:
        p.error("--keep-ways picks the --compare ways to keep; without --compare there is one "
                "run, kept in --out")
    for name, default in DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, default)
    try:
        data = labelled.load(args.train, args.valid, args.valid_share, args.seed, args.max_len,
                             args.truncate, args.vocab_size, args.subword_vocab)
        if args.landmark_grid is not None:
            _check_grid(data, args.landmark_grid)
        labels = data.labels
        cfg = ModelConfig(vocab_size=data.tokenizer.vocab_size, num_classes=len(labels),
                          pad_id=0, dim=args.dim, depth=args.depth, num_heads=args.num_heads,
                          ffn_dim=args.ffn_dim, num_landmarks=args.num_landmarks,
                          topk=args.topk, route_topk=args.route_topk,
                          shared_scale=args.shared_scale, landmark_grid=args.landmark_grid,
                          attention="dense" if args.mode == "dense" else "mita")
        args.out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        p.error(f"{e.filename}: {e.strerror}" if e.filename else str(e))
    except ValueError as e:
        p.error(str(e))
    for w in data.warnings:
        print(f"warning: {w}", file=sys.stderr)
    counts = data.card["class_counts"]["train"]
    print(f"{len(data.train)} training and {len(data.valid)} validation rows, "
          f"{len(labels)} classes: " + ", ".join(f"{n} {c}" for n, c in counts.items()))
    if args.threads:
        torch.set_num_threads(args.threads)
    train, val = data.encoded("train"), data.encoded("valid")
    weights = None
    if args.class_weight == "balanced":
        from sklearn.utils.class_weight import compute_class_weight

        weights = [float(w) for w in compute_class_weight(
            "balanced", classes=np.arange(len(labels)), y=np.array([y for _, y in train]))]
        print("class weights (balanced): " + ", ".join(
            f"{n} {w:.3f}" for n, w in zip(labels, weights, strict=True)))
    run = Run(args.mode, args.steps, args.batch_size, args.lr, args.time_budget_min,
              args.eval_every, args.seed, class_weights=weights)
    task = Task(args.task_name or args.train.stem, tuple(labels), data.tokenizer,
                data.tokenizer.vocab, args.max_len, args.truncate if args.max_len else None)
    if args.compare:
        keep = args.keep_ways if args.keep_ways is not None else WAYS
        ways, served = compare(cfg, run, train, val, data, args.finetune_share, args.out,
                               task, keep)
        models, res = served
    else:
        ways = None
        models = fresh(cfg, args.seed, args.mode)
        if args.init is not None:
            try:
                start_from(models, args.init, cfg)
            except (OSError, ValueError) as e:
                p.error(str(e))
        res = fit(models, run, train, val, state_dir=args.out, resume=args.resume,
                  checkpoint_every=args.eval_every)
    accuracy = res.history[-1]["val_accuracy"]
    training = {"mode": args.mode, "valid_accuracy": accuracy, "steps": res.steps,
                "seed": args.seed, "class_weight": args.class_weight}
    model = models[cfg.attention]  # the attention the --mode run trained first
    scores = {a: classification_scores([y for _, y in val], predict(m, val), labels)
              for a, m in models.items()}
    found = [f"{a}: {w}" for a in models for w in score_warnings(scores[a])]
    print(f"validation ({len(val)} rows):")
    for a in models:
        print(report_text(scores[a], f"[{a}]"))
    for w in found:
        print(f"warning: {w}", file=sys.stderr)
    if res.budget_stop is not None:
        found.append(f"the time budget stopped training at step {res.budget_stop['step']} of "
                     f"{res.budget_stop['steps']}: the learning-rate schedule ran "
                     f"{100 * res.budget_stop['schedule_share']:.0f} % of its length")
    save_way(model, args.out, task, labels, training)
    card = data.card | {"valid_accuracy": accuracy, "valid_scores": scores,
                        "warnings": data.warnings + found, "training": training}
    (args.out / "data_card.json").write_text(json.dumps(card, indent=2) + "\n")
    metrics = {"mode": args.mode, "valid_accuracy": accuracy, "valid_scores": scores,
               "warnings": data.warnings + found, "budget_stop": res.budget_stop,
               "class_weights": weights, "val_history": res.history, "steps": res.steps,
               "train_wall_seconds": round(res.wall_s, 1),
               "tokens_per_s": round(res.tokens_per_s, 1), "compare": ways,
               "seed": args.seed, "batch_size": args.batch_size, "lr": args.lr,
               "torch": torch.__version__, "device": "cpu", "threads": torch.get_num_threads(),
               "python": platform.python_version(), "machine": platform.machine(),
               "command": "python -m mita.training " + " ".join(
                   argv if argv is not None else sys.argv[1:])}
    (args.out / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    for f in STATE_FILES:  # finished: nothing left to resume
        (args.out / f).unlink(missing_ok=True)
    served = scores[cfg.attention]
    print(f"{args.mode} run, {res.steps} steps in {res.wall_s:.0f} s "
          f"({res.tokens_per_s:,.0f} tokens/s); served attention {cfg.attention}: accuracy "
          f"{pct(served['accuracy'])}, macro-F1 {served['macro_f1']:.3f}, majority rate "
          f"{pct(served['majority_rate'])}; wrote {args.out} (metrics.json, data_card.json)")
    return metrics


def save_way(model: EncoderClassifier, folder: Path, task: Task, labels, training: dict
             ) -> Path:
    """``model`` as a checkpoint the service serves, in ``folder``: its weights and config,
    the ``task`` and label maps, ``training`` (what ran), and the tokenizer's model file for a
    sentencepiece task (any earlier run's file removed otherwise). Raises OSError."""
    save_checkpoint(model, folder, task=task.spec(), **label_maps(labels), training=training)
    subword = folder / SUBWORD_FILE
    if task.tokenizer.kind == "sentencepiece":
        subword.write_bytes(task.tokenizer.model)
    else:  # never leave an earlier run's tokenizer beside these weights
        subword.unlink(missing_ok=True)
    return folder


def _check_grid(data: labelled.Dataset, hw: tuple[int, int]) -> None:
    cells = hw[0] * hw[1]
    for ex in sorted(data.train + data.valid, key=lambda ex: (ex.path, ex.line)):
        if len(ex.ids) != cells:
            raise ValueError(f"{ex.path}:{ex.line}: {len(ex.ids)} tokens, but --landmark-grid "
                             f"{hw[0]}x{hw[1]} needs {cells}")


def fresh(cfg: ModelConfig, seed: int, mode: str) -> dict[str, EncoderClassifier]:
    """New weights from ``seed``, as both attentions over one set of weights (the one
    ``mode`` trains first: dense for ``dense``, else MiTA)."""
    torch.manual_seed(seed)
    first = "dense" if mode == "dense" else "mita"
    model = EncoderClassifier(cfg.replace(attention=first))
    other = "mita" if first == "dense" else "dense"
    return {first: model, other: tied_variant(model, other)}


def start_from(models: dict[str, EncoderClassifier], folder: Path, cfg: ModelConfig) -> None:
    """Load checkpoint ``folder``'s weights into ``models`` (tied: one load sets both).
    Raises ValueError when its config differs from ``cfg`` in anything but the attention."""
    loaded = load_checkpoint(folder)
    theirs, ours = (dataclasses.asdict(c.replace(attention="mita"))
                    for c in (loaded.config, cfg))
    if theirs != ours:
        diff = sorted(k for k in ours if theirs[k] != ours[k])
        raise ValueError(f"--init {folder}: its model config differs in {', '.join(diff)}")
    next(iter(models.values())).load_state_dict(loaded.state_dict())


@torch.no_grad()
def forward_ms(model: EncoderClassifier, n: int, seed: int = 0) -> float:
    """Median wall time (ms) of ``TIMING_REPEATS`` batch-1 forwards of ``n`` random real
    tokens, after one warm-up; on this process's device (CPU) and threads."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, model.config.vocab_size, (1, n), generator=g)
    mask = torch.zeros_like(ids, dtype=torch.bool)
    was = model.training
    model.eval()
    ms = median_ms(lambda: model(ids, mask))
    model.train(was)
    return ms


def compare(cfg: ModelConfig, run: Run, train, val, data: labelled.Dataset, share: float,
            out: Path, task: Task, keep=WAYS) -> tuple[list[dict], tuple[dict, Result]]:
    """The five ways, each trained with ``run``'s budget (``run.steps`` or
    ``run.time_budget_min``, whichever ends first) and seed (fine-tuning: ``share`` ×
    ``run.steps`` more, from the dense weights), evaluated on ``val``: rows of way, attention,
    steps, the scores of ``mita.tools.scores`` (accuracy, macro-F1, balanced accuracy with their
    errors, per-class F1), retention (accuracy / dense's), agreement (labels equal to dense's),
    forward ms at the validation lengths' p50 and p99, and ``checkpoint``: the folder
    ``out/ways/WAY`` holding the way's weights (None for a way not in ``keep``). Writes
    ``compare.{json,md,png}`` to ``out``; returns the rows and the (models, result) of
    ``run.mode``'s own run."""
    runs: dict[str, tuple[dict, Result]] = {}
    steps = max(1, round(share * run.steps))
    print(f"--compare: dense, MiTA and mixed each train up to {run.steps} steps or "
          f"{run.time_budget_min:g} min (--steps, --time-budget-min), whichever ends first; "
          f"the fine-tune {steps} steps more (--finetune-share {share:g}); every way is "
          f"scored on {len(val)} validation rows")
    for mode in ("dense", "mita", "mixed"):
        models = fresh(cfg, run.seed, mode)
        evaluated = models if mode == "mixed" else {mode: models[mode]}
        runs[mode] = models, fit(evaluated, Run(**run.__dict__ | {"mode": mode,
                                                                 "label": f"train[{mode}]"}),
                                 train, val)
    dense = runs["dense"][0]["dense"]
    tuned = fresh(cfg, run.seed, "mita")
    tuned["mita"].load_state_dict(dense.state_dict())
    tuned_res = fit({"mita": tuned["mita"]}, Run(**run.__dict__ | {"mode": "mita", "steps": steps,
                                                  "eval_every": steps,
                                                  "label": "fine-tune[mita]"}), train, val)
    results = {"dense": runs["dense"][1], "drop-in": runs["dense"][1], "fine-tuned": tuned_res,
               "mita": runs["mita"][1], "mixed": runs["mixed"][1]}
    ways = [("dense", "dense", dense, runs["dense"][1].steps),
            ("drop-in", "mita", tied_variant(dense, "mita"), runs["dense"][1].steps),
            ("fine-tuned", "mita", tuned["mita"], runs["dense"][1].steps + tuned_res.steps),
            ("mita", "mita", runs["mita"][0]["mita"], runs["mita"][1].steps),
            ("mixed", "mita", runs["mixed"][0]["mita"], runs["mixed"][1].steps),
            ("mixed", "dense", runs["mixed"][0]["dense"], runs["mixed"][1].steps)]
    lengths = data.card["length_tokens"]["valid"]
    n50, n99 = (min(int(round(lengths[q])), data.card.get("truncation", {}).get(
        "max_len", 1 << 30)) for q in ("p50", "p99"))
    if cfg.landmark_grid is not None:
        n50 = n99 = cfg.landmark_grid[0] * cfg.landmark_grid[1]
    timing = {a: {n: forward_ms(m, n) for n in dict.fromkeys((n50, n99))}
              for a, m in (("dense", dense), ("mita", tied_variant(dense, "mita")))}
    truth = [y for _, y in val]
    ref = predict(dense, val, progress="valid[dense]")
    rows, saved = [], set()
    for way, attention, model, steps_run in ways:
        pred = predict(model, val, progress=f"valid[{way}]")
        sc = classification_scores(truth, pred, data.labels)
        folder = None
        if way in keep:
            folder = out / "ways" / way
            if way not in saved:  # mixed: one folder (MiTA attention), saved by its first row
                saved.add(way)
                stop = results[way].budget_stop
                save_way(model, folder, task, data.labels, {
                    "mode": way, "steps": steps_run, "seed": run.seed,
                    "valid_accuracy": sc["accuracy"], "budget_stop": stop})
        rows.append(way_row(way, attention, steps_run, sc, pred, ref,
                            (timing[attention][n50], timing[attention][n99]),
                            results[way].budget_stop is not None, folder,
                            activation_bytes_estimate(model.config.replace(
                                attention=attention), 1, n99)))
    add_retention(rows)
    report = {"rows": rows, "lengths": {"p50": n50, "p99": n99}, "budget": {
        "steps": run.steps, "time_budget_min": run.time_budget_min,
        "finetune_steps": steps, "batch_size": run.batch_size, "seed": run.seed},
        "valid_rows": len(val), "labels": list(data.labels),
        "majority_label": sc["majority_label"], "majority_rate": sc["majority_rate"],
        "machine": f"{platform.machine()}, "
        f"{torch.get_num_threads()} torch threads, torch {torch.__version__}, CPU"}
    write_compare(report, out)
    print(markdown(report))
    return rows, runs[run.mode]
