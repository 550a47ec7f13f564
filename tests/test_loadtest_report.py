"""Load-test summary and report files from hand-made samples (no service needed)."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from loadtest.engine import LoadConfig, Sample, summarize
from loadtest.report import markdown, write

CFG = LoadConfig(url="http://127.0.0.1:8000", ns=[256], variants=["ab"])


def test_ab_stage_medians_are_kept_apart_per_served_variant():
    rng = np.random.default_rng(0)
    samples = []
    for i in range(9):
        served = "mita" if i % 3 else "dense"
        stages = {"embed": float(rng.uniform(1, 2)), "attention": float(rng.uniform(5, 50))}
        if served == "mita":
            stages["topk"] = float(rng.uniform(0.1, 1))
        samples.append(Sample(256, "ab", served, 200, 0.1 * i, 0.05, stages))
    row = summarize(samples, CFG)["rows"][0]
    assert row["served"] == {"dense": 3, "mita": 6}
    for v in ("mita", "dense"):
        mine = [s.stages_ms for s in samples if s.variant == v]
        assert row["stages_ms"][v] == {k: float(np.median([m[k] for m in mine]))
                                       for k in mine[0]}
    assert "topk" not in row["stages_ms"]["dense"]
    md = markdown(summarize(samples, CFG))
    assert "| 256 | ab→mita |" in md and "| 256 | ab→dense |" in md


def test_report_when_every_request_was_refused(tmp_path):
    samples = [Sample(256, "ab", None, 503, 0.1 * i, 0.01, error="overloaded") for i in range(4)]
    samples.append(Sample(256, "ab", None, 0, 0.5, 0.01, error="ConnectError: refused"))
    summary = summarize(samples, CFG)
    files = write(summary, samples, tmp_path)
    assert all(f.stat().st_size > 0 for f in files.values())
    row = json.loads(files["json"].read_text())["rows"][0]
    assert (row["ok"], row["errors"], row["p50_ms"], row["stages_ms"]) == (
        0, {"503": 4, "0": 1}, None, {})
    assert "| 256 | ab | 5 | 0 | 503: 4, 0: 1 |" in files["md"].read_text()


def test_summary_percentiles_equal_numpy():
    lat = np.random.default_rng(1).uniform(0.01, 0.2, 50)
    samples = [Sample(1024, "mita", "mita", 200, 0.01 * i, float(x)) for i, x in enumerate(lat)]
    row = summarize(samples, CFG)["rows"][0]
    for q in (50, 90, 99):
        assert row[f"p{q}_ms"] == pytest.approx(float(np.percentile(lat * 1e3, q)), rel=1e-12)
    assert row["stages_ms"] == {}


def test_fused_and_sampled_staged_stage_medians_are_kept_apart():
    """A fused MiTA answers most requests with merged stages and one in staged_profile_every
    with all seven: their medians are reported apart ("mita" and "mita (staged)"), never a
    median that mixes a fused landmark_scores with a staged one or counts a missing topk as 0."""
    fused = [Sample(1024, "mita", "mita", 200, 0.1 * i, 0.05,
                    {"landmark_scores": 2.0 + i, "attention": 5.0}, staged=False)
             for i in range(5)]
    staged = [Sample(1024, "mita", "mita", 200, 0.6, 0.09,
                     {"landmark_scores": 1.0, "topk": 0.5, "attention": 7.0}, staged=True)]
    row = summarize(fused + staged, CFG)["rows"][0]
    assert row["stages_ms"] == {"mita": {"landmark_scores": 4.0, "attention": 5.0},
                                "mita (staged)": {"landmark_scores": 1.0, "topk": 0.5,
                                                  "attention": 7.0}}
    assert "| 1024 | mita (staged) |" in markdown(summarize(fused + staged, CFG))
    only_staged = summarize(staged, CFG)["rows"][0]  # backend torch: every forward staged
    assert list(only_staged["stages_ms"]) == ["mita"]


def test_closed_loop_report_warns_of_coordinated_omission():
    samples = [Sample(256, "mita", "mita", 200, 0.1 * i, 0.01) for i in range(3)]
    closed = markdown(summarize(samples, CFG))
    assert "coordinated omission" in closed and "--mode open --rate R" in closed
    open_cfg = dataclasses.replace(CFG, mode="open")
    assert "coordinated omission" not in markdown(summarize(samples, open_cfg))


def test_stage_order_and_colours_do_not_depend_on_arrival():
    """Two runs whose responses list the stages in different orders give the same stage
    table columns and the same plot: forward order, each stage in its one colour."""
    from matplotlib.colors import to_hex

    from mita.hooks import STAGE_COLORS, STAGE_ORDER
    from profiler.plots import stage_figure

    rng = np.random.default_rng(2)
    mds, legends = [], []
    for seed in (0, 1):
        order = list(STAGE_ORDER)
        np.random.default_rng(seed).shuffle(order)
        samples = [Sample(n, "mita", "mita", 200, 0.1 * i, 0.05,
                          {st: float(rng.uniform(0.01, 5)) for st in order})
                   for i, n in enumerate((256, 256, 1024, 1024))]
        summary = summarize(samples, CFG)
        header = [x for x in markdown(summary).splitlines() if x.startswith("| N | variant")][-1]
        mds.append(header)
        assert list(summary["rows"][0]["stages_ms"]["mita"]) == list(STAGE_ORDER)
        fig = stage_figure({"mita": [(r["n"], r["stages_ms"]["mita"])
                                     for r in summary["rows"]]}, "ms")
        (legend,) = fig.legends
        legends.append([t.get_text() for t in legend.get_texts()])
        lines = {ln.get_label(): to_hex(ln.get_color()) for ln in fig.axes[0].get_lines()}
        assert lines == {**{st: STAGE_COLORS[st] for st in STAGE_ORDER}, "total": "#000000"}
    assert mds[0] == mds[1] == "| N | variant | " + " | ".join(STAGE_ORDER) + " |"
    assert legends[0] == legends[1] == [*STAGE_ORDER, "total"]
