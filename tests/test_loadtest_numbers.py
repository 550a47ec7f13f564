"""The load tester's numbers, worked out by hand: summarize's percentiles, throughput, errors,
stage medians and MiTA/dense ratios; the whole Markdown report; the files ``write`` writes and
the data its plots draw; and the open loop's Poisson schedule against a real HTTP server on
loopback."""

from __future__ import annotations

import asyncio
import copy
import csv
import dataclasses
import json
import threading
import time
from dataclasses import asdict
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import matplotlib.figure
import matplotlib.image
import matplotlib.pyplot as plt
import pytest
from matplotlib.colors import to_hex

from loadtest.engine import LoadConfig, Sample, check_loopback, run_load, summarize
from loadtest.report import markdown, stage_table, write
from mita.hooks import MIN_STAGE_SAMPLES, VARIANT_COLORS

# Tolerances: pytest.approx's default (1e-6 relative) and rel=1e-12 cover only float rounding
# (seconds × 1e3 to ms, numpy's interpolation); every expected value is exact in decimal.
CFG = LoadConfig(url="http://127.0.0.1:8000", ns=[256], variants=["mita"])
FEW = MIN_STAGE_SAMPLES - 1  # the largest count marked "(few)"


def ok(n, req, served, start, lat, stages=None, staged=True):
    return Sample(n, req, served, 200, start, lat, stages or {}, staged=staged)


def err(n, req, status, start, lat, error="x"):
    return Sample(n, req, None, status, start, lat, error=error)


def only_row(samples, cfg=CFG):
    (row,) = summarize(samples, cfg)["rows"]
    return row


# ---------------------------------------------------------------------------- check_loopback

@pytest.mark.parametrize("url", ["http://127.0.0.1:8000", "http://127.5.6.7/", "https://localhost:1",
                                 "http://LOCALHOST:8000/x", "http://[::1]:8000"])
def test_loopback_targets_are_allowed(url):
    assert check_loopback(url) is None


@pytest.mark.parametrize(("url", "host"), [("http://10.0.0.1:8000", "10.0.0.1"),
                                           ("https://example.com", "example.com"),
                                           ("http://128.0.0.1", "128.0.0.1"),
                                           ("http://[::2]:80", "::2"),
                                           ("http://", "")])
def test_other_hosts_are_refused_by_name(url, host):
    with pytest.raises(ValueError) as e:
        check_loopback(url)
    assert str(e.value) == (f"refusing to load-test {host!r}: only loopback targets "
                            "(127.0.0.0/8, ::1, localhost) are allowed")


@pytest.mark.parametrize("url", ["ftp://127.0.0.1/", "127.0.0.1:8000", "localhost"])
def test_other_schemes_are_refused_by_name(url):
    with pytest.raises(ValueError) as e:
        check_loopback(url)
    assert str(e.value) == f"--url must start with http:// or https://, got {url!r}"


# ---------------------------------------------------------------------------- summarize

def test_percentiles_worked_by_hand():
    """numpy's default (linear) percentile of 10..50 ms: rank (5 - 1)·q/100 between the
    sorted values, so p50 = 30, p90 = 40 + 0.6·10 = 46, p99 = 40 + 0.96·10 = 49.6."""
    lat = [0.040, 0.010, 0.050, 0.030, 0.020]  # not sorted: summarize must not assume it
    row = only_row([ok(256, "mita", "mita", 0.1 * i, x) for i, x in enumerate(lat)])
    assert (row["p50_ms"], row["p90_ms"], row["p99_ms"]) == (
        pytest.approx(30.0, rel=1e-12), pytest.approx(46.0, rel=1e-12),
        pytest.approx(49.6, rel=1e-12))
    two = only_row([ok(256, "mita", "mita", 0.0, 0.010), ok(256, "mita", "mita", 0.0, 0.030)])
    # rank 0.5, 0.9, 0.99 between 10 and 30 ms
    assert (two["p50_ms"], two["p90_ms"], two["p99_ms"]) == (
        pytest.approx(20.0), pytest.approx(28.0), pytest.approx(29.8))
    one = only_row([ok(256, "mita", "mita", 0.0, 0.0125)])
    assert one["p50_ms"] == one["p90_ms"] == one["p99_ms"] == pytest.approx(12.5)


