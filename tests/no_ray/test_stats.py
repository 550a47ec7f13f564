"""The dashboard's numbers without Ray: the stats window's summary against numpy, ratios
like for like, and the stats made of Prometheus' answers."""

from __future__ import annotations

import math
import time

import numpy as np
import pytest

from mita.hooks import MIN_STAGE_SAMPLES
from service.stats import StatsWindow

from ..fakes import counted_window, stats_body


def test_window_summary_against_numpy():
    w = StatsWindow(retention_s=60, max_records=50)
    rng = np.random.default_rng(0)
    lat = rng.uniform(0.001, 0.2, 40)
    for i, x in enumerate(lat):
        w.add_request("mita" if i % 4 else "dense", 200, 1000, float(x))
        w.add_forward("mita", "le_1024", {"embed": float(x) * 10, "topk": 1.0})
    w.add_request("none", 413)
    w.add_shadow("mita", True, 0.1)
    w.add_shadow("dense", False, 0.4)
    s = w.summary()
    mita = lat[[i % 4 != 0 for i in range(40)]] * 1e3
    row = next(r for r in s["latency"] if r["variant"] == "mita")
    assert row["count"] == 30 and row["sum_ms"] == pytest.approx(mita.sum())
    assert [row["p50_ms"], row["p95_ms"], row["p99_ms"]] == pytest.approx(
        list(np.percentile(mita, [50, 95, 99])))
    embed = next(r for r in s["stages"] if r["stage"] == "embed")
    assert embed["p95_ms"] == pytest.approx(np.percentile(lat * 10, 95))
    assert [r["stage"] for r in s["stages"]] == ["embed", "topk"]  # forward order
    assert s["shadow"] == {"comparisons": 2, "agree": 1, "rate": 0.5,
                           "kl_mean": pytest.approx(0.25), "kl_p50": pytest.approx(0.25),
                           "dropped": 0}
    assert s["requests"][-1] == {"variant": "none", "status": "413", "count": 1}
    assert sum(p["requests"] for p in s["timeline"]) == 40 and not s["truncated"]
    assert len(s["timeline"]) in (2 * 60, 2 * 61) and s["bin_s"] == 1
    # The record cap: 41 requests into 50 places is fine, 60 more cut the window short.
    for _ in range(60):
        w.add_request("dense", 200, 1000, 0.01)
    assert w.summary()["truncated"]
    # Records older than the retention are dropped.
    w.requests.appendleft((time.time() - 61, "mita", "200", 1000, 1.0, False))
    w.retention_s = 30
    assert w.summary(window_s=1000)["window_s"] == 30
    assert all(r[0] >= time.time() - 31 for r in w.requests)


def test_ratio_compares_like_with_like():
    """The bucket N ≤ 1,024 holds N = 1,024 (MiTA 0.74× dense, as a load test measured) and
    N = 128 (MiTA 2× dense: its routing costs more than short dense attention). MiTA served
    mostly N = 1,024 and dense mostly N = 128, so the bucket's medians (the old ratio) put
    MiTA at 7.4×; like for like it is the weighted geometric mean of 0.74 and 2."""
    w = StatsWindow(retention_s=60)
    plan = [("mita", 1024, 0.074, 9), ("dense", 1024, 0.100, 1),
            ("mita", 128, 0.020, 1), ("dense", 128, 0.010, 9),
            ("mita", 300, 0.050, 5)]  # no dense request at N = 300: not compared
    for variant, n, latency, times in plan:
        for _ in range(times):
            w.add_request(variant, 200, n, latency)
    s = w.summary()
    bucket = {(r["variant"]): r["p50_ms"] for r in s["latency"]}
    assert bucket["mita"] / bucket["dense"] == pytest.approx(74 / 10)  # the mix, not MiTA
    (row,) = s["ratios"]
    # Each N weighs min(mita, dense) = 1 request: exp(mean(log 0.74, log 2)).
    assert row["ratio"] == pytest.approx(math.sqrt(0.74 * 2.0))
    assert (row["like_for_like"], row["n_values"], row["n_min"], row["n_max"]) == (
        True, 2, 128, 1024)
    # Medians over the matched requests only (the 5 at N = 300 left out).
    assert row["mita_p50_ms"] == pytest.approx(74.0) and row["dense_p50_ms"] == 10.0
    w.add_request("dense", 200, 128, 0.010)  # weights 1 and 1 still: same answer
    assert w.summary()["ratios"][0]["ratio"] == pytest.approx(math.sqrt(0.74 * 2.0))
    for _ in range(2):  # N = 128 now weighs 3, N = 1,024 still 1
        w.add_request("mita", 200, 128, 0.020)
    assert w.summary()["ratios"][0]["ratio"] == pytest.approx((0.74 * 2.0 ** 3) ** 0.25)


