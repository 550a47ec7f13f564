"""Every number /v1/stats hands a user, pinned on hand-made inputs (issue 33): the window's
percentiles, rates, ratios and bins, and the rows it makes of Prometheus' answers.
Expected values are worked out by hand in the comments; nothing here needs Ray, a server or
a subprocess."""

from __future__ import annotations

import warnings

import pytest

import service.stats as stats_mod
from service.stats import (
    StatsWindow,
    _bin_starts,
    _prometheus_stats,
    _sort,
    ab_split,
    bin_seconds,
    bucket_ratios,
    matched_ratios,
    summarize,
)

from ..fakes import FakeClock

# numpy's linear interpolation and the s -> ms conversion round in the last bits; every
# mistake these tests look for moves a value by far more than this.
REL = 1e-9


# ---- the window and its summary -------------------------------------------------------------

NOW = 10_002.0  # window 300 s -> bins of 5 s aligned to multiples of 5: 9,700 … 10,000


def rq(t, variant, status, n=None, latency_s=None, override=False):
    return (t, variant, str(status), n, latency_s, override)


def approx_ms(x: float):
    return pytest.approx(x, rel=REL)


def mixed_snapshot() -> tuple:
    """Requests: MiTA (policy) 10, 20, 30, 40, 100 ms at N = 1,000 and a 500 after 1 s at
    N = 20,000; dense 20 ms (policy) and 50, 60 ms (overrides) at N = 1,000, a 503 without a
    latency; one refused before routing. The last MiTA record is 4 s after ``now`` (the wall
    clock stepped back): it goes to the last bin."""
    requests = [rq(9702.0, "mita", 200, 1000, 0.010), rq(9704.5, "mita", 200, 1000, 0.020),
                rq(9705.0, "mita", 200, 1000, 0.030), rq(9705.0, "mita", 500, 20_000, 1.0),
                rq(9999.0, "mita", 200, 1000, 0.040), rq(10_006.0, "mita", 200, 1000, 0.100),
                rq(9850.0, "dense", 200, 1000, 0.020),
                rq(9850.0, "dense", 200, 1000, 0.050, True),
                rq(9850.0, "dense", 200, 1000, 0.060, True),
                rq(9900.0, "dense", 503), rq(9900.0, "none", 413)]
    return (NOW, 300.0, False, requests, [], [])


def test_summary_counts_percentiles_and_the_policy_split():
    s = summarize(mixed_snapshot())
    assert (s["window_s"], s["bin_s"], s["generated_at"], s["truncated"]) == (
        300.0, 5.0, NOW, False)
    assert (s["source"], s["scope"], s["min_stage_samples"]) == ("local", "replica", 5)
    # sorted: mita, dense, none; statuses as strings
    assert s["requests"] == [{"variant": "mita", "status": "200", "count": 5},
                             {"variant": "mita", "status": "500", "count": 1},
                             {"variant": "dense", "status": "200", "count": 3},
                             {"variant": "dense", "status": "503", "count": 1},
                             {"variant": "none", "status": "413", "count": 1}]
    # numpy linear: p95 of 10, 20, 30, 40, 100 at rank 0.95 * 4 = 3.8 -> 40 + 0.8 * 60 = 88,
    # p99 at 3.96 -> 97.6; dense 20, 50, 60: p95 at 1.9 -> 59, p99 at 1.98 -> 59.8. The 500
    # has a latency: it counts in the latency rows (not in the timeline, below).
    want = [("mita", "le_1024", 5, 200.0, 30.0, 88.0, 97.6),
            ("mita", "le_65536", 1, 1000.0, 1000.0, 1000.0, 1000.0),
            ("dense", "le_1024", 3, 130.0, 50.0, 59.0, 59.8)]
    got = [(r["variant"], r["n_bucket"], r["count"], r["sum_ms"], r["p50_ms"], r["p95_ms"],
            r["p99_ms"]) for r in s["latency"]]
    assert [g[:3] for g in got] == [w[:3] for w in want]
    for g, w in zip(got, want, strict=True):
        assert g[3:] == pytest.approx(w[3:], rel=REL)
    # answered (200) only: 5 + 1 routed by the policy, 2 overrides
    assert s["answered"] == {"policy": {"mita": 5, "dense": 1}, "override": {"dense": 2}}
    ab = ab_split(s["answered"], {"mita": 3.0, "dense": 1.0}, False, "x-key")
    assert ab == {"policy": "weighted", "weights": {"mita": 3.0, "dense": 1.0}, "shadow": False,
                  "sticky_header": "x-key",
                  "observed": {"mita": pytest.approx(5 / 6, rel=REL),
                               "dense": pytest.approx(1 / 6, rel=REL)},
                  "observed_requests": 6, "observed_basis": "policy_routed",
                  "overrides": {"mita": 0, "dense": 2}}
    # MiTA at N = 1,000 only, dense at N = 1,000: like for like, 30 / 50 (medians)
    (ratio,) = s["ratios"]
    assert ratio["ratio"] == pytest.approx(0.6, rel=REL)


