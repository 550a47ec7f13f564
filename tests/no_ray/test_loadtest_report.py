"""Load-test summary and report files from hand-made samples (no service needed)."""

from __future__ import annotations

import asyncio
import dataclasses
import io
import json

import httpx
import numpy as np
import pytest

from loadtest import engine
from loadtest.engine import LoadConfig, Sample, run_load, summarize
from loadtest.report import markdown, write
from mita.hooks import VARIANT_COLORS

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
    from mita.tools.plots import stage_figure

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
    assert mds[0] == mds[1] == "| N | variant | n | " + " | ".join(STAGE_ORDER) + " |"
    assert legends[0] == legends[1] == [*STAGE_ORDER, "total"]


def test_stage_figures_say_how_many_responses_they_are_of():
    """Found by a user: a single profiled response was reported as the "median". Each stage
    row says n, and rows under MIN_STAGE_SAMPLES are marked as too few to compare."""
    one = [Sample(1024, "mita", "mita", 200, 0.0, 0.05, {"qkv_proj": 13.7})]
    many = [Sample(1024, "dense", "dense", 200, 0.1 * i, 0.05, {"qkv_proj": 2.0 + i})
            for i in range(6)]
    summary = summarize(one + many, CFG)
    assert {r["variant"]: r["stages_n"] for r in summary["rows"]} == {
        "mita": {"mita": 1}, "dense": {"dense": 6}}
    md = markdown(summary)
    assert "the median of n responses (n = 1: that one response)" in md
    assert "| 1024 | dense | 6 | 4.50 |" in md and "| 1024 | mita | 1 (few) | 13.70 |" in md


def _latency_png_pixels(tmp_path, variants) -> dict[str, int]:
    """Pixels of exactly each variant's colour in the latency plot ``write`` draws."""
    import matplotlib.image

    samples = [Sample(n, v, v, 200, 0.01 * i, 0.01 * (1 + i) * (2 if v == "dense" else 1))
               for v in variants for n in (256, 1024) for i in range(3)]
    files = write(summarize(samples, CFG), samples, tmp_path)
    rgb = (matplotlib.image.imread(files["latency_png"])[..., :3] * 255).round().astype(int)
    return {v: int((rgb == [int(c[i:i + 2], 16) for i in (1, 3, 5)]).all(axis=-1).sum())
            for v, c in VARIANT_COLORS.items()}


def test_latency_plot_draws_each_variant_in_the_dashboards_colour(tmp_path):
    """Found by a user: the plot's mita and dense lines were matplotlib's default blue and
    orange, not the dashboard's (mita.hooks.VARIANT_COLORS, served in /v1/stats)."""
    count = _latency_png_pixels(tmp_path, ["mita", "dense"])
    assert count["mita"] > 50 and count["dense"] > 50, count


def test_progress_bar_counts_warm_ups_and_every_phase(monkeypatch):
    """Found by a user: the bar counted timed requests only, so its ETA said "2 s left" before
    a 100 s phase (its warm-ups not counted). It now counts every request of every phase,
    warm-ups included, and a phase cut short by --duration-s advances it by what it skipped."""
    bars = []

    class Bar(engine.Progress):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw, file=io.StringIO())
            self.seen: list[tuple[int, int]] = []  # (done, total) after each update
            bars.append(self)

        def update(self, k=1):
            super().update(k)
            self.seen.append((self.done, self.total))

    def answer(request):
        return httpx.Response(200, json={"variant": "mita", "profile": {}})

    monkeypatch.setattr(engine, "Progress", Bar)
    monkeypatch.setattr(engine.httpx, "AsyncHTTPTransport",
                        lambda **kw: httpx.MockTransport(answer))
    cfg = LoadConfig(url="http://127.0.0.1:8000", ns=[16, 32], variants=["mita", "dense"],
                     concurrency=2, requests=4, warmup=3, sequences_per_n=1)
    samples = asyncio.run(run_load(cfg))
    (bar,) = bars
    assert len(samples) == 4 * 4 and bar.total == 4 * (3 + 4)
    assert bar.seen[-1] == (28, 28)
    # After the second phase's warm-ups: the first phase's 3 + 4 and these 3 are done; its 4
    # timed requests and two whole phases (2 × 7) remain.
    assert bar.seen[9] == (10, 28)

    # A phase that runs out of time (open loop, 50 requests due over 100 s, 0.5 s allowed)
    # still ends the bar at its total.
    bars.clear()
    short = dataclasses.replace(cfg, ns=[16], variants=["mita"], mode="open", rate=0.5,
                                requests=50, warmup=1, duration_s=0.5)
    sent = asyncio.run(run_load(short))
    (bar,) = bars
    assert len(sent) < 50 and bar.total == 51 and bar.seen[-1] == (51, 51)
