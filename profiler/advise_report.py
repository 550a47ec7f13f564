"""The (m, k, s) advisor's report (``profiler.advise``): the Markdown table (every timing ratio
beside the two p50s it divides), the per-class F1 of dense and the recommended settings, the
recommendations and warnings, the latency–agreement frontier plot, the output files, the
serve-config snippet of a recommended setting, and the warning printed when other processes
share the CPU."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from mita.tools.plots import figure, save, write_csv

NOISY = 1.5  # max/min of a point's timed forwards above which the report warns
# A 1-minute load average above this many runnable processes per core when the advisor starts:
# other work shares the CPU (a running service, a test run), and the timings will show it.
BUSY_LOAD_PER_CORE = 0.5


def cpu_sharing_warning(load: float | None = None, cores: int | None = None) -> str | None:
    """The warning to print when other processes keep the CPU busy, or None. ``load``: the
    1-minute load average (default ``os.getloadavg()``); ``cores``: the cores this process
    may run on (default: its CPU affinity). Busy means ``load > BUSY_LOAD_PER_CORE × cores``;
    None where the platform has no load average."""
    try:
        load = os.getloadavg()[0] if load is None else load
    except OSError:
        return None
    if cores is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (
            os.cpu_count() or 1)
    if load <= BUSY_LOAD_PER_CORE * cores:
        return None
    return (f"warning: other processes share the CPU (1-minute load average {load:.2f} on "
            f"{cores} cores, above {BUSY_LOAD_PER_CORE:g} per core): latencies will be slower "
            "and speed-ups noisier than on an otherwise idle machine, and the run longer than "
            "the timings in docs/profiler.md. Stop other heavy work (a running service, a test "
            "run, a training) for numbers you can compare.")


def serve_snippet(row: dict, checkpoint: str) -> str:
    """The serve-config lines (``applications[0].args``) that serve ``row``'s setting from
    ``checkpoint``."""
    return ("# deploy/serve_config.yaml: applications[0].args\n"
            f"args:\n  checkpoint: {checkpoint}\n  mita_setting:\n"
            f"    num_landmarks: {row['m']}\n    topk: {row['k']}\n"
            f"    route_topk: {row['s']}\n    shared_scale: {row['shared_scale']}\n")


# --metric's names as the report writes them (mita.tools.scores.HEADLINE)
METRIC_NAMES = {"accuracy": "accuracy", "macro_f1": "macro-F1",
                "balanced_accuracy": "balanced accuracy"}


def drop_keys(metric: str) -> tuple[str, str]:
    """A report row's keys of ``metric``'s drop from dense and of its standard error, in
    points (accuracy's: ``accuracy_drop_points``, ``drop_se_points``, as before there was a
    choice)."""
    if metric == "accuracy":
        return "accuracy_drop_points", "drop_se_points"
    return f"{metric}_drop_points", f"{metric}_drop_se_points"


def _pm(x: float | None, se: float | None, percent: bool) -> str:
    """A score with its standard error: ``75.0 ± 7.2 %`` (percent) or ``0.712 ± 0.015``;
    without an error just the score; ``-`` without a score."""
    if x is None:
        return "-"
    if percent:
        return f"{100 * x:.1f} %" if se is None else f"{100 * x:.1f} ± {100 * se:.1f} %"
    return f"{x:.3f}" if se is None else f"{x:.3f} ± {se:.3f}"


def latency_cell(x: dict | None, dense_row: bool) -> str:
    """One p50 cell of the table: dense's row its own p50 (dense timed alone); a setting's its
    p50, the p50 of dense timed beside it and their ratio (× = dense's over the setting's):
    the ratio's numerator and denominator are the two numbers shown. ``-`` when not timed."""
    if x is None:
        return "-"
    if dense_row or "dense_p50_ms" not in x:
        return f"{x['p50_ms']:.1f}"
    return f"{x['p50_ms']:.1f} vs {x['dense_p50_ms']:.1f} ({x['speedup']:.2f}×)"


def _cut(cfg: dict) -> str:
    if cfg.get("trained_length") is None:
        return ""
    kept = "first" if cfg["truncate"] == "tail" else "last"
    n = cfg["trained_length"]
    return (f", rows longer than {n} tokens cut to their {kept} {n} as training cut them "
            f"(truncate {cfg['truncate']})")