def test_failed_requests_are_not_in_the_percentiles():
    """One 10 ms success and one refusal after 1000 ms: the latency is the success's 10 ms,
    not the 505 ms median of both."""
    row = only_row([ok(256, "mita", "mita", 0.0, 0.010), err(256, "mita", 503, 0.0, 1.0)])
    assert (row["p50_ms"], row["p90_ms"], row["p99_ms"]) == (
        pytest.approx(10.0), pytest.approx(10.0), pytest.approx(10.0))
    assert (row["sent"], row["ok"]) == (2, 1)


def test_throughput_errors_and_counts_worked_by_hand():
    """The phase's wall time runs from its first start to its last answer, failures included:
    here both are failures' (0.5 s and 2.0 + 2.5 = 4.5 s), so 4.0 s for 3 successes:
    0.75 req/s and 0.75 · 256 = 192 tokens/s."""
    samples = [
        err(256, "mita", 503, 0.5, 0.25, "overloaded"),  # the first start
        ok(256, "mita", "mita", 1.0, 0.5),
        err(256, "mita", 503, 1.0, 0.25, "overloaded"),
        ok(256, "mita", "mita", 1.5, 1.0),
        err(256, "mita", 422, 2.0, 2.5, "bad ids"),  # the last answer, at 4.5 s
        err(256, "mita", 0, 2.5, 0.125, "ConnectError"),
        ok(256, "mita", "mita", 3.0, 0.5),
    ]
    row = only_row(samples)
    assert row["throughput_rps"] == pytest.approx(0.75, rel=1e-12)
    assert row["tokens_per_s"] == pytest.approx(192.0, rel=1e-12)
    assert (row["n"], row["variant"], row["sent"], row["ok"]) == (256, "mita", 7, 3)
    assert list(row["errors"].items()) == [("503", 2), ("422", 1), ("0", 1)]  # first seen first
    assert row["served"] == {"mita": 3}

    # Under a second: 2 answers from 0.0 to 0.25 s are 8 req/s, 8 · 1024 tokens/s.
    short = only_row([ok(1024, "mita", "mita", 0.0, 0.25), ok(1024, "mita", "mita", 0.125, 0.125)])
    assert (short["throughput_rps"], short["tokens_per_s"]) == (
        pytest.approx(8.0), pytest.approx(8192.0))
    assert short["errors"] == {}
    # No wall time at all (one instant answer): no rate rather than a division by zero.
    instant = only_row([ok(256, "mita", "mita", 0.0, 0.0)])
    assert (instant["throughput_rps"], instant["tokens_per_s"]) == (None, None)
    assert instant["p50_ms"] == 0.0


def test_a_phase_without_successes():
    row = only_row([err(256, "dense", 503, 0.25 * i, 0.25) for i in range(3)])
    assert row == {"n": 256, "variant": "dense", "served": {}, "sent": 3, "ok": 0,
                   "errors": {"503": 3}, "p50_ms": None, "p90_ms": None, "p99_ms": None,
                   "throughput_rps": 0.0, "tokens_per_s": 0.0, "stages_ms": {}, "stages_n": {}}


def test_served_counts_and_stage_medians_with_a_missing_stage():
    """Per served variant, the median over the responses that were profiled (a response
    without stages is not one of them); a stage one profiled response lacks counts as 0 ms in
    it: dense ffn is the median of 1.0 and 0 = 0.5."""
    samples = [
        ok(512, "ab", "dense", 0.0, 0.1, {"attention": 4.0, "ffn": 1.0}),
        ok(512, "ab", "dense", 0.1, 0.1, {"attention": 6.0}),  # no ffn
        ok(512, "ab", "dense", 0.2, 0.1),  # not profiled
        ok(512, "ab", "mita", 0.3, 0.1, {"zeta": 1.0, "alpha": 2.0, "topk": 3.0}),
        ok(512, "ab", "mita", 0.4, 0.1, {"zeta": 3.0, "alpha": 4.0, "topk": 5.0}),
        ok(512, "ab", "mita", 0.5, 0.1, {"zeta": 2.0, "alpha": 9.0, "topk": 1.0}),
        err(512, "ab", 503, 0.6, 0.1),
    ]
    row = only_row(samples)
    assert row["served"] == {"dense": 3, "mita": 3}
    assert row["stages_ms"] == {"dense": {"attention": 5.0, "ffn": 0.5},
                                "mita": {"topk": 3.0, "alpha": 4.0, "zeta": 2.0}}
    assert row["stages_n"] == {"dense": 2, "mita": 3}
    # Known stages in forward order, others after them alphabetically.
    assert list(row["stages_ms"]["dense"]) == ["attention", "ffn"]
    assert list(row["stages_ms"]["mita"]) == ["topk", "alpha", "zeta"]

    unprofiled = only_row([ok(512, "mita", "mita", 0.0, 0.1)])
    assert (unprofiled["served"], unprofiled["stages_ms"], unprofiled["stages_n"]) == (
        {"mita": 1}, {}, {})
    fused = only_row([ok(512, "mita", "mita", 0.1 * i, 0.1, {"attention": 1.0 + i}, staged=False)
                      for i in range(4)])
    assert (fused["stages_ms"], fused["stages_n"]) == ({"mita": {"attention": 2.5}}, {"mita": 4})


