"""Evaluate trained checkpoints, with each test-time attention (dense, mita).

Your own checkpoint on a labelled file: ``python -m mita.training.evaluate CKPT --data FILE``. The
file is read as training reads it (``.tsv`` label<TAB>text, ``.jsonl`` text or ids; every
error names the file and line), tokenized by the checkpoint's tokenizer and cut to its trained
length as training and the service cut (``mita.data.task.Task.labelled_rows``). Prints, per
checkpoint and attention, the scores that hold on skewed data (``mita.tools.scores``: accuracy,
macro-F1 and balanced accuracy with their errors, per-class precision / recall / F1 and
support, the confusion matrix, the file's majority rate) and a warning where accuracy cannot
be told from always answering the majority class. ``--predictions FILE`` (``.jsonl`` or
``.csv``) writes every row's prediction: the file line, the true label, the attention, the
predicted ``label`` and ``label_name`` and the class probabilities. ``--json FILE``: the
scores.

Generated ListOps (without ``--data``): ``python -m mita.training.evaluate CKPT [CKPT …] --test-size
2000 --min-length 100 --max-length 500`` prints a Markdown table: one row per checkpoint (its
training mode), one column per test-time attention, plus the majority-class rate of the same
test set (the share of its most common label: the best any constant prediction can do there).
"""

from __future__ import annotations

import argparse
import csv
import json
from collections import Counter
from pathlib import Path

import torch

from ..config import ATTENTIONS, checkpoint_config
from ..data.listops import ListOpsConfig, generate
from ..data.task import checkpoint_task
from ..model import checkpoint_metadata, load_checkpoint, tied_variant
from ..tools.argtypes import NONNEGATIVE_INT, POSITIVE_INT, Parser
from ..tools.scores import classification_scores, report_text, score_warnings
from .fit import probabilities
from .train import TEST_SEED, encoded, evaluate

LISTOPS_DEFAULTS = {"test_size": 2000, "seed": TEST_SEED, "min_length": 100, "max_length": 500}
PREDICTION_SUFFIXES = (".jsonl", ".csv")


