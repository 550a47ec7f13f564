"""Load-test report files: JSON (summary + every raw sample), CSV, Markdown and PNGs."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from mita.hooks import MIN_STAGE_SAMPLES, VARIANT_COLORS, stage_sorted
from mita.plots import figure, save, stage_lines, write_csv

from .engine import Sample

AB_COLOR = "#555555"  # an A/B phase mixes both variants: neither one's colour


def stage_table(summary: dict) -> list[tuple[int, str, int, dict[str, float]]]:
    """(N, variant label, profiled responses n, median stage ms) per (N, requested variant,
    served variant); an A/B row is labelled ``ab→mita`` / ``ab→dense`` so the two models'
    stages are never mixed, and a fused MiTA's sampled staged forwards ``mita (staged)``."""
    return [(r["n"], served if served.split(" (")[0] == r["variant"]
             else f"{r['variant']}→{served}", r["stages_n"][served], ms)
            for r in summary["rows"] for served, ms in r["stages_ms"].items()]


CLOSED_LOOP_NOTE = (
    "Closed loop: each client sends its next request only after the previous answer, so "
    "while the service stalls no new requests are sent and the stall is counted once, not "
    "for every request that would have arrived (coordinated omission): the percentiles "
    "understate latency under stalls. For latency at an arrival rate, run the open loop "
    "(`--mode open --rate R`), which sends on a Poisson schedule whatever the answers.")


def markdown(summary: dict) -> str:
    c = summary["config"]
    lines = [f"Load test: {c['mode']} loop"
             + (f", concurrency {c['concurrency']}" if c["mode"] == "closed"
                else f", Poisson {c['rate']} req/s")
             + f", {c['requests']} timed requests per (N, variant) after {c['warmup']} warm-up, "
               f"real ListOps (generate_long), target {c['url']}", "",
             "| N | variant | sent | ok | errors | p50 ms | p90 ms | p99 ms | req/s | tokens/s |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    if c["mode"] == "closed":
        lines[1:1] = ["", CLOSED_LOOP_NOTE]
    for r in summary["rows"]:
        errs = ", ".join(f"{k}: {v}" for k, v in r["errors"].items()) or "-"
        if r["ok"]:
            lines.append(f"| {r['n']} | {r['variant']} | {r['sent']} | {r['ok']} | {errs} | "
                         f"{r['p50_ms']:.1f} | {r['p90_ms']:.1f} | {r['p99_ms']:.1f} | "
                         f"{r['throughput_rps']:.2f} | {r['tokens_per_s']:.0f} |")
        else:
            lines.append(f"| {r['n']} | {r['variant']} | {r['sent']} | 0 | {errs} | - | - | - "
                         f"| - | - |")
    if summary["ratios"]:
        lines += ["", "| N | MiTA/dense p50 latency | MiTA/dense p99 latency | "
                      "MiTA/dense throughput |", "|---|---|---|---|"]
        lines += [f"| {x['n']} | {x['p50_ratio_mita_over_dense']:.2f}× | "
                  f"{x['p99_ratio_mita_over_dense']:.2f}× | "
                  f"{x['throughput_ratio_mita_over_dense']:.2f}× |" for x in summary["ratios"]]
    stage_rows = stage_table(summary)
    if stage_rows:
        stages = stage_sorted(s for *_, ms in stage_rows for s in ms)
        lines += ["", "Per-stage time from profiled responses (ms, summed over layers): the "
                      "median of n responses (n = 1: that one response); rows with n < "
                      f"{MIN_STAGE_SAMPLES} are marked, too few to compare.",
                  "", "| N | variant | n | " + " | ".join(stages) + " |",
                  "|---|---|---|" + "---|" * len(stages)]
        lines += [f"| {n} | {name} | {count}{' (few)' if count < MIN_STAGE_SAMPLES else ''} | "
                  + " | ".join(f"{ms[s]:.2f}" if s in ms else "-" for s in stages) + " |"
                  for n, name, count, ms in stage_rows]
    return "\n".join(lines) + "\n"


def write(summary: dict, samples: list[Sample], out: Path) -> dict[str, Path]:
    out.mkdir(parents=True, exist_ok=True)
    files = {"json": out / "loadtest.json", "csv": out / "samples.csv",
             "summary_csv": out / "summary.csv", "md": out / "loadtest.md",
             "latency_png": out / "latency_vs_n.png", "stages_png": out / "stages.png"}
    files["json"].write_text(json.dumps(summary | {"samples": [asdict(s) for s in samples]},
                                        indent=1) + "\n")
    write_csv(files["csv"], ["n", "requested", "variant", "status", "start_s", "latency_s",
                             "error"],
              ([s.n, s.requested, s.variant, s.status, f"{s.start_s:.6f}", f"{s.latency_s:.6f}",
                s.error] for s in samples))
    cols = ["n", "variant", "sent", "ok", "p50_ms", "p90_ms", "p99_ms", "throughput_rps",
            "tokens_per_s"]
    write_csv(files["summary_csv"], [*cols, "errors"],
              ([r[c] for c in cols] + [json.dumps(r["errors"])] for r in summary["rows"]))
    files["md"].write_text(markdown(summary))

    fig = figure(figsize=(6, 4.5))
    ax = fig.subplots()
    for v in dict.fromkeys(r["variant"] for r in summary["rows"]):
        sel = [r for r in summary["rows"] if r["variant"] == v and r["ok"]]
        if sel:
            ns = [r["n"] for r in sel]
            color = VARIANT_COLORS.get(v, AB_COLOR)  # the dashboard's colours
            ax.plot(ns, [r["p50_ms"] for r in sel], "o-", color=color, label=f"{v} p50")
            ax.plot(ns, [r["p99_ms"] for r in sel], "x--", color=color, label=f"{v} p99")
    if ax.lines:
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.legend(fontsize=7)
    else:
        ax.text(0.5, 0.5, "no successful requests", ha="center", va="center",
                transform=ax.transAxes)
    ax.set_xlabel("N (tokens)")
    ax.set_ylabel("request latency (ms)")
    save(fig, files["latency_png"])

    panels: dict[str, list] = {}
    counts: dict[str, list[int]] = {}
    for n, name, count, ms in stage_table(summary):
        panels.setdefault(name, []).append((n, ms))
        counts.setdefault(name, []).append(count)
    # Each panel says how many responses its medians are of (n per N point).
    panels = {f"{name} (n = {min(counts[name])}"
              + (f"–{max(counts[name])}" if max(counts[name]) > min(counts[name]) else "")
              + " per N)": points for name, points in panels.items()}
    if panels:
        stage_lines(panels, files["stages_png"], "median ms per request")
    else:  # nothing profiled: no plot, and none left from an earlier run
        files.pop("stages_png").unlink(missing_ok=True)
    return files