def test_timeline_bins_count_answered_requests_only():
    s = summarize(mixed_snapshot())
    starts = [9700.0 + 5 * i for i in range(61)]  # floor(9,702 / 5) * 5 = 9,700 … 10,000
    mita = [p for p in s["timeline"] if p["variant"] == "mita"]
    dense = [p for p in s["timeline"] if p["variant"] == "dense"]
    assert [p["t"] for p in mita] == starts == [p["t"] for p in dense]
    assert len(s["timeline"]) == 122
    busy = {0: (2, 15.0, 19.9), 1: (1, 30.0, 30.0), 59: (1, 40.0, 40.0), 60: (1, 100.0, 100.0)}
    for i, p in enumerate(mita):  # bin 0: 10, 20 ms -> p50 15, p99 10 + 0.99 * 10 = 19.9
        n, p50, p99 = busy.get(i, (0, None, None))
        assert (p["requests"], p["rps"]) == (n, n / 5), i
        assert (p["p50_ms"], p["p99_ms"]) == ((None, None) if p50 is None else pytest.approx(
            (p50, p99), rel=REL)), i
    assert [(i, p["requests"]) for i, p in enumerate(dense) if p["requests"]] == [(30, 3)]
    assert (dense[30]["rps"], dense[30]["p50_ms"]) == (0.6, pytest.approx(50.0, rel=REL))
    assert dense[30]["p99_ms"] == pytest.approx(59.8, rel=REL)
    # per N bucket: each (variant, bucket) with a latency; MiTA's N = 20,000 only ever failed
    by_n = {}
    for p in s["timeline_by_n"]:
        by_n.setdefault((p["variant"], p["n_bucket"]), []).append(p["requests"])
    le_1024 = [p for p in s["timeline_by_n"] if p["n_bucket"] == "le_1024"]
    assert [(p["variant"], p["p50_ms"]) for p in le_1024 if p["requests"]] == [
        ("mita", approx_ms(15.0)), ("mita", approx_ms(30.0)), ("mita", approx_ms(40.0)),
        ("mita", approx_ms(100.0)), ("dense", approx_ms(50.0))]
    assert {k: sum(v) for k, v in by_n.items()} == {
        ("mita", "le_1024"): 5, ("mita", "le_65536"): 0, ("dense", "le_1024"): 3}
    assert all(len(v) == 61 for v in by_n.values())


@pytest.mark.parametrize("window_s,bin_s", [(1, 1.0), (60, 1.0), (60.5, 2.0), (61, 2.0),
                                            (120, 2.0), (121, 3.0), (300, 5.0),
                                            (3600, 60.0)])
def test_bin_width_is_the_window_in_60_whole_seconds(window_s, bin_s):
    assert bin_seconds(window_s) == bin_s


def test_bin_starts_are_aligned_to_the_bin_width():
    assert _bin_starts(9702.0, 10_002.0, 5.0) == [9700.0 + 5 * i for i in range(61)]
    assert _bin_starts(10.0, 20.0, 5.0) == [10.0, 15.0, 20.0]  # ends on an edge: included
    assert _bin_starts(11.0, 19.9, 5.0) == [10.0, 15.0]