def markdown(rep: dict) -> str:
    """The report as Markdown: the table, the per-class F1, the recommendations, the snippet
    and the warnings."""
    cfg = rep["config"]
    ns = cfg["ns"]
    metric = rep.get("metric", "accuracy")
    name = METRIC_NAMES[metric]
    drop_key, se_key = drop_keys(metric)
    head = (f"| setting | m | k | s | scale | accuracy | macro-F1 | balanced accuracy | {name} "
            "drop (± SE) points | agreement | KL(dense‖MiTA) | retention | "
            + " | ".join(f"p50 ms N={n}: setting vs dense (×)" for n in ns) + " |")
    how = ("exact for paired outcomes" if metric == "accuracy" else
           "paired bootstrap over the same resampled rows")
    lines = [f"Advisor: checkpoint {cfg['checkpoint']}, data {cfg['data']} "
             f"({cfg['sequences']} sequences"
             + (f", {cfg['min_length']} < length < {cfg['max_length']}"
                if cfg["data"] == "generated" else "") + _cut(cfg) + f"), {cfg['device']}, "
             f"dtype {cfg['dtype']}, backend {cfg['mita_backend']}, batch 1, p50 of "
             f"{cfg['repeats']}, torch {torch.__version__}. Constraint: {rep['constraint']}. "
             f"Metric: {name} (--metric {metric}). Drop = dense's {name} minus the setting's "
             f"in points (100 × the difference), ± its paired standard error ({how}): a "
             "constraint tighter than ~2 SE is within noise. Scores ± their standard error "
             "(macro-F1 and balanced accuracy: bootstrap). A setting's p50 cell: its p50 vs "
             "that of dense timed beside it (interleaved forwards), × = dense's over the "
             "setting's; dense's row: dense timed alone, another measurement.", "",
             head, "|" + "---|" * (12 + len(ns))]
    for r in rep["rows"]:
        drop = (f"{r[drop_key]:+.1f} ± {r[se_key]:.1f}"
                if r.get(drop_key) is not None and r["setting"] != "dense" else "-")
        q = ([_pm(r["accuracy"], r.get("accuracy_se"), True),
              _pm(r.get("macro_f1"), r.get("macro_f1_se"), False),
              _pm(r.get("balanced_accuracy"), r.get("balanced_accuracy_se"), True),
              drop, f"{100 * r['agreement']:.1f} %",
              f"{r['kl']:.4f}", f"{100 * r['retention']:.1f} %" if r.get("retention")
              is not None else "-"] if "accuracy" in r else ["-"] * 7)
        lat = [latency_cell(r["latency"].get(n) or r["latency"].get(str(n)),
                            r["setting"] == "dense") for n in ns]
        lines.append("| " + " | ".join([r["setting"], *(str(r[c]) if r[c] is not None else "-"
                                                        for c in ("m", "k", "s",
                                                                  "shared_scale")),
                                        *q, *lat]) + " |")
    lines += per_class_table(rep)
    lines += ["", "Recommendation (the largest speed-up over dense among the settings that meet "
                  "the constraint):", ""]
    lines += [f"- {x['answer']}" for x in rep["recommendations"]]
    lines += [f"- {rep['overall']['answer']}"]
    if rep["overall"].get("snippet"):
        lines += ["", "```yaml", rep["overall"]["snippet"].rstrip(), "```"]
    if rep.get("warnings"):
        lines += ["", "Warnings:", ""] + [f"- {w}" for w in rep["warnings"]]
    if rep.get("noisy"):
        shown = ", ".join(f"{s} at N = {n}" for s, n in rep["noisy"][:6])
        lines += ["", f"Noisy timings (slowest forward > {NOISY}× the fastest): {shown}"
                      + (" …" if len(rep["noisy"]) > 6 else "") + ". The machine was busy or "
                      "its clock unsteady: rerun with more --repeats on an idle machine."]
    if rep["skipped"]:
        lines += ["", f"Not run (time budget): {len(rep['skipped'])} units; run again to "
                      "resume."]
    return "\n".join(lines) + "\n"


def per_class_table(rep: dict) -> list[str]:
    """Markdown lines of the per-class F1 of dense and of the recommended settings, with each
    class's support and the majority rate of the data; none without dense's scores."""
    dense = rep["rows"][0]
    if "scores" not in dense:
        return []
    names = {x["setting"] for x in [*rep["recommendations"], rep["overall"]]
             if x.get("setting")}
    shown = [dense] + [r for r in rep["rows"][1:] if r["setting"] in names and "scores" in r]
    sc = dense["scores"]
    lines = ["", f"Per-class F1 (dense and the recommended settings; support: the class's "
                 f"rows). Majority rate of the data: {100 * sc['majority_rate']:.1f} % "
                 f"({sc['majority_label']!r}): what always answering it scores.", "",
             "| class | support | " + " | ".join(r["setting"] for r in shown) + " |",
             "|---|---|" + "---|" * len(shown)]
    for i, c in enumerate(sc["per_class"]):
        lines.append(f"| {c['label']} | {c['support']} | " + " | ".join(
            f"{r['scores']['per_class'][i]['f1']:.3f}" for r in shown) + " |")
    return lines


