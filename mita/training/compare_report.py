"""The report of a comparison of ways to get a MiTA model (``--compare``, for the product's
own encoder, ``train_data.compare``, and for a pretrained transformers model,
``training.pretrained.compare``): one row per way, ``compare.md`` and ``compare.png``."""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import numpy as np

from ..tools.plots import figure, save
from ..tools.scores import Z95, pct, score_warnings

TIMING_REPEATS = 5  # forwards timed per length (median), after one warm-up


def median_ms(call) -> float:
    """Median wall time (ms) of ``TIMING_REPEATS`` calls of ``call()``, after one warm-up
    call: the forward times of both comparisons (this one and ``training.pretrained``'s)."""
    call()
    times = []
    for _ in range(TIMING_REPEATS):
        t0 = time.perf_counter()
        call()
        times.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(times)


def way_row(way: str, attention: str, steps: int, sc: dict, pred: list[int], ref: list[int],
            ms: tuple[float, float], stopped: bool, checkpoint: Path | None,
            memory_bytes: int | None = None) -> dict:
    """One way's row of a comparison's report (``markdown``, ``write_compare``): its scores
    ``sc`` (``classification_scores``), its agreement with the dense way's predictions
    ``ref``, forward ms at the validation lengths' p50 and p99, whether the time budget
    stopped it, where its weights are (``retention``: ``add_retention``) and
    ``memory_bytes``: the analytic peak activation memory of one layer's batch-1 forward at
    the p99 length (``mita.cost.activation_bytes_estimate``, bytes; an estimate, not a
    measurement: the comparison runs on the CPU, where no allocator reports a peak)."""
    return {"way": way, "attention": attention, "steps": steps,
            "accuracy": sc["accuracy"], "accuracy_se": sc["accuracy_se"],
            "macro_f1": sc["macro_f1"], "macro_f1_se": sc["macro_f1_se"],
            "balanced_accuracy": sc["balanced_accuracy"],
            "balanced_accuracy_se": sc["balanced_accuracy_se"],
            "f1_per_class": {r["label"]: r["f1"] for r in sc["per_class"]},
            "agreement": sum(a == b for a, b in zip(pred, ref, strict=True)) / len(pred),
            "forward_ms_p50": ms[0], "forward_ms_p99": ms[1],
            "activation_bytes_p99": memory_bytes,
            "stopped_by_time_budget": stopped, "warnings": score_warnings(sc),
            "checkpoint": None if checkpoint is None else str(checkpoint)}


def add_retention(rows: list[dict]) -> None:
    """Each row's ``retention``: its accuracy / the first (dense) row's, None when that is 0."""
    for r in rows:
        r["retention"] = r["accuracy"] / rows[0]["accuracy"] if rows[0]["accuracy"] else None


def mib(n: int | None) -> str:
    """Bytes as MiB for a table cell, "-" when unknown."""
    return "-" if n is None else f"{n / 2**20:.2f}"