def test_window_defaults_keep_five_minutes_and_20000_records_of_each_kind():
    w = StatsWindow()
    assert w.retention_s == 300.0
    assert w.requests.maxlen == w.forwards.maxlen == w.shadows.maxlen == 20_000


def test_window_keeps_records_exactly_to_its_edges(monkeypatch):
    """Retention 100 s at now = 10,000: a record at 9,900.0 is kept, one at 9,899.5 dropped;
    a window starting exactly at a record includes it; 0 or too long a window is the
    retention."""
    clock = FakeClock(9899.5)
    monkeypatch.setattr(stats_mod, "time", clock)
    w = StatsWindow(retention_s=100.0)
    w.add_request("mita", 200, 10, 0.01)
    clock.now = 9900.0
    w.add_request("dense", 200, 10, 0.02, override=True)
    clock.now = 9990.0
    w.add_forward("mita", "le_1024", {"embed": 1.5, "attention": 2.5})
    w.add_shadow("mita", 1, 0)
    w.add_shadow_drop("dense")
    clock.now = 10_000.0
    now, window_s, truncated, requests, forwards, shadows = w.snapshot()
    assert (now, window_s, truncated) == (10_000.0, 100.0, False)
    assert requests == [(9900.0, "dense", "200", 10, 0.02, True)]
    assert len(w.requests) == 1  # the older one is gone for good
    assert forwards == [(9990.0, "mita", "le_1024", (("embed", 1.5), ("attention", 2.5)))]
    assert shadows == [(9990.0, "mita", True, 0.0), (9990.0, "dense", None, None)]
    assert type(shadows[0][2]) is bool and type(shadows[0][3]) is float  # 1 == True
    _, window_s, _, requests, forwards, _ = w.snapshot(10.0)
    assert (window_s, requests, len(forwards)) == (10.0, [], 1)
    assert w.snapshot(0)[1] == 100.0 and w.snapshot(1000.0)[1] == 100.0
    assert w.summary(10.0)["window_s"] == 10.0 and w.summary()["window_s"] == 100.0


def test_window_says_when_the_record_cap_cut_it_short(monkeypatch):
    """Cap 2: after records at 9,990, 9,995 and 9,996 the first is lost. A window reaching
    back to 9,995 (or further) may have lost records: truncated; one from 9,995.5 lost none."""
    clock = FakeClock(9990.0)
    monkeypatch.setattr(stats_mod, "time", clock)
    w = StatsWindow(retention_s=100.0, max_records=2)
    for t in (9990.0, 9995.0, 9996.0):
        clock.now = t
        w.add_forward("mita", "le_1024", {"embed": 1.0})
    w.add_request("mita", 200)  # one of two places: not full
    assert w.requests[0] == (9996.0, "mita", "200", None, None, False)
    clock.now = 10_000.0
    assert [w.snapshot(x)[2] for x in (10.0, 5.0, 4.5)] == [True, True, False]
    assert len(w.snapshot(10.0)[4]) == 2


def test_shadow_stats_count_dropped_calls_apart():
    """KL 0.1, 0.3 (agree) and 0.8 (disagree): rate 2/3, mean 0.4, median 0.3; two calls
    dropped (no KL, not comparisons)."""
    shadows = [(1.0, "mita", True, 0.1), (1.0, "dense", None, None),
               (2.0, "dense", True, 0.3), (2.0, "mita", False, 0.8),
               (3.0, "mita", None, None)]
    s = summarize((10.0, 60.0, False, [], [], shadows))["shadow"]
    assert s == {"comparisons": 3, "agree": 2, "rate": pytest.approx(2 / 3, rel=REL),
                 "kl_mean": pytest.approx(0.4, rel=REL), "kl_p50": pytest.approx(0.3, rel=REL),
                 "dropped": 2}
    with warnings.catch_warnings():  # no mean of nothing ("Mean of empty slice" in the log)
        warnings.simplefilter("error")
        only_drops = summarize((10.0, 60.0, False, [], [], [shadows[1], shadows[4]]))["shadow"]
    assert only_drops == {"comparisons": 0, "agree": 0, "rate": None, "kl_mean": None,
                          "kl_p50": None, "dropped": 2}