def _ratio_samples():
    """1024: MiTA 30 and 50 ms over 2.0 s of wall time, dense 10 and 30 ms over 0.5 s.
    256: dense refused every time. 2048: MiTA only. 4096: MiTA refused every time."""
    return [
        ok(1024, "mita", "mita", 0.0, 0.030), ok(1024, "mita", "mita", 1.95, 0.050),
        ok(1024, "dense", "dense", 0.0, 0.010), ok(1024, "dense", "dense", 0.47, 0.030),
        ok(1024, "ab", "dense", 0.0, 0.500),
        ok(256, "mita", "mita", 0.0, 0.010), err(256, "dense", 503, 0.0, 0.010),
        ok(2048, "mita", "mita", 0.0, 0.010),
        err(4096, "mita", 503, 0.0, 0.010), ok(4096, "dense", "dense", 0.0, 0.010),
    ]


def test_mita_over_dense_ratios_worked_by_hand():
    """p50 40 / 20 ms = 2; p99 (30 + 0.99·20) / (10 + 0.99·20) = 49.8 / 29.8; throughput
    (2 / 2.0 s) / (2 / 0.5 s) = 0.25. Only where both variants answered at that N."""
    summary = summarize(_ratio_samples(), CFG)
    assert summary["ratios"] == [{"n": 1024,
                                  "p50_ratio_mita_over_dense": pytest.approx(2.0),
                                  "p99_ratio_mita_over_dense": pytest.approx(49.8 / 29.8),
                                  "throughput_ratio_mita_over_dense": pytest.approx(0.25)}]
    # Rows in (N, requested variant) order.
    assert [(r["n"], r["variant"]) for r in summary["rows"]] == [
        (256, "dense"), (256, "mita"), (1024, "ab"), (1024, "dense"), (1024, "mita"),
        (2048, "mita"), (4096, "dense"), (4096, "mita")]
    assert summary["config"] == asdict(CFG)
    assert set(summary) == {"config", "rows", "ratios"}


def test_ratios_for_each_n_in_order():
    samples = [ok(n, v, v, 0.0, lat) for n, v, lat in
               [(4096, "mita", 0.02), (4096, "dense", 0.08), (512, "dense", 0.01),
                (512, "mita", 0.03)]]
    samples += [ok(n, v, v, 0.5, 0.5) for n in (512, 4096) for v in ("mita", "dense")]
    ratios = summarize(samples, CFG)["ratios"]
    assert [x["n"] for x in ratios] == [512, 4096]
    # 512: mita 30, 500 ms, dense 10, 500 ms; p50 265 / 255; both 1 s walls, ratio 1.
    assert ratios[0]["p50_ratio_mita_over_dense"] == pytest.approx(265 / 255)
    assert ratios[1]["p50_ratio_mita_over_dense"] == pytest.approx(260 / 290)
    assert ratios[1]["throughput_ratio_mita_over_dense"] == pytest.approx(1.0)


# ---------------------------------------------------------------------------- report