def main(argv: list[str] | None = None) -> list[dict]:
    p = Parser(prog="python -m mita.training.evaluate", description=__doc__,
               formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoints", nargs="+", type=Path)
    p.add_argument("--data", type=Path, metavar="FILE",
                   help="your labelled file (.tsv or .jsonl), scored with each checkpoint")
    p.add_argument("--predictions", type=Path, metavar="FILE",
                   help="with --data: every row's prediction (.jsonl or .csv)")
    g = p.add_argument_group("generated ListOps (without --data)")
    g.add_argument("--test-size", type=POSITIVE_INT, default=None, help="default 2000")
    g.add_argument("--seed", type=NONNEGATIVE_INT, default=None,
                   help="test-set seed; the default is one no training run uses")
    g.add_argument("--min-length", type=POSITIVE_INT, default=None, help="default 100")
    g.add_argument("--max-length", type=POSITIVE_INT, default=None, help="default 500")
    p.add_argument("--json", type=Path, help="also write the rows here")
    args = p.parse_args(argv)
    given = [k for k in LISTOPS_DEFAULTS if getattr(args, k) is not None]
    if args.data is not None and given:
        p.error(f"--{given[0].replace('_', '-')} is for generated ListOps; with --data the "
                "test set is your file")
    if args.data is None and args.predictions is not None:
        p.error("--predictions needs --data FILE")
    for flag, path in (("--json", args.json), ("--predictions", args.predictions)):
        if path is not None and path.is_dir():  # refused before any model is loaded
            p.error(f"{flag} {path}: is a directory")
    if args.predictions is not None and args.predictions.suffix not in PREDICTION_SUFFIXES:
        p.error(f"--predictions {args.predictions}: use a {' or '.join(PREDICTION_SUFFIXES)} "
                "file")
    for k, v in LISTOPS_DEFAULTS.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    return own_data(p, args) if args.data is not None else listops(p, args)


def _models(ck: Path) -> dict:
    """Both attentions over a checkpoint's weights (loaded, hashed and checked once)."""
    base = load_checkpoint(ck)
    return {a: base if a == base.config.attention else tied_variant(base, a) for a in ATTENTIONS}


def _touch(*outputs: tuple[str, Path | None]) -> None:
    """Create each ``(flag, path)`` output now (an unwritable one fails before the forwards,
    not after). Raises ValueError naming the flag, the path and why."""
    for flag, path in outputs:
        if path is None:
            continue
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.touch()
        except OSError as e:  # a file where its folder should be, no permission, …
            where = f"{e.filename}: " if e.filename and str(e.filename) != str(path) else ""
            raise ValueError(f"{flag} {path}: {where}{e.strerror}") from None


def own_data(p: Parser, args) -> list[dict]:
    """``--data FILE``: each checkpoint's scores on the file, per attention."""
    try:
        prepared = []
        for ck in args.checkpoints:
            meta = checkpoint_metadata(ck)
            task = checkpoint_task(meta, checkpoint_config(ck, meta), ck)
            rows, examples, cut = task.labelled_rows(args.data)
            prepared.append((ck, task, rows, examples, cut, _models(ck)))
        _touch(("--json", args.json), ("--predictions", args.predictions))
    except (OSError, ValueError) as e:
        p.error(f"{e.filename}: {e.strerror}" if isinstance(e, OSError) and e.filename
                else str(e))
    out, predictions = [], []
    for ck, task, rows, examples, cut, models in prepared:
        if cut:
            print(f"{ck}: {cut} of {len(rows)} rows were longer than the trained length "
                  f"{task.max_length} and were cut as in training (--truncate {task.truncate})")
        truth = [y for _, y in rows]
        for attention, model in models.items():
            probs = probabilities(model, rows, progress=f"{ck.name} [{attention}]")
            pred = probs.argmax(-1).tolist()
            scores = classification_scores(truth, pred, task.labels)
            warnings = score_warnings(scores, f"{args.data.name}")
            print(report_text(scores, f"{ck} [{attention}] on {args.data}"))
            for w in warnings:
                print(f"warning: {ck} [{attention}]: {w}")
            out.append({"checkpoint": str(ck), "attention": attention, "data": str(args.data),
                        "rows_cut": cut, "scores": scores, "warnings": warnings})
            predictions += [{"checkpoint": str(ck), "line": ex.line,
                             "true_label": ex.label, "attention": attention, "label": y,
                             "label_name": task.labels[y],
                             "probabilities": [round(x, 6) for x in pr]}
                            for ex, y, pr in zip(examples, pred, probs.tolist(), strict=True)]
    if args.json:
        args.json.write_text(json.dumps(out, indent=2) + "\n")
    if args.predictions:
        write_predictions(predictions, args.predictions, prepared[0][1].labels)
        print(f"wrote {len(predictions)} predictions to {args.predictions}")
    return out


def write_predictions(rows: list[dict], path: Path, labels) -> None:
    """``rows`` (checkpoint, line, true_label, attention, label, label_name, probabilities) as
    JSON lines (``.jsonl``) or CSV (``.csv``: the probabilities as columns ``p_NAME``, one per
    class of ``labels`` in class order). Raises OSError."""
    if path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        return
    names = ["checkpoint", "line", "true_label", "attention", "label", "label_name"]
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(names + [f"p_{x}" for x in labels])
        for r in rows:
            w.writerow([r[k] for k in names] + r["probabilities"])


def listops(p: Parser, args) -> list[dict]:
    """Generated ListOps: accuracy per checkpoint and attention, and the majority rate."""
    try:  # everything that can be checked before the test set is drawn
        data_cfg = ListOpsConfig(args.min_length, args.max_length)
        for ck in args.checkpoints:  # generated ListOps means nothing to another task
            meta = checkpoint_metadata(ck)
            task = checkpoint_task(meta, checkpoint_config(ck, meta), ck)
            if not task.listops:
                raise ValueError(f"{ck}: a checkpoint of task {task.name!r} "
                                 f"({task.tokenizer.kind} tokens), not ListOps: score it on "
                                 "your labelled file with --data FILE")
        models = {ck: _models(ck) for ck in args.checkpoints}
        modes = {ck: checkpoint_metadata(ck).get("training", {}).get("mode", "?")
                 for ck in args.checkpoints}
        _touch(("--json", args.json))
    except (OSError, ValueError) as e:
        p.error(str(e))
    print(f"drawing {args.test_size} ListOps test sequences …", flush=True)
    try:
        test = encoded(generate(args.test_size, args.seed, data_cfg))
    except ValueError as e:  # a length range the generator cannot fill
        p.error(str(e))
    majority = Counter(label for _, label in test).most_common(1)[0][1] / len(test)
    rows = []
    for ck in args.checkpoints:
        mode = modes[ck]
        acc = {a: evaluate(models[ck][a], test, progress=f"{ck.name} [{a}]")
               for a in ATTENTIONS}
        rows.append({"checkpoint": str(ck), "train_mode": mode, **acc, "majority": majority})
    print(f"ListOps test set: {args.test_size} sequences, seed {args.seed}, "
          f"{args.min_length} < length < {args.max_length}, torch {torch.__version__}, cpu\n")
    print("| training mode | test: dense | test: mita | majority class |")
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {r['train_mode']} | {r['dense']:.3f} | {r['mita']:.3f} | {majority:.3f} |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    return rows


if __name__ == "__main__":
    main()