def plot_frontier(rep: dict, path: Path) -> Path:
    """Latency against agreement per N (one subplot each, log latency): every setting, dense
    at 100 %, the Pareto frontier (dense included: no other point is both faster and more
    agreeing) as a step line, the constraint's threshold when it is on agreement, the recommendation
    circled."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    ns = rep["config"]["ns"]
    fig = figure(figsize=(4.2 * len(ns), 3.8))
    axes = fig.subplots(1, len(ns), squeeze=False)
    recs = {x["n"]: x for x in rep["recommendations"]}
    for ax, n in zip(axes[0], ns, strict=True):
        pts = [(r["latency"][n]["p50_ms"], 100 * r["agreement"], r["setting"])
               for r in rep["rows"][1:] if "agreement" in r and n in r["latency"]]
        dense = rep["rows"][0]["latency"].get(n)
        for x, y, name in pts:
            ax.plot(x, y, "o", color="#1f77b4", ms=5)
            ax.annotate(name.replace(" paper", "").replace(" official", " off."), (x, y),
                        fontsize=6, xytext=(3, 3), textcoords="offset points")
        frontier, best_y = [], -1.0
        candidates = pts + ([(dense["p50_ms"], 100.0, "dense")] if dense is not None else [])
        for x, y, _ in sorted(candidates, key=lambda p: (p[0], -p[1])):
            if y > best_y:
                frontier.append((x, y))
                best_y = y
        if frontier:
            ax.step([p[0] for p in frontier], [p[1] for p in frontier], where="post",
                    color="#2ca02c", label="Pareto frontier")
        if dense is not None:
            ax.plot(dense["p50_ms"], 100.0, "*", color="#d62728", ms=12, label="dense")
        if rep["config"]["constraint"].startswith("agreement"):
            ax.axhline(float(rep["config"]["constraint"].split("≥")[1].split("%")[0]),
                       color="grey", ls="--", lw=1, label="constraint")
        rec = recs.get(n)
        if rec and rec.get("setting"):
            ax.plot(rec["p50_ms"], 100 * rec["agreement"], "o", ms=13, mfc="none",
                    color="#ff7f0e", label="recommended")
        ax.set_xscale("log")
        ax.xaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_title(f"N = {n}")
        ax.set_xlabel("forward p50 ms (log)")
        ax.set_ylabel("agreement with dense (%)")
        ax.grid(alpha=0.3)
    axes[0][-1].legend(fontsize=7, loc="lower right")
    return save(fig, path)


def write_outputs(rep: dict, out: Path) -> dict[str, Path]:
    """``advise.md``, ``advise.json``, ``advise.csv``, ``frontier.png`` and, when a setting
    qualifies for every N, ``serve_snippet.yaml`` (else an old one is removed), into
    ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    files = {"md": out / "advise.md", "json": out / "advise.json", "csv": out / "advise.csv"}
    files["md"].write_text(markdown(rep))
    files["json"].write_text(json.dumps(rep, indent=2) + "\n")
    ns = rep["config"]["ns"]
    metric = rep.get("metric", "accuracy")
    drop_key, se_key = drop_keys(metric)
    scored = next((r["scores"] for r in rep["rows"] if "scores" in r), None)
    classes = [c["label"] for c in scored["per_class"]] if scored else []
    quality = ("accuracy", "accuracy_se", "macro_f1", "macro_f1_se", "balanced_accuracy",
               "balanced_accuracy_se", "majority_rate")
    write_csv(files["csv"], ["setting", "m", "k", "s", "shared_scale", *quality, "metric",
                             "drop_points", "drop_se_points", "agreement", "kl", "retention",
                             *(f"f1 {c}" for c in classes), "n", "p50_ms", "min_ms", "max_ms",
                             "dense_p50_ms", "speedup", "peak_memory_bytes"],
              ([r["setting"], r["m"], r["k"], r["s"], r["shared_scale"],
                *(r.get(c) for c in quality), metric, r.get(drop_key),
                r.get(se_key) if r.get(drop_key) is not None else None, r.get("agreement"),
                r.get("kl"), r.get("retention"),
                *(r["scores"]["per_class"][i]["f1"] if "scores" in r else None
                  for i in range(len(classes))), n,
                *(r["latency"].get(n, {}).get(c) for c in ("p50_ms", "min_ms", "max_ms",
                                                           "dense_p50_ms", "speedup",
                                                           "peak_memory_bytes"))]
               for r in rep["rows"] for n in ns))
    files["png"] = plot_frontier(rep, out / "frontier.png")
    snippet = out / "serve_snippet.yaml"
    if rep["overall"].get("snippet"):
        files["yaml"] = snippet
        snippet.write_text(rep["overall"]["snippet"])
    else:  # never leave an earlier run's recommendation to be deployed
        snippet.unlink(missing_ok=True)
    return files