def test_stage_rows_percentiles_and_order():
    forwards = [(1.0, "mita", "le_1024", (("embed", float(i)), ("attention", 10.0 * i)))
                for i in (1, 2, 3, 4)]
    forwards.append((1.0, "mita", "le_4096", (("topk", 7.0),)))
    s = summarize((10.0, 60.0, False, [], forwards, []))
    # embed 1..4: p50 2.5, p95 at rank 2.85 -> 3.85; attention ×10
    assert [(r["n_bucket"], r["stage"], r["count"]) for r in s["stages"]] == [
        ("le_1024", "embed", 4), ("le_1024", "attention", 4), ("le_4096", "topk", 1)]
    r = s["stages"][1]
    assert (r["sum_ms"], r["p50_ms"], r["p95_ms"]) == pytest.approx((100.0, 25.0, 38.5),
                                                                     rel=REL)


def test_rows_are_sorted_by_variant_bucket_stage_and_status():
    rows = [{"variant": "none", "status": "413"}, {"variant": "dense", "status": "503"},
            {"variant": "dense", "status": "200"}, {"variant": "mita", "n_bucket": "le_4096"},
            {"variant": "mita", "n_bucket": "le_1024", "stage": "head"},
            {"variant": "mita", "n_bucket": "le_1024", "stage": "embed"},
            {"variant": "mita", "n_bucket": "le_1024", "stage": "nonesuch"},
            {"variant": "", "status": "100"}]  # a Prometheus series without the label
    assert _sort(rows) == [rows[5], rows[4], rows[6], rows[3], rows[2], rows[1], rows[0],
                           rows[7]]


def test_ab_split_with_weights_not_summing_to_one_and_missing_variants():
    ab = ab_split({"policy": {"mita": 4}, "override": {}}, {"mita": 0.3, "dense": 0.2}, True,
                  "x-k")
    assert (ab["weights"], ab["observed"], ab["observed_requests"], ab["overrides"]) == (
        {"mita": 0.3, "dense": 0.2}, {"mita": 1.0, "dense": 0.0}, 4, {"mita": 0, "dense": 0})
    none = ab_split({"policy": {}, "override": {"dense": 3}}, {"mita": 1.0}, False, "x-k")
    assert (none["observed"], none["observed_requests"], none["overrides"]) == (
        {}, 0, {"mita": 0, "dense": 3})
    prom = ab_split({"all": {"dense": 3.0, "mita": 1.0}}, {"mita": 1.0}, False, "x-k")
    assert (prom["observed"], prom["observed_requests"], prom["observed_basis"],
            prom["overrides"]) == ({"mita": 0.25, "dense": 0.75}, 4.0, "all_answered", None)


def test_like_for_like_ratios_weigh_each_n_by_its_smaller_count():
    """N = 2,000: MiTA 3, 4, 5 ms against dense 8, 8 (ratio 0.5, weight 2); N = 1,500: 0.5 ms
    against 0.25, 0.25 (ratio 2, weight 1): exp((2 ln 0.5 + ln 2) / 3) = 2^(-1/3). N = 20,000
    alone in its bucket: 6 / 2 = 3, after two buckets with nothing to compare. A zero median
    (N = 100, 200) and an N one variant never served (300) are not compared."""
    by_n = {("mita", 2000): [3.0, 5.0, 4.0], ("dense", 2000): [8.0, 8.0],
            ("mita", 1500): [0.5], ("dense", 1500): [0.25, 0.25],
            ("mita", 100): [0.0], ("dense", 100): [1.0],
            ("mita", 200): [2.0], ("dense", 200): [0.0], ("dense", 300): [5.0],
            ("mita", 20_000): [6.0], ("dense", 20_000): [2.0]}
    large, far = matched_ratios(by_n)
    assert far == {"n_bucket": "le_65536", "ratio": pytest.approx(3.0, rel=REL),
                   "mita_p50_ms": 6.0, "dense_p50_ms": 2.0, "like_for_like": True,
                   "n_values": 1, "n_min": 20_000, "n_max": 20_000}
    # medians over the matched requests: MiTA 0.5, 3, 4, 5 -> 3.5; dense 0.25, 0.25, 8, 8
    assert large == {"n_bucket": "le_4096", "ratio": pytest.approx(2 ** (-1 / 3), rel=REL),
                     "mita_p50_ms": 3.5, "dense_p50_ms": 4.125, "like_for_like": True,
                     "n_values": 2, "n_min": 1500, "n_max": 2000}


