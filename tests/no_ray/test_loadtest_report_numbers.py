"""The load tester's report, worked out by hand: the whole Markdown report, the files
``write`` writes and the data its plots draw."""

from __future__ import annotations

import copy
import csv
import json
from dataclasses import asdict

import matplotlib.figure
import matplotlib.image
import matplotlib.pyplot as plt
import pytest
from matplotlib.colors import to_hex

from loadtest.engine import LoadConfig, Sample
from loadtest.report import markdown, stage_table, write
from mita.hooks import MIN_STAGE_SAMPLES, VARIANT_COLORS

FEW = MIN_STAGE_SAMPLES - 1  # the largest count marked "(few)"


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
         "latency_s": 0.0125, "stages_ms": {"attention": 1.5}, "error": None, "staged": True,
         "served_n": None},
        {"n": 256, "requested": "dense", "variant": None, "status": 503, "start_s": 1.0,
         "latency_s": 0.5, "stages_ms": {}, "error": "overloaded", "staged": True,
         "served_n": None},
        {"n": 1024, "requested": "ab", "variant": "dense", "status": 200, "start_s": 2.0000004,
         "latency_s": 0.25, "stages_ms": {"ffn": 0.5}, "error": None, "staged": False,
         "served_n": None},
        {"n": 1024, "requested": "ab", "variant": None, "status": 0, "start_s": 3.25,
         "latency_s": 1.0, "stages_ms": {}, "error": "ConnectError: refused, twice",
         "staged": True, "served_n": None}]}

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
    # made without pyplot: no figure of a report stays open in a long-lived process
    assert plt.get_fignums() == [] and lat_fig.canvas.manager is None

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