def _summary() -> dict:
    """A hand-made summary: every kind of row the report prints."""
    cfg = LoadConfig(url="http://127.0.0.1:8000", ns=[256, 1024], variants=["mita", "dense", "ab"],
                     mode="closed", concurrency=8, rate=12.5, requests=40, warmup=2)
    none = {"p50_ms": None, "p90_ms": None, "p99_ms": None}
    rows = [
        {"n": 256, "variant": "dense", "served": {}, "sent": 3, "ok": 0, "errors": {"503": 3},
         **none, "throughput_rps": 0.0, "tokens_per_s": 0.0, "stages_ms": {}, "stages_n": {}},
        {"n": 256, "variant": "mita", "served": {"mita": 5}, "sent": 5, "ok": 5, "errors": {},
         "p50_ms": 12.34, "p90_ms": 45.67, "p99_ms": 78.91, "throughput_rps": 2.3456,
         "tokens_per_s": 600.4736,
         "stages_ms": {"mita": {"attention": 1.5, "topk": 0.25, "embed": 0.75}},
         "stages_n": {"mita": FEW}},
        {"n": 1024, "variant": "ab", "served": {"mita": 4, "dense": 3}, "sent": 10, "ok": 7,
         "errors": {"503": 2, "422": 1}, "p50_ms": 101.26, "p90_ms": 150.0, "p99_ms": 199.94,
         "throughput_rps": 3.5, "tokens_per_s": 3584.0,
         "stages_ms": {"mita": {"topk": 0.5, "attention": 2.0}, "dense": {"attention": 3.0}},
         "stages_n": {"mita": MIN_STAGE_SAMPLES, "dense": 2}},
        {"n": 1024, "variant": "dense", "served": {"dense": 6}, "sent": 7, "ok": 6,
         "errors": {"0": 1}, "p50_ms": 20.0, "p90_ms": 28.0, "p99_ms": 29.8,
         "throughput_rps": 4.0, "tokens_per_s": 4096.0, "stages_ms": {}, "stages_n": {}},
        {"n": 1024, "variant": "mita", "served": {"mita": 6}, "sent": 6, "ok": 6, "errors": {},
         "p50_ms": 40.0, "p90_ms": 48.0, "p99_ms": 49.8, "throughput_rps": 1.0,
         "tokens_per_s": 1024.0,
         "stages_ms": {"mita": {"landmark_scores": 2.5, "attention": 5.0},
                       "mita (staged)": {"landmark_scores": 1.0, "topk": 0.5, "attention": 7.0}},
         "stages_n": {"mita": 6, "mita (staged)": 1}},
    ]
    ratios = [{"n": 1024, "p50_ratio_mita_over_dense": 2.0,
               "p99_ratio_mita_over_dense": 49.8 / 29.8, "throughput_ratio_mita_over_dense": 0.25}]
    return {"config": asdict(cfg), "rows": rows, "ratios": ratios}


NOTE = ("Closed loop: each client sends its next request only after the previous answer, so "
        "while the service stalls no new requests are sent and the stall is counted once, not "
        "for every request that would have arrived (coordinated omission): the percentiles "
        "understate latency under stalls. For latency at an arrival rate, run the open loop "
        "(`--mode open --rate R`), which sends on a Poisson schedule whatever the answers.")

ROWS = """\
| N | variant | sent | ok | errors | p50 ms | p90 ms | p99 ms | req/s | tokens/s |
|---|---|---|---|---|---|---|---|---|---|
| 256 | dense | 3 | 0 | 503: 3 | - | - | - | - | - |
| 256 | mita | 5 | 5 | - | 12.3 | 45.7 | 78.9 | 2.35 | 600 |
| 1024 | ab | 10 | 7 | 503: 2, 422: 1 | 101.3 | 150.0 | 199.9 | 3.50 | 3584 |
| 1024 | dense | 7 | 6 | 0: 1 | 20.0 | 28.0 | 29.8 | 4.00 | 4096 |
| 1024 | mita | 6 | 6 | - | 40.0 | 48.0 | 49.8 | 1.00 | 1024 |
"""


def test_stage_table_rows():
    assert stage_table(_summary()) == [
        (256, "mita", FEW, {"attention": 1.5, "topk": 0.25, "embed": 0.75}),
        (1024, "ab→mita", MIN_STAGE_SAMPLES, {"topk": 0.5, "attention": 2.0}),
        (1024, "ab→dense", 2, {"attention": 3.0}),
        (1024, "mita", 6, {"landmark_scores": 2.5, "attention": 5.0}),
        (1024, "mita (staged)", 1, {"landmark_scores": 1.0, "topk": 0.5, "attention": 7.0}),
    ]
    s = _summary()
    s["rows"][2]["stages_ms"] = {"mita (staged)": {"topk": 1.0}}
    s["rows"][2]["stages_n"] = {"mita (staged)": 2}
    assert stage_table(s)[1] == (1024, "ab→mita (staged)", 2, {"topk": 1.0})