def test_bucket_ratios_only_where_both_medians_are_known():
    rows = [{"variant": "mita", "n_bucket": "le_262144", "p50_ms": 6.0},
            {"variant": "dense", "n_bucket": "le_262144", "p50_ms": 2.0},
            {"variant": "mita", "n_bucket": "le_1024", "p50_ms": 10.0},
            {"variant": "dense", "n_bucket": "le_1024", "p50_ms": 40.0},
            {"variant": "mita", "n_bucket": "le_4096", "p50_ms": None},
            {"variant": "dense", "n_bucket": "le_4096", "p50_ms": 5.0},
            {"variant": "mita", "n_bucket": "le_16384", "p50_ms": 3.0},
            {"variant": "dense", "n_bucket": "le_16384", "p50_ms": 0.0},
            {"variant": "dense", "n_bucket": "le_65536", "p50_ms": 1.0}]
    rest = {"like_for_like": False, "n_values": None, "n_min": None, "n_max": None}
    assert bucket_ratios(rows) == [
        {"n_bucket": "le_1024", "mita_p50_ms": 10.0, "dense_p50_ms": 40.0, "ratio": 0.25,
         **rest},
        {"n_bucket": "le_262144", "mita_p50_ms": 6.0, "dense_p50_ms": 2.0, "ratio": 3.0,
         **rest}]