def test_prometheus_stats_draw_only_buckets_answered_in_the_window():
    """Ray keeps exporting a histogram after its last request, so rate() gives a series of
    zeros for a bucket served long before the window: it must not get a chart (it did, an
    empty one). Ratios from Prometheus say they are not like for like."""
    from service.stats import INSTANT, RANGE, _prometheus_stats

    now, bin_s = 1_000_000.0, 5.0
    steps = [now - 10, now - 5, now]

    def instant(rows):
        return [{"metric": m, "value": [now, str(v)]} for m, v in rows]

    def ranged(rows):
        return [{"metric": m, "values": [[t, str(v)] for t, v in zip(steps, vs, strict=True)]}
                for m, vs in rows]
    mita, dense = {"variant": "mita", "n_bucket": "le_1024"}, {"variant": "dense",
                                                                "n_bucket": "le_1024"}
    res = {k: [] for k in (*INSTANT, *RANGE)}
    res |= {"lat_count": instant([(mita, 6), (dense, 3)]),
            "lat_sum": instant([(mita, 0.6), (dense, 0.6)]),
            "lat_p50": instant([(mita, 0.1), (dense, 0.2)]),
            "requests": instant([({"variant": "mita", "status": "200"}, 6),
                                 ({"variant": "dense", "status": "200"}, 3)]),
            "rps": ranged([({"variant": "mita"}, [0, 0.6, 0.6]),
                           ({"variant": "dense"}, [0, 0.3, 0.3])]),
            "n_rps": ranged([(mita, [0, 0.6, 0.6]), (dense, [0, 0.3, 0.3]),
                             ({"variant": "mita", "n_bucket": "le_4096"}, [0, 0, 0])]),
            "n_p50": ranged([(mita, ["NaN", 0.1, 0.1]), (dense, ["NaN", 0.2, 0.2])])}
    s = _prometheus_stats(res, now, 15.0, bin_s, steps)
    assert {(p["variant"], p["n_bucket"]) for p in s["timeline_by_n"]} == {
        ("mita", "le_1024"), ("dense", "le_1024")}
    mita_points = [p for p in s["timeline_by_n"] if p["variant"] == "mita"]
    assert [p["p50_ms"] for p in mita_points] == [None, 100.0, 100.0]
    assert [p["requests"] for p in mita_points] == [0, 3.0, 3.0]
    (ratio,) = s["ratios"]
    assert ratio["ratio"] == pytest.approx(0.5) and ratio["like_for_like"] is False


def test_stats_give_stage_counts_shadow_kl_and_the_policy_split():
    """Found by a user: stage figures from 1-2 samples without a count, the shadow KL recorded
    but not shown, and an "observed" split of 63/37 against a configured 80/20 while the
    policy-routed traffic was 80/20: the load test's requests that named their variant were
    counted as the policy's. Dropped shadow calls are counted apart from the comparisons (they
    have no KL)."""
    s = counted_window().summary()
    assert s["shadow"] == {"comparisons": 3, "agree": 2, "rate": pytest.approx(2 / 3),
                           "kl_mean": pytest.approx(0.53 / 3), "kl_p50": pytest.approx(0.02),
                           "dropped": 4}
    assert s["min_stage_samples"] == MIN_STAGE_SAMPLES == 5
    counts = {(r["variant"], r["n_bucket"], r["stage"]): r["count"] for r in s["stages"]}
    assert counts["mita", "le_1024", "qkv_proj"] == 2 and counts["mita", "le_4096", "qkv_proj"] == 6
    assert counts["dense", "le_1024", "qkv_proj"] == 6
    body = stats_body(s)
    assert body["ab"] == {"policy": "weighted", "weights": {"mita": 0.8, "dense": 0.2},
                          "shadow": True,
                          "sticky_header": "x-client-key",
                          "observed": {"mita": 0.75, "dense": 0.25}, "observed_requests": 8,
                          "observed_basis": "policy_routed",
                          "overrides": {"mita": 0, "dense": 5}}
    # The request counts still count every request, overrides included.
    assert {(r["variant"], r["status"]): r["count"] for r in s["requests"]} == {
        ("mita", "200"): 6, ("dense", "200"): 7, ("dense", "503"): 1}


def test_prometheus_stats_give_the_kl_and_say_what_observed_counts():
    """Prometheus mode: the KL from the KL histogram (mean from Ray's midpoint sum, p50 from
    histogram_quantile); its request counter does not say how a request was routed, so the
    observed split is of all answered requests and says so, and overrides are unknown."""
    from service.stats import INSTANT, RANGE, _prometheus_stats

    now = 1_000_000.0
    res = {k: [] for k in (*INSTANT, *RANGE)}
    res |= {"requests": [{"metric": {"variant": v, "status": "200"}, "value": [now, str(c)]}
                         for v, c in (("mita", 30), ("dense", 10))],
            "shadow": [{"metric": {"agree": "true"}, "value": [now, "9"]},
                       {"metric": {"agree": "false"}, "value": [now, "1"]}],
            "kl_mean": [{"metric": {}, "value": [now, "0.042"]}],
            "kl_p50": [{"metric": {}, "value": [now, "0.03"]}],
            "shadow_dropped": [{"metric": {}, "value": [now, "7"]}]}
    s = _prometheus_stats(res, now, 300.0, 5.0, [now])
    assert s["shadow"] == {"comparisons": 10, "agree": 9, "rate": 0.9, "kl_mean": 0.042,
                           "kl_p50": 0.03, "dropped": 7}
    ab = stats_body(s)["ab"]
    assert (ab["observed"], ab["observed_basis"], ab["overrides"]) == (
        {"mita": 0.75, "dense": 0.25}, "all_answered", None)
    # No comparisons: no KL (Prometheus answers NaN for 0 / 0).
    res |= {"shadow": [], "kl_mean": [{"metric": {}, "value": [now, "NaN"]}]}
    s = _prometheus_stats(res, now, 300.0, 5.0, [now])
    assert (s["shadow"]["kl_mean"], s["shadow"]["kl_p50"]) == (None, None)
