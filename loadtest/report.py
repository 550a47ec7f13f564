"""Load-test report files: JSON (summary + every raw sample), CSV, Markdown and PNGs."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from mita.hooks import MIN_STAGE_SAMPLES, VARIANT_COLORS, stage_sorted
from mita.tools.plots import figure, save, stage_lines, write_csv

from .engine import Sample
from .inputs import GENERATED, UNIT_NOTES

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


def input_lines(summary: dict) -> list[str]:
    """The report's lines on what was sent (a file's rows: the file, its rows, how they were
    joined and cut at each N; nothing for generated ListOps), the target's task, and the
    warnings (``loadtest.inputs.warnings``)."""
    lines = []
    source = summary.get("input")
    if source and source["source"] == "file":
        lines += ["", f"Input: {source['path']} ({source['rows']} {source['kind']} rows, "
                      f"sha256 {source['sha256'][:16]}…), in file order, joined by "
                      f"{source['joined_by']} and cut to each N ({UNIT_NOTES[source['unit']]}):",
                  ""]
        lines += [f"- {x['text']}" for x in source["per_n"]]
    target = summary.get("target")
    if target:
        lines += ["", f"Target task: {target['name']!r} (tokenizer {target['tokenizer']}"
                      + (f", max_length {target['max_length']}" if target["max_length"] else "")
                      + (f", grid {target['grid'][0]}×{target['grid'][1]}" if target["grid"]
                         else "") + ")."]
    for w in summary.get("warnings", []):  # each a paragraph of its own
        lines += ["", f"Warning: {w}."]
    return lines


def _served(r: dict) -> str:
    got = r.get("served_n")
    return "-" if got is None else f"{got[0]}" if got[0] == got[1] else f"{got[0]}–{got[1]}"


def markdown(summary: dict) -> str:
    """The Markdown report: the run's set-up and input, per (N, variant) counts, errors,
    latency percentiles (ms) and throughput; the error budget's outcome; MiTA/dense ratios;
    per-stage medians. A "served n" column (the tokens the model read, from the answers) when
    it differs from N for some row."""
    c = summary["config"]
    source = summary.get("input") or GENERATED
    what = (source["text"] if source["source"] != "file"
            else f"rows of {source['path']} ({source['unit']})")
    unit = " (chars)" if source["unit"] == "characters" else ""
    served = any(r.get("served_n") not in (None, [r["n"], r["n"]]) for r in summary["rows"])
    lines = [f"Load test: {c['mode']} loop"
             + (f", concurrency {c['concurrency']}" if c["mode"] == "closed"
                else f", Poisson {c['rate']} req/s")
             + f", {c['requests']} timed requests per (N, variant) after {c['warmup']} warm-up, "
               f"{what}, target {c['url']}"]
    if c["mode"] == "closed":
        lines += ["", CLOSED_LOOP_NOTE]
    lines += input_lines(summary)
    lines += ["", f"| N{unit} | " + ("served n | " if served else "")
              + "variant | sent | ok | errors | p50 ms | p90 ms | p99 ms | req/s | tokens/s |",
              "|---|" + ("---|" if served else "") + "---|---|---|---|---|---|---|---|---|"]
    for r in summary["rows"]:
        errs = ", ".join(f"{k}: {v}" for k, v in r["errors"].items()) or "-"
        first = f"{r['n']} | {_served(r)}" if served else f"{r['n']}"
        if r["ok"]:
            lines.append(f"| {first} | {r['variant']} | {r['sent']} | {r['ok']} | {errs} | "
                         f"{r['p50_ms']:.1f} | {r['p90_ms']:.1f} | {r['p99_ms']:.1f} | "
                         f"{r['throughput_rps']:.2f} | {r['tokens_per_s']:.0f} |")
        else:
            lines.append(f"| {first} | {r['variant']} | {r['sent']} | 0 | {errs} | - | - | - "
                         f"| - | - |")
    gate = summary.get("error_budget")
    if gate:
        lines += ["", f"Errors: {gate['failed']} of {gate['sent']} timed requests not answered "
                      f"200 (back-pressure refusals and transport errors included); "
                      f"--max-error-rate {gate['max_error_rate']:g}: "
                      + ("passed." if gate["passed"] else "FAILED (exit status 1).")]
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