def test_the_whole_markdown_report():
    expected = (
        "Load test: closed loop, concurrency 8, 40 timed requests per (N, variant) after 2 "
        "warm-up, real ListOps (generate_long), target http://127.0.0.1:8000\n"
        "\n"
        f"{NOTE}\n"
        "\n"
        + ROWS +
        "\n"
        "| N | MiTA/dense p50 latency | MiTA/dense p99 latency | MiTA/dense throughput |\n"
        "|---|---|---|---|\n"
        "| 1024 | 2.00× | 1.67× | 0.25× |\n"
        "\n"
        "Per-stage time from profiled responses (ms, summed over layers): the median of n "
        f"responses (n = 1: that one response); rows with n < {MIN_STAGE_SAMPLES} are marked, "
        "too few to compare.\n"
        "\n"
        "| N | variant | n | embed | landmark_scores | topk | attention |\n"
        "|---|---|---|---|---|---|---|\n"
        f"| 256 | mita | {FEW} (few) | 0.75 | - | 0.25 | 1.50 |\n"
        f"| 1024 | ab→mita | {MIN_STAGE_SAMPLES} | - | - | 0.50 | 2.00 |\n"
        "| 1024 | ab→dense | 2 (few) | - | - | - | 3.00 |\n"
        "| 1024 | mita | 6 | - | 2.50 | - | 5.00 |\n"
        "| 1024 | mita (staged) | 1 (few) | - | 1.00 | 0.50 | 7.00 |\n")
    assert markdown(_summary()) == expected


def test_open_loop_markdown_without_ratios_or_stages():
    s = _summary()
    s["config"]["mode"] = "open"
    s["ratios"] = []
    for r in s["rows"]:
        r["stages_ms"], r["stages_n"] = {}, {}
    assert markdown(s) == (
        "Load test: open loop, Poisson 12.5 req/s, 40 timed requests per (N, variant) after 2 "
        "warm-up, real ListOps (generate_long), target http://127.0.0.1:8000\n"
        "\n" + ROWS)


SAMPLES = [
    Sample(256, "mita", "mita", 200, 0.1234567, 0.0125, {"attention": 1.5}),
    Sample(256, "dense", None, 503, 1.0, 0.5, error="overloaded"),
    Sample(1024, "ab", "dense", 200, 2.0000004, 0.25, {"ffn": 0.5}, staged=False),
    Sample(1024, "ab", None, 0, 3.25, 1.0, error="ConnectError: refused, twice"),
]


@pytest.fixture
def drawn(monkeypatch):
    """Every figure saved while the test runs: (figure, path, savefig's keyword arguments)."""
    saved = []
    real = matplotlib.figure.Figure.savefig

    def savefig(self, fname, **kw):
        saved.append((self, fname, kw))
        return real(self, fname, **kw)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", savefig)
    return saved