def test_prometheus_stats_rows_in_milliseconds_and_rates_in_requests():
    """Prometheus' answers (seconds, rates) become the same dict as local mode's: series with
    a zero count or variant "none" are left out of the latency and stage rows, NaN is None,
    a bin's requests = rate × bin width."""
    now, bin_s = 1_000_000.0, 5.0
    steps = [now - 10, now - 5, now]

    def inst(*rows):
        return [{"metric": m, "value": [now, str(v)]} for m, v in rows]

    def rng(*rows):
        return [{"metric": m, "values": [[t, str(v)] for t, v in zip(steps, vs, strict=True)]}
                for m, vs in rows]
    mita, dense = {"variant": "mita", "n_bucket": "le_1024"}, {"variant": "dense",
                                                                "n_bucket": "le_1024"}
    att = {"variant": "mita", "n_bucket": "le_1024", "stage": "attention"}
    res = {k: [] for k in (*stats_mod.INSTANT, *stats_mod.RANGE)}
    res |= {"requests": inst(({"variant": "mita", "status": "200"}, 12),
                             ({"variant": "mita", "status": "500"}, 0),
                             ({"variant": "none", "status": "422"}, 2),
                             ({"variant": "dense", "status": "200"}, 4),
                             ({"variant": "dense", "status": "504"}, 1),
                             ({"status": "503"}, 1)),  # Prometheus leaves out empty labels
            "lat_count": inst((mita, 12), (dense, 4), ({"variant": "none",
                                                        "n_bucket": "le_1024"}, 2),
                              ({"variant": "dense", "n_bucket": "le_4096"}, 0),
                              ({"variant": "mita", "n_bucket": "le_16384"}, 1)),
            "lat_sum": inst((mita, 0.6)),
            "lat_p50": inst((mita, 0.04), (dense, 0.1)), "lat_p95": inst((mita, 0.09)),
            "lat_p99": inst((mita, "NaN")),
            "stage_count": inst((att, 12), (att | {"variant": "dense"}, 0),
                                (att | {"variant": "none"}, 3), (att | {"stage": "embed"}, 12)),
            "stage_sum": inst((att, 0.024)), "stage_p50": inst((att, 0.002)),
            "stage_p95": inst((att, 0.003)),
            "rps": rng(({"variant": "mita"}, [0, 2.0, "NaN"])),
            "p50": rng(({"variant": "mita"}, ["NaN", 0.05, 0.06])),
            "p99": rng(({"variant": "mita"}, [0.1, "NaN", 0.2])),
            "n_p99": rng((mita, [0.3, 0.3, "NaN"])),
            "n_rps": rng((mita, [0, 1.0, 1.0])),
            # KL without comparisons in the window (an older histogram's rate): no KL shown
            "kl_mean": inst(({}, 0.05)), "kl_p50": inst(({}, 0.04)),
            "shadow_dropped": inst(({}, 2))}
    s = _prometheus_stats(res, now, 15, bin_s, steps)
    assert (s["source"], s["scope"], s["window_s"], s["bin_s"], s["truncated"]) == (
        "prometheus", "all_replicas", 15.0, 5.0, False)
    assert type(s["window_s"]) is float and s["generated_at"] == now
    assert s["min_stage_samples"] == 5
    assert s["requests"] == [{"variant": "mita", "status": "200", "count": 12.0},
                             {"variant": "dense", "status": "200", "count": 4.0},
                             {"variant": "dense", "status": "504", "count": 1.0},
                             {"variant": "none", "status": "422", "count": 2.0},
                             {"variant": "", "status": "503", "count": 1.0}]
    assert s["answered"] == {"all": {"mita": 12.0, "dense": 4.0}}
    approx = pytest.approx  # s -> ms: one multiplication's rounding
    assert s["latency"] == [
        {"variant": "mita", "n_bucket": "le_1024", "count": 12.0, "sum_ms": approx(600.0),
         "p50_ms": approx(40.0), "p95_ms": approx(90.0), "p99_ms": None},
        {"variant": "mita", "n_bucket": "le_16384", "count": 1.0, "sum_ms": 0.0,
         "p50_ms": None, "p95_ms": None, "p99_ms": None},
        {"variant": "dense", "n_bucket": "le_1024", "count": 4.0, "sum_ms": 0.0,
         "p50_ms": approx(100.0), "p95_ms": None, "p99_ms": None}]
    assert s["stages"] == [{"variant": "mita", "n_bucket": "le_1024", "stage": "embed",
                            "count": 12.0, "sum_ms": 0.0, "p50_ms": None, "p95_ms": None},
                           {"variant": "mita", "n_bucket": "le_1024", "stage": "attention",
                            "count": 12.0, "sum_ms": approx(24.0), "p50_ms": approx(2.0),
                            "p95_ms": approx(3.0)}]
    (ratio,) = s["ratios"]
    assert ratio["ratio"] == approx(0.4)
    points = [(p["requests"], p["rps"], p["p50_ms"], p["p99_ms"]) for p in s["timeline"]
              if p["variant"] == "mita"]
    assert points == [(0.0, 0.0, None, approx(100.0)), (10.0, 2.0, approx(50.0), None),
                      (0.0, 0.0, approx(60.0), approx(200.0))]
    assert [p["t"] for p in s["timeline"]] == steps * 2
    by_n = [(p["variant"], p["n_bucket"], p["requests"]) for p in s["timeline_by_n"]]
    assert by_n == [("mita", "le_1024", 0.0), ("mita", "le_1024", 5.0),
                    ("mita", "le_1024", 5.0), ("mita", "le_16384", 0.0),
                    ("mita", "le_16384", 0.0), ("mita", "le_16384", 0.0),
                    ("dense", "le_1024", 0.0), ("dense", "le_1024", 0.0),
                    ("dense", "le_1024", 0.0)]
    assert [p["p99_ms"] for p in s["timeline_by_n"][:3]] == [approx(300.0), approx(300.0),
                                                             None]
    assert s["shadow"] == {"comparisons": 0.0, "agree": 0.0, "rate": None, "kl_mean": None,
                           "kl_p50": None, "dropped": 2.0}
    res["shadow_dropped"] = []  # no series: none dropped
    assert _prometheus_stats(res, now, 15, bin_s, steps)["shadow"]["dropped"] == 0.0
