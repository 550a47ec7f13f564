"""Accuracy of trained checkpoints with each test-time attention on fresh ListOps.

``python -m mita.evaluate CKPT [CKPT …] --test-size 2000 --min-length 100 --max-length 500``
prints a Markdown table: one row per checkpoint (its training mode), one column per test-time
attention (dense, mita), plus the majority-class rate of the same test set (the share of its
most common label: the best any constant prediction can do there).
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path

import torch

from .argtypes import NONNEGATIVE_INT, POSITIVE_INT, Parser
from .config import ATTENTIONS
from .data.listops import ListOpsConfig, generate
from .model import checkpoint_metadata, load_checkpoint, tied_variant
from .train import TEST_SEED, encoded, evaluate


def main(argv: list[str] | None = None) -> list[dict]:
    p = Parser(prog="python -m mita.evaluate", description=__doc__,
               formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoints", nargs="+", type=Path)
    p.add_argument("--test-size", type=POSITIVE_INT, default=2000)
    p.add_argument("--seed", type=NONNEGATIVE_INT, default=TEST_SEED,
                   help="test-set seed; the default is one no training run uses")
    p.add_argument("--min-length", type=POSITIVE_INT, default=100)
    p.add_argument("--max-length", type=POSITIVE_INT, default=500)
    p.add_argument("--json", type=Path, help="also write the rows here")
    args = p.parse_args(argv)
    try:  # everything that can be checked before the test set is drawn
        data_cfg = ListOpsConfig(args.min_length, args.max_length)
        models = {}
        for ck in args.checkpoints:  # loaded (hashed, checked) once; the other variant tied
            base = load_checkpoint(ck)
            models[ck] = {a: base if a == base.config.attention else tied_variant(base, a)
                          for a in ATTENTIONS}
        modes = {ck: checkpoint_metadata(ck).get("training", {}).get("mode", "?")
                 for ck in args.checkpoints}
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.touch()
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