def test_written_files_read_back(tmp_path, drawn):
    out = tmp_path / "two" / "deep"
    summary = _summary()
    files = write(copy.deepcopy(summary), SAMPLES, out)
    assert files == {"json": out / "loadtest.json", "csv": out / "samples.csv",
                     "summary_csv": out / "summary.csv", "md": out / "loadtest.md",
                     "latency_png": out / "latency_vs_n.png", "stages_png": out / "stages.png"}

    text = files["json"].read_text()
    assert text.startswith('{\n "config": {\n  "url": "http://127.0.0.1:8000",\n')
    assert text.endswith("\n}\n")
    assert json.loads(text) == summary | {"samples": [
        {"n": 256, "requested": "mita", "variant": "mita", "status": 200, "start_s": 0.1234567,
         "latency_s": 0.0125, "stages_ms": {"attention": 1.5}, "error": None, "staged": True},
        {"n": 256, "requested": "dense", "variant": None, "status": 503, "start_s": 1.0,
         "latency_s": 0.5, "stages_ms": {}, "error": "overloaded", "staged": True},
        {"n": 1024, "requested": "ab", "variant": "dense", "status": 200, "start_s": 2.0000004,
         "latency_s": 0.25, "stages_ms": {"ffn": 0.5}, "error": None, "staged": False},
        {"n": 1024, "requested": "ab", "variant": None, "status": 0, "start_s": 3.25,
         "latency_s": 1.0, "stages_ms": {}, "error": "ConnectError: refused, twice",
         "staged": True}]}

    assert files["csv"].read_bytes().decode() == (
        "n,requested,variant,status,start_s,latency_s,error\r\n"
        "256,mita,mita,200,0.123457,0.012500,\r\n"
        "256,dense,,503,1.000000,0.500000,overloaded\r\n"
        "1024,ab,dense,200,2.000000,0.250000,\r\n"
        '1024,ab,,0,3.250000,1.000000,"ConnectError: refused, twice"\r\n')

    with open(files["summary_csv"], newline="") as f:
        assert list(csv.reader(f)) == [
            ["n", "variant", "sent", "ok", "p50_ms", "p90_ms", "p99_ms", "throughput_rps",
             "tokens_per_s", "errors"],
            ["256", "dense", "3", "0", "", "", "", "0.0", "0.0", '{"503": 3}'],
            ["256", "mita", "5", "5", "12.34", "45.67", "78.91", "2.3456", "600.4736", "{}"],
            ["1024", "ab", "10", "7", "101.26", "150.0", "199.94", "3.5", "3584.0",
             '{"503": 2, "422": 1}'],
            ["1024", "dense", "7", "6", "20.0", "28.0", "29.8", "4.0", "4096.0", '{"0": 1}'],
            ["1024", "mita", "6", "6", "40.0", "48.0", "49.8", "1.0", "1024.0", "{}"]]

    assert files["md"].read_text() == markdown(summary)

    # The latency plot: p50 and p99 against N for each requested variant with successes,
    # in the dashboard's colours (an A/B phase grey), log-log.
    (lat_fig, lat_path, lat_kw), (st_fig, st_path, st_kw) = drawn
    assert (lat_path, lat_kw, st_path) == (files["latency_png"], {"dpi": 110},
                                           files["stages_png"])
    (ax,) = lat_fig.axes
    lines = [(ln.get_label(), list(ln.get_xdata()), list(ln.get_ydata()), to_hex(ln.get_color()),
              ln.get_marker(), ln.get_linestyle()) for ln in ax.get_lines()]
    dense, mita = VARIANT_COLORS["dense"], VARIANT_COLORS["mita"]
    assert lines == [("dense p50", [1024], [20.0], dense, "o", "-"),
                     ("dense p99", [1024], [29.8], dense, "x", "--"),
                     ("mita p50", [256, 1024], [12.34, 40.0], mita, "o", "-"),
                     ("mita p99", [256, 1024], [78.91, 49.8], mita, "x", "--"),
                     ("ab p50", [1024], [101.26], "#555555", "o", "-"),
                     ("ab p99", [1024], [199.94], "#555555", "x", "--")]
    assert (ax.get_xscale(), ax.xaxis.get_transform().base) == ("log", 2)
    assert (ax.get_yscale(), ax.yaxis.get_transform().base) == ("log", 10)
    assert (ax.get_xlabel(), ax.get_ylabel()) == ("N (tokens)", "request latency (ms)")
    legend = ax.get_legend()
    assert [t.get_text() for t in legend.get_texts()] == [x[0] for x in lines]
    assert {t.get_fontsize() for t in legend.get_texts()} == {7}
    assert list(ax.texts) == []
    assert matplotlib.image.imread(files["latency_png"]).shape[:2] == (495, 660)  # 6 × 4.5 in

    # The stage plot: one panel per stage-table label, titled with its responses per N.
    assert [a.get_title() for a in st_fig.axes] == [
        f"mita (n = {FEW}–6 per N)", f"ab→mita (n = {MIN_STAGE_SAMPLES} per N)",
        "ab→dense (n = 2 per N)", "mita (staged) (n = 1 per N)"]
    assert st_fig.axes[0].get_ylabel() == "median ms per request"
    data = [{ln.get_label(): (list(ln.get_xdata()), list(ln.get_ydata()))
             for ln in a.get_lines()} for a in st_fig.axes]
    assert data[0] == {"embed": ([256], [0.75]), "landmark_scores": ([1024], [2.5]),
                       "topk": ([256], [0.25]), "attention": ([256, 1024], [1.5, 5.0]),
                       "total": ([256, 1024], [2.5, 7.5])}
    assert data[1] == {"topk": ([1024], [0.5]), "attention": ([1024], [2.0]),
                       "total": ([1024], [2.5])}
    assert data[2] == {"attention": ([1024], [3.0]), "total": ([1024], [3.0])}
    assert data[3] == {"landmark_scores": ([1024], [1.0]), "topk": ([1024], [0.5]),
                       "attention": ([1024], [7.0]), "total": ([1024], [8.5])}
    assert files["stages_png"].stat().st_size > 0
    assert not plt.fignum_exists(lat_fig.number) and not plt.fignum_exists(st_fig.number)

    # Written again into the same folder: the same files, nothing refused.
    assert write(copy.deepcopy(summary), SAMPLES, out) == files