def markdown(report: dict) -> str:
    """The three-ways tables (``compare.md``): the scores of each way (± one standard error),
    its forward times and activation memory estimate, its F1 per class, where its weights are
    and how to serve them."""
    b, n = report["budget"], report["lengths"]
    lines = [f"Validation rows {report['valid_rows']}, majority rate "
             f"{pct(report['majority_rate'])} ({report['majority_label']!r}: what always "
             f"answering it scores); budget {b['steps']} steps of {b['batch_size']} or "
             f"{b['time_budget_min']:g} min per run, whichever ends first (--steps, "
             f"--time-budget-min), fine-tuning {b['finetune_steps']} "
             f"step{'s' * (b['finetune_steps'] != 1)} more; seed "
             f"{b['seed']}; {report['machine']}.", "",
             f"| way | attention | steps | accuracy | macro-F1 | balanced accuracy | "
             f"retention | agreement with dense | forward ms at N = {n['p50']} (p50) | "
             f"at N = {n['p99']} (p99) | activation memory at N = {n['p99']} (MiB, "
             "estimate) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in report["rows"]:
        ret = "-" if r["retention"] is None else pct(r["retention"])
        steps = f"{r['steps']}" + (" (time budget)" if r["stopped_by_time_budget"] else "")
        lines.append(f"| {r['way']} | {r['attention']} | {steps} | "
                     f"{pct(r['accuracy'])} ± {pct(r['accuracy_se'])} | "
                     f"{r['macro_f1']:.3f} ± {r['macro_f1_se']:.3f} | "
                     f"{pct(r['balanced_accuracy'])} ± {pct(r['balanced_accuracy_se'])} | "
                     f"{ret} | {pct(r['agreement'])} | "
                     f"{r['forward_ms_p50']:.1f} | {r['forward_ms_p99']:.1f} | "
                     f"{mib(r.get('activation_bytes_p99'))} |")
    labels = report["labels"]
    lines += ["", "F1 per class:", "",
              "| way | attention | " + " | ".join(labels) + " |",
              "|---|---|" + "---|" * len(labels)]
    for r in report["rows"]:
        lines.append(f"| {r['way']} | {r['attention']} | "
                     + " | ".join(f"{r['f1_per_class'][x]:.3f}" for x in labels) + " |")
    warned = [(r, w) for r in report["rows"] for w in r["warnings"]]
    if warned:
        lines += ["", "Warnings:", ""] + [f"- {r['way']} ({r['attention']}): {w}"
                                          for r, w in warned]
    kept = [r for r in report["rows"] if r["checkpoint"] is not None
            and not (r["way"] == "mixed" and r["attention"] == "dense")]
    if kept and "model" in report:  # a transformers model's ways (mita.training.pretrained)
        lines += ["", "The weights of each way, each a transformers model folder with its "
                  "MiTA setting in `config.json`, a checkpoint the service serves "
                  "(`args.checkpoint: FOLDER`; from Python: `register()`, then "
                  "`from_pretrained(FOLDER, attn_implementation=\"mita\")`; without it "
                  "transformers loads dense SDPA):", ""]
        lines += [f"- {r['way']}: `{r['checkpoint']}`" for r in kept]
    elif kept:
        lines += ["", "The weights of each way, each a checkpoint the service serves "
                  "(`args.checkpoint: FOLDER` in a Serve config; a mixed checkpoint serves "
                  "both attentions):", ""]
        lines += [f"- {r['way']}: `{r['checkpoint']}`" for r in kept]
    return "\n".join(lines) + "\n"


def write_compare(report: dict, out: Path) -> None:
    """``compare.json`` (``report`` as is), ``compare.md`` (``markdown``) and ``compare.png``
    (validation accuracy and macro-F1 of each way in %, with error bars of ±1.96 standard
    errors, the majority rate as a line, each accuracy bar labelled with its retention
    against dense) into ``out``. Raises OSError when ``out`` cannot be written."""
    (out / "compare.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "compare.md").write_text(markdown(report))
    fig = figure(figsize=(7.2, 3.8))
    ax = fig.subplots()
    rows = report["rows"]
    x = np.arange(len(rows))
    names = [f"{r['way']}\n({r['attention']})" for r in rows]
    acc = ax.bar(x - 0.2, [100 * r["accuracy"] for r in rows], 0.4,
                 yerr=[100 * Z95 * r["accuracy_se"] for r in rows], capsize=2,
                 color=["#555555" if r["attention"] == "dense" else "#1f77b4" for r in rows],
                 label="accuracy")
    ax.bar(x + 0.2, [100 * r["macro_f1"] for r in rows], 0.4,
           yerr=[100 * Z95 * r["macro_f1_se"] for r in rows], capsize=2, color="#ff7f0e",
           label="macro-F1")
    ax.axhline(100 * report["majority_rate"], color="#d62728", ls="--", lw=1,
               label=f"majority rate ({report['majority_label']})")
    for bar, r in zip(acc, rows, strict=True):
        if r["retention"] is not None:
            ax.annotate(f"{100 * r['retention']:.0f} %", (bar.get_x() + bar.get_width() / 2,
                                                          bar.get_height()),
                        ha="center", va="bottom", fontsize=7)
    ax.set_xticks(x, names)
    ax.set_ylabel("validation score (%)")
    ax.set_title("MiTA three ways (error bars ±1.96 SE; label: retention against dense)",
                 fontsize=9)
    ax.legend(fontsize=7, loc="lower right")
    ax.tick_params(axis="x", labelsize=7)
    save(fig, out / "compare.png")