def test_nothing_answered_nothing_profiled(tmp_path, drawn):
    """No successes: the latency plot says so (linear axes, no lines); no stages: no stage
    plot, and one left in the folder from an earlier run is removed."""
    s = _summary()
    for r in s["rows"]:
        r.update(ok=0, stages_ms={}, stages_n={}, p50_ms=None, p90_ms=None, p99_ms=None)
    s["ratios"] = []
    (tmp_path / "stages.png").write_bytes(b"old")
    files = write(s, [], tmp_path)
    assert "stages_png" not in files and not (tmp_path / "stages.png").exists()
    assert set(files) == {"json", "csv", "summary_csv", "md", "latency_png"}
    assert files["csv"].read_bytes() == b"n,requested,variant,status,start_s,latency_s,error\r\n"
    assert json.loads(files["json"].read_text())["samples"] == []
    ((fig, path, _),) = drawn
    (ax,) = fig.axes
    assert path == files["latency_png"] and list(ax.get_lines()) == []
    (text,) = ax.texts
    assert (text.get_text(), text.get_position(), text.get_ha(), text.get_va()) == (
        "no successful requests", (0.5, 0.5), "center", "center")
    assert text.get_transform() == ax.transAxes
    assert (ax.get_xscale(), ax.get_yscale(), ax.get_legend()) == ("linear", "linear", None)
    assert (ax.get_xlabel(), ax.get_ylabel()) == ("N (tokens)", "request latency (ms)")
    assert write(s, [], tmp_path) == files  # no stage plot to remove: no error either


# ---------------------------------------------------------------------------- run_load on loopback

class _Service(ThreadingHTTPServer):
    """A stand-in for the service on 127.0.0.1: answers /v1/classify like the gateway (JSON
    with the served variant and a profile), after ``delay_s``; every ``refuse_every``-th
    request is a 503. Records each request's arrival time and body, and the most requests it
    was answering at once."""

    daemon_threads = True

    def __init__(self, delay_s=0.0, refuse_every=0):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.delay_s, self.refuse_every = delay_s, refuse_every
        self.lock = threading.Lock()
        self.arrivals: list[tuple[float, dict]] = []
        self.inflight = self.max_inflight = 0
        self.thread = threading.Thread(target=self.serve_forever, daemon=True)

    @property
    def url(self):
        return f"http://127.0.0.1:{self.server_address[1]}"

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.shutdown()
        self.server_close()
        self.thread.join(5)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as the client expects

    def do_POST(self):
        srv: _Service = self.server
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with srv.lock:
            srv.arrivals.append((time.perf_counter(), body))
            k = len(srv.arrivals)
            srv.inflight += 1
            srv.max_inflight = max(srv.max_inflight, srv.inflight)
        time.sleep(srv.delay_s)
        if self.path != "/v1/classify":
            code, payload = 404, {"error": "not found"}
        elif srv.refuse_every and k % srv.refuse_every == 0:
            code, payload = 503, {"error": "overloaded"}
        else:
            code, payload = 200, {"label": 3, "probabilities": [0.1] * 10,
                                  "variant": body.get("variant", "dense"), "n": len(body["ids"]),
                                  "model_id": "test", "shadow": None,
                                  "profile": {"stages_ms": {"attention": 1.25}, "staged": True}}
        data = json.dumps(payload).encode()
        with srv.lock:
            srv.inflight -= 1
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


def test_open_loop_sends_poisson_arrivals_at_the_rate():
    """At R = 50 req/s for D = 2 s (requests not the limit) the phase sends the arrivals of a
    Poisson process in [0, D]: their number is Poisson(R·D = 100), standard deviation
    √100 = 10; the test allows ±4σ = ±40 (outside that with probability < 1e-4 whatever the
    seed; with the fixed seed the schedule is the same every run, only timing jitter moves the
    last arrival across D). The mean gap between start times, (last - first) / (count - 1),
    is 1/R = 20 ms; over ~100 exponential gaps its relative spread is ~1/√100 = 10 %, so
    ±40 % again. An inter-arrival of 1/R seconds mistaken for R seconds sends nothing in 2 s."""
    rate, duration = 50.0, 2.0
    with _Service() as srv:
        cfg = LoadConfig(url=srv.url, ns=[16], variants=["mita"], mode="open", rate=rate,
                         requests=1000, warmup=1, duration_s=duration, sequences_per_n=2)
        t = time.perf_counter()
        samples = asyncio.run(run_load(cfg))
        took = time.perf_counter() - t
    count = len(samples)
    assert abs(count - rate * duration) <= 4 * (rate * duration) ** 0.5, count
    starts = sorted(s.start_s for s in samples)
    # the last arrival is due at 1.96 s; 0.1 s for a loaded machine's event loop to send it
    assert 0 <= starts[0] and starts[-1] <= duration + 0.1
    mean_gap = (starts[-1] - starts[0]) / (count - 1)
    assert mean_gap == pytest.approx(1 / rate, rel=0.4), mean_gap
    # The server saw every one of them (and the warm-up), each answered and kept.
    assert len(srv.arrivals) == count + 1
    assert {(s.status, s.variant, s.n) for s in samples} == {(200, "mita", 16)}
    assert all(s.stages_ms == {"attention": 1.25} for s in samples)
    assert {body["variant"] for _, body in srv.arrivals} == {"mita"}
    server_starts = [at for at, _ in srv.arrivals[1:]]
    server_gap = (server_starts[-1] - server_starts[0]) / (count - 1)
    assert server_gap == pytest.approx(1 / rate, rel=0.4)
    assert took < duration + 5  # the phase stops at D, not at the 1000th arrival (~20 s)


def test_open_loop_ends_when_its_requests_are_sent():
    """requests = 20 at 50 req/s: all 20 sent, the last ~20/50 = 0.4 s in (Gamma(20, 1/R):
    sd 0.09 s), long before the 30 s duration."""
    with _Service() as srv:
        cfg = LoadConfig(url=srv.url, ns=[16], variants=["dense"], mode="open", rate=50.0,
                         requests=20, warmup=0, duration_s=30.0, sequences_per_n=1)
        samples = asyncio.run(run_load(cfg))
    assert len(samples) == len(srv.arrivals) == 20
    assert max(s.start_s for s in samples) < 2.0


def test_closed_loop_keeps_concurrency_requests_in_flight():
    """3 workers, 7 timed requests, each answered after 300 ms (long enough for all three to
    connect on a loaded machine): exactly 7 sent (after 2
    warm-ups), at most 3 at once and 3 at some point; every 4th refused with its error kept."""
    with _Service(delay_s=0.3, refuse_every=4) as srv:
        cfg = LoadConfig(url=srv.url, ns=[16], variants=["dense"], concurrency=3, requests=7,
                         warmup=2, sequences_per_n=1)
        samples = asyncio.run(run_load(cfg))
    assert len(samples) == 7 and len(srv.arrivals) == 9
    assert srv.max_inflight == 3
    refused = [s for s in samples if s.status == 503]
    assert len(refused) == 2  # arrivals 4 and 8 (the 2nd and 6th timed)
    assert all((s.variant, s.error) == (None, "overloaded") for s in refused)
    assert all(s.variant == "dense" and s.latency_s >= 0.05 for s in samples if s.status == 200)
    row = only_row(samples, dataclasses.replace(cfg, variants=["dense"]))
    assert (row["sent"], row["ok"], row["errors"]) == (7, 5, {"503": 2})
