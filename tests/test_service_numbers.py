"""Every number the service hands a user, pinned on hand-made inputs (issue 33): what the
recorder gives Prometheus and /v1/stats, the stats' percentiles, rates, ratios and bins, the
config bounds and the input checks' messages. Expected values are worked out by hand in the
comments; nothing here needs Ray, a server or a subprocess."""

from __future__ import annotations

import asyncio
import json
import math
import time

import numpy as np
import pytest
from fastapi import Request  # the endpoint's annotation below, resolved at module level
from pydantic import ValidationError

import service.recorder as recorder_mod
import service.stats as stats_mod
from mita.data.vocab import Vocabulary
from service.config_file import (
    ActorOptions,
    Application,
    Autoscaling,
    Deployment,
    HttpOptions,
    ServeFile,
    check_serve_file,
    read_yaml,
)
from service.forward_stats import ForwardStats
from service.inputs import ApiError, StrictJSONRequest, binary_ids, check_ids, to_ids
from service.metrics import DURATION_BUCKETS_S, N_BUCKETS, _one_two_five, n_bucket
from service.recorder import PEAK_MEMORY_TTL_S, Recorder
from service.schemas import (
    BatchRequest,
    ClassifierConfig,
    ClassifyRequest,
    GatewayConfig,
    MiTASetting,
    describe_errors,
    validated,
)
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

# numpy's linear interpolation and the s -> ms conversion round in the last bits; every
# mistake these tests look for moves a value by far more than this.
REL = 1e-9
LISTOPS = Vocabulary(16, pad_id=0)


# ---- the recorder: what Prometheus and the window get -------------------------------------

class Spy:
    """Stands in for one Ray metric: keeps every call as (method, value, tags)."""

    def __init__(self):
        self.calls = []

    def inc(self, value, tags):
        self.calls.append(("inc", value, tags))

    def observe(self, value, tags):
        self.calls.append(("observe", value, tags))

    def set(self, value, tags):
        self.calls.append(("set", value, tags))


def spied_recorder() -> Recorder:
    rec = Recorder()
    for name in list(vars(rec.metrics)):
        setattr(rec.metrics, name, Spy())
    return rec


def profile(staged=False, stages=None, total_ms=8.0, flops=1_000_000, batch=1, peak=None,
            kind=None) -> ForwardStats:
    return ForwardStats(device="cpu", dtype="float32", staged=staged, batch_size=batch,
                        padded_n=64, total_ms=total_ms, stages_ms=stages or {}, layers_ms=[],
                        flops={"ffn": flops}, flops_total=flops, gflops_per_s={},
                        peak_memory_bytes=peak, peak_memory_kind=kind, started_at=1.7e9)


def test_a_batchs_flops_are_shared_by_its_requests():
    """One forward of 4 requests (1e6 FLOPs): each request counts 1e6 / 4 = 250,000, the four
    add up to the forward's 1e6 exactly once (not 4e6)."""
    rec = spied_recorder()
    shared = profile(flops=1_000_000, batch=4)
    for n in (100, 200, 300, 1500):
        rec.forward("mita", n, shared)
    m = rec.metrics
    assert m.flops.calls == [("inc", 250_000.0, {"variant": "mita"})] * 4
    assert sum(c[1] for c in m.flops.calls) == 1_000_000
    assert m.tokens.calls == [("inc", n, {"variant": "mita"}) for n in (100, 200, 300, 1500)]
    # 8 ms -> 0.008 s, each request in its own N bucket (1,500 > 1,024)
    assert m.forward_duration.calls == [
        ("observe", 0.008, {"variant": "mita", "n_bucket": b})
        for b in ("le_1024", "le_1024", "le_1024", "le_4096")]
    # not staged: no stage timings anywhere; no peak memory: no gauge
    assert m.stage_duration.calls == [] and not rec.window.forwards
    assert m.peak_memory.calls == [] and rec._peak == {}


def test_a_staged_forward_gives_stage_seconds_and_its_peak_memory():
    rec = spied_recorder()
    rec.forward("dense", 2000, profile(staged=True, stages={"embed": 2.0, "attention": 6.5},
                                       total_ms=10.0, flops=3000, batch=3, peak=4096,
                                       kind="cuda"), replica="r1")
    m, tags = rec.metrics, {"variant": "dense", "n_bucket": "le_4096"}
    assert m.stage_duration.calls == [("observe", 0.002, tags | {"stage": "embed"}),
                                      ("observe", 0.0065, tags | {"stage": "attention"})]
    assert m.forward_duration.calls == [("observe", 0.01, tags)]
    assert m.flops.calls == [("inc", 1000.0, {"variant": "dense"})]  # 3000 / 3
    # the gauge may also be set again by the refresh thread: always the same series and value
    want = ("set", 4096, {"variant": "dense", "kind": "cuda", "classifier_replica": "r1"})
    assert m.peak_memory.calls and all(c == want for c in m.peak_memory.calls)
    rows = rec.window.summary()["stages"]
    assert [(r["variant"], r["n_bucket"], r["stage"], r["count"], r["p50_ms"])
            for r in rows] == [("dense", "le_4096", "embed", 1, 2.0),
                               ("dense", "le_4096", "attention", 1, 6.5)]
    m.peak_memory.calls.clear()
    rec.forward("mita", 10, profile(peak=1, kind="analytic"))  # replica not given: ""
    assert ("set", 1, {"variant": "mita", "kind": "analytic", "classifier_replica": ""}) in (
        m.peak_memory.calls)


class FakeClock:
    """A module's ``time``: ``time()``/``monotonic()`` read ``now``; ``sleep`` is real (the
    recorder's refresh thread sleeps through it)."""

    def __init__(self, now: float):
        self.now = now

    def time(self) -> float:
        return self.now

    def monotonic(self) -> float:
        return self.now

    @staticmethod
    def sleep(s: float) -> None:
        time.sleep(s)


def test_peak_memory_is_kept_exactly_until_its_ttl(monkeypatch):
    """A replica's peak is set again while it answered at most 60 s ago (60.0 s: kept), and
    dropped just after (60.5 s); a replica that answers later is back with its new value."""
    assert PEAK_MEMORY_TTL_S == 60.0
    clock = FakeClock(1000.0)
    monkeypatch.setattr(recorder_mod, "time", clock)
    rec = spied_recorder()
    gauge = rec.metrics.peak_memory

    def series_set() -> dict:
        gauge.calls.clear()
        rec._set_gauges()
        return {(t["variant"], t["kind"], t["classifier_replica"]): v for _, v, t in gauge.calls}

    rec.forward("mita", 10, profile(peak=100, kind="cuda"), replica="a")
    clock.now = 1030.0
    rec.forward("mita", 10, profile(peak=200, kind="cuda"), replica="b")
    rec.forward("mita", 10, profile(peak=300, kind="analytic"), replica="b")  # its own series
    clock.now = 1060.0
    assert series_set() == {("mita", "cuda", "a"): 100, ("mita", "cuda", "b"): 200,
                            ("mita", "analytic", "b"): 300}
    clock.now = 1060.5
    assert series_set() == {("mita", "cuda", "b"): 200, ("mita", "analytic", "b"): 300}
    assert ("mita", "cuda", "a") not in rec._peak
    rec.forward("mita", 10, profile(peak=150, kind="cuda"), replica="a")
    clock.now = 1090.0
    assert series_set() == {("mita", "cuda", "a"): 150, ("mita", "cuda", "b"): 200,
                            ("mita", "analytic", "b"): 300}
    clock.now = 1090.25
    assert series_set() == {("mita", "cuda", "a"): 150}


def test_requests_rejections_and_shadow_calls_reach_both_prometheus_and_the_window():
    rec = spied_recorder()
    rec.request("mita", 200, 1500, 0.25)
    rec.request("none", 422)  # refused before routing: no latency
    rec.request("dense", 504, 100, 30.0)
    rec.request("dense", 200, 100, 0.5, override=True)
    rec.rejection("mita", "primary")  # a refused primary call is no shadow drop
    assert rec.window.summary()["shadow"]["dropped"] == 0
    rec.rejection("dense", "shadow")
    assert rec.window.summary()["shadow"]["dropped"] == 1
    rec.shadow_dropped("mita", "busy")
    rec.shadow_dropped("dense", "failed")
    rec.shadow("dense", False, 0.7)
    rec.shadow("mita", True, 0.1)
    m = rec.metrics
    assert m.requests.calls == [("inc", 1, {"variant": v, "status": s}) for v, s in (
        ("mita", "200"), ("none", "422"), ("dense", "504"), ("dense", "200"))]
    assert m.request_duration.calls == [
        ("observe", 0.25, {"variant": "mita", "n_bucket": "le_4096"}),
        ("observe", 30.0, {"variant": "dense", "n_bucket": "le_1024"}),
        ("observe", 0.5, {"variant": "dense", "n_bucket": "le_1024"})]
    assert m.rejections.calls == [("inc", 1, {"variant": "mita", "role": "primary"}),
                                  ("inc", 1, {"variant": "dense", "role": "shadow"})]
    assert m.shadow_dropped.calls == [("inc", 1, {"variant": "mita", "reason": "busy"}),
                                      ("inc", 1, {"variant": "dense", "reason": "failed"})]
    assert m.shadow_comparisons.calls == [("inc", 1, {"primary": "dense", "agree": "false"}),
                                          ("inc", 1, {"primary": "mita", "agree": "true"})]
    assert m.shadow_kl.calls == [("observe", 0.7, {"primary": "dense"}),
                                 ("observe", 0.1, {"primary": "mita"})]
    s = rec.window.summary()
    assert {(r["variant"], r["status"]): r["count"] for r in s["requests"]} == {
        ("mita", "200"): 1, ("none", "422"): 1, ("dense", "504"): 1, ("dense", "200"): 1}
    assert s["answered"] == {"policy": {"mita": 1}, "override": {"dense": 1}}
    assert [(r["variant"], r["n_bucket"], r["count"], r["sum_ms"]) for r in s["latency"]] == [
        ("mita", "le_4096", 1, 250.0), ("dense", "le_1024", 2, 30_500.0)]
    assert [r[1:] for r in rec.window.shadows] == [
        ("dense", None, None), ("mita", None, None), ("dense", None, None),
        ("dense", False, 0.7), ("mita", True, 0.1)]
    # 2 comparisons (1 agrees; KL 0.7 and 0.1: mean = median = 0.4); dropped: the shadow
    # rejection and the two shadow drops, not the primary rejection
    assert s["shadow"] == {"comparisons": 2, "agree": 1, "rate": 0.5,
                           "kl_mean": pytest.approx(0.4, rel=REL),
                           "kl_p50": pytest.approx(0.4, rel=REL), "dropped": 3}


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
    assert ab == {"weights": {"mita": 3.0, "dense": 1.0}, "shadow": False,
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
    assert forwards == [(9990.0, "mita", "le_1024", ("embed", "attention"), (1.5, 2.5))]
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
    only_drops = summarize((10.0, 60.0, False, [], [], [shadows[1], shadows[4]]))["shadow"]
    assert only_drops == {"comparisons": 0, "agree": 0, "rate": None, "kl_mean": None,
                          "kl_p50": None, "dropped": 2}


def test_stage_rows_percentiles_and_order():
    forwards = [(1.0, "mita", "le_1024", ("embed", "attention"), (float(i), 10.0 * i))
                for i in (1, 2, 3, 4)]
    forwards.append((1.0, "mita", "le_4096", ("topk",), (7.0,)))
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


# ---- metric labels and buckets --------------------------------------------------------------

@pytest.mark.parametrize("edge", [1024, 4096, 16384, 65536, 262144, 1048576])
def test_n_bucket_edges_are_inclusive(edge):
    assert n_bucket(edge) == f"le_{edge}"
    assert n_bucket(edge // 4 + 1) == f"le_{edge}"
    if edge < 1048576:
        assert n_bucket(edge + 1) == f"le_{edge * 4}"


def test_n_bucket_beyond_the_last_edge_and_the_bucket_names():
    assert n_bucket(1) == "le_1024" and n_bucket(1048577) == "le_1048576"
    assert N_BUCKETS == ("le_1024", "le_4096", "le_16384", "le_65536", "le_262144",
                         "le_1048576")


def test_duration_buckets_are_one_two_five_up_to_the_longest_timeout():
    want = [1e-05, 2e-05, 5e-05, 0.0001, 0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02,
            0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 300.0]
    assert DURATION_BUCKETS_S == want == _one_two_five(-5, 300.0)
    assert _one_two_five(-2, 0.6) == [0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 0.6]
    assert DURATION_BUCKETS_S[:4] == [1e-05, 2e-05, 5e-05, 0.0001] and len(want) == 24
    # an upper bound on the grid is not listed twice (a duplicated `le` bucket)
    assert _one_two_five(0, 20.0) == [1.0, 2.0, 5.0, 10.0, 20.0]
    assert _one_two_five(0, 30.0) == [1.0, 2.0, 5.0, 10.0, 20.0, 30.0]
    assert _one_two_five(-1, 0.15) == [0.1, 0.15]


# ---- config files: every bound, at its edge and one step past ------------------------------

def below(x: float) -> float:
    return math.nextafter(x, -math.inf)


def above(x: float) -> float:
    return math.nextafter(x, math.inf)


# (model, field, lowest accepted, highest accepted or None, values the rest of the model needs)
# ints step by 1, floats by one ulp (math.nextafter).
BOUNDS = [
    (HttpOptions, "port", 1, 65535, {}),
    (HttpOptions, "request_timeout_s", 0.1, 300.0, {}),
    (HttpOptions, "keep_alive_timeout_s", 0.1, 3600.0, {}),
    (ActorOptions, "num_cpus", 0.0, 1024.0, {}),
    (ActorOptions, "num_gpus", 0.0, 64.0, {}),
    (ActorOptions, "memory", 0, None, {}),
    (Autoscaling, "min_replicas", 0, 1024, {"max_replicas": 1024}),
    (Autoscaling, "initial_replicas", 0, 1024, {"min_replicas": 0, "max_replicas": 1024}),
    (Autoscaling, "max_replicas", 1, 1024, {"min_replicas": 0}),
    (Autoscaling, "target_ongoing_requests", 0.01, 100_000.0, {}),
    (Autoscaling, "metrics_interval_s", 0.1, 3600.0, {}),
    (Autoscaling, "look_back_period_s", 0.1, 3600.0, {}),
    (Autoscaling, "upscale_delay_s", 0.0, 3600.0, {}),
    (Autoscaling, "downscale_delay_s", 0.0, 3600.0, {}),
    (Autoscaling, "upscaling_factor", 0.01, 100.0, {}),
    (Autoscaling, "downscaling_factor", 0.01, 100.0, {}),
    (Deployment, "num_replicas", 1, 1024, {"name": "d"}),
    (Deployment, "max_ongoing_requests", 1, 100_000, {"name": "d"}),
    (Deployment, "max_queued_requests", -1, 1_000_000, {"name": "d"}),
    (Deployment, "graceful_shutdown_wait_loop_s", 0.0, 600.0, {"name": "d"}),
    (Deployment, "graceful_shutdown_timeout_s", 0.0, 600.0, {"name": "d"}),
    (Deployment, "health_check_period_s", 0.1, 3600.0, {"name": "d"}),
    (Deployment, "health_check_timeout_s", 0.1, 3600.0, {"name": "d"}),
    (Deployment, "max_replicas_per_node", 1, 1024, {"name": "d"}),
    (ClassifierConfig, "max_batch_size", 1, 1024, {}),
    (ClassifierConfig, "batch_wait_timeout_s", 0.0, 10.0, {}),
    (ClassifierConfig, "staged_profile_every", 0, 1_000_000, {}),
    (GatewayConfig, "shadow_max_inflight", 1, 1024, {}),
    (GatewayConfig, "max_n", 1, 1_048_576, {}),
    (GatewayConfig, "max_body_bytes", 1024, 256 * 1024 * 1024, {}),
    (GatewayConfig, "max_batch_items", 1, 4096, {}),
    (GatewayConfig, "retry_after_s", 0, 3600, {}),
    (GatewayConfig, "stats_window_s", 10.0, 3600.0, {}),
]


def refused_text(model, values: dict) -> str:
    with pytest.raises(ValidationError) as e:
        model.model_validate(values)
    return describe_errors(e.value)


def step_past(value, up: bool):
    if isinstance(value, int):
        return value + 1 if up else value - 1
    return above(value) if up else below(value)


@pytest.mark.parametrize("model,field,lo,hi,rest", BOUNDS,
                         ids=[f"{b[0].__name__}.{b[1]}" for b in BOUNDS])
def test_every_config_bound_holds_exactly_at_its_edge(model, field, lo, hi, rest):
    for ok in (lo, hi) if hi is not None else (lo,):
        assert getattr(model.model_validate(rest | {field: ok}), field) == ok
    def shown(x) -> str:  # as pydantic writes a bound: 1000000, 0.1, 300
        return str(x) if isinstance(x, int) else f"{x:g}"
    refused = [(step_past(lo, False), f"greater than or equal to {shown(lo)}")]
    if hi is not None:
        refused.append((step_past(hi, True), f"less than or equal to {shown(hi)}"))
    for bad, words in refused:
        text = refused_text(model, rest | {field: bad})
        assert text.startswith(field) and words in text and f"(got {bad!r})" in text, text


def test_request_timeout_is_refused_at_zero_and_accepted_just_above():
    assert GatewayConfig(request_timeout_s=5e-324).request_timeout_s == 5e-324
    assert GatewayConfig(request_timeout_s=300.0).request_timeout_s == 300.0
    for bad, words in ((0.0, "greater than 0"), (above(300.0), "less than or equal to 300")):
        with pytest.raises(ValidationError, match=words):
            GatewayConfig(request_timeout_s=bad)


def test_no_replicas_is_refused_naming_the_field():
    """``max_replicas: 0`` with ``min_replicas: 0`` passes the ordering check (0 ≤ 0 ≤ 0):
    only the bound refuses it."""
    raw = {"applications": [{"import_path": "service.app:build_app", "deployments": [
        {"name": "Gateway", "autoscaling_config": {"min_replicas": 0, "max_replicas": 0}}]}]}
    with pytest.raises(ValueError) as e:
        check_serve_file(raw, "serve.yaml")
    assert str(e.value) == ("serve.yaml: applications.0.deployments.0.autoscaling_config."
                            "max_replicas: Input should be greater than or equal to 1 (got 0)")
    raw["applications"][0]["deployments"][0]["autoscaling_config"]["max_replicas"] = 1
    check_serve_file(raw, "serve.yaml")


def test_resources_and_weights_bounds():
    assert ActorOptions(resources={"x": 0.0, "y": 1e6}).resources == {"x": 0.0, "y": 1e6}
    assert refused_text(ActorOptions, {"resources": {"x": -5e-324}}) == (
        "resources.x: Input should be greater than or equal to 0 (got -5e-324)")
    assert refused_text(ActorOptions, {"resources": {"x": above(1e6)}}) == (
        "resources.x: Input should be less than or equal to 1000000 (got 1000000.0000000001)")
    assert GatewayConfig(weights={"mita": 1e6, "dense": 0.0}).weights["mita"] == 1e6
    assert refused_text(GatewayConfig, {"weights": {"mita": 1.0, "dense": above(1e6)}}) == (
        "weights.dense: Input should be less than or equal to 1000000 (got 1000000.0000000001)")
    assert refused_text(GatewayConfig, {"weights": {"mita": -5e-324, "dense": 1.0}}) == (
        "weights.mita: Input should be greater than or equal to 0 (got -5e-324)")


@pytest.mark.parametrize("model,field,ok,bad", [
    (HttpOptions, "host", "h", ""), (Deployment, "name", "d", ""),
    (Application, "name", "a", ""), (Application, "import_path", "m:f", ""),
    (GatewayConfig, "sticky_header", "k" * 64, "k" * 65),
    (GatewayConfig, "sticky_header", "x", ""),
])
def test_text_fields_have_a_length_bound(model, field, ok, bad):
    rest = {"name": "d"} if model is Deployment else (
        {"import_path": "m:f"} if model is Application else {})
    assert getattr(model.model_validate(rest | {field: ok}), field) == ok
    with pytest.raises(ValidationError, match=field):
        model.model_validate(rest | {field: bad})


def test_lists_that_must_not_be_empty():
    assert refused_text(ServeFile, {"applications": []}) == (
        "applications: List should have at least 1 item after validation, not 0")
    assert refused_text(BatchRequest, {"items": []}) == (
        "items: List should have at least 1 item after validation, not 0")
    assert len(BatchRequest.model_validate({"items": [{"ids": [1]}]}).items) == 1


def test_replica_counts_are_ordered_with_ties_allowed():
    assert Autoscaling(min_replicas=2, max_replicas=2).initial_replicas is None  # 2 ≤ 2 ≤ 2
    assert Autoscaling(min_replicas=0, initial_replicas=0, max_replicas=1).max_replicas == 1
    assert Autoscaling(min_replicas=1, initial_replicas=3, max_replicas=3).min_replicas == 1
    for values, got in (({"min_replicas": 2, "max_replicas": 1}, "2, None, 1"),
                        ({"min_replicas": 1, "initial_replicas": 3, "max_replicas": 2},
                         "1, 3, 2"),
                        ({"min_replicas": 2, "initial_replicas": 1, "max_replicas": 3},
                         "2, 1, 3")):
        with pytest.raises(ValueError) as e:
            validated(Autoscaling, values, "autoscaling")
        assert str(e.value) == ("autoscaling: (whole): Value error, need min_replicas ≤ "
                                f"initial_replicas ≤ max_replicas, got {got}")


@pytest.mark.parametrize("key", ["CPU", "GPU", "memory"])
def test_cpu_gpu_memory_are_not_resources(key):
    with pytest.raises(ValueError) as e:
        validated(ActorOptions, {"resources": {"x": 1.0, key: 1.0}}, "opts")
    assert str(e.value) == ("opts: (whole): Value error, CPU, GPU and memory are set with "
                            "num_cpus, num_gpus and memory, not in resources")
    assert ActorOptions(resources={"cpu": 1.0}).resources == {"cpu": 1.0}  # case matters


@pytest.mark.parametrize("name", ["num_cpus", "num_gpus"])
def test_fractions_of_a_cpu_or_gpu_are_multiples_of_a_ten_thousandth(name):
    for ok in (0.0001, 0.5, 0.9999, 1.0, 1.00005, 3.0):
        assert getattr(ActorOptions.model_validate({name: ok}), name) == ok
    with pytest.raises(ValueError) as e:
        validated(ActorOptions, {name: 0.00005}, "opts")
    assert str(e.value) == (f"opts: (whole): Value error, {name} below 1 must be a multiple "
                            "of 0.0001, got 5e-05")


def test_duplicate_deployments_and_applications_are_named_sorted():
    deps = [{"name": n} for n in ("b", "a", "b", "c", "a")]
    with pytest.raises(ValueError) as e:
        validated(Application, {"import_path": "m:f", "deployments": deps}, "app")
    assert str(e.value) == "app: (whole): Value error, deployment(s) a, b listed more than once"
    apps = [{"name": n, "import_path": "m:f", "route_prefix": p}
            for n, p in (("y", "/a"), ("x", "/b"), ("y", None), ("x", None))]
    with pytest.raises(ValueError) as e:
        validated(ServeFile, {"applications": apps}, "file")
    assert str(e.value) == "file: (whole): Value error, application name x, y used more than once"
    apps = [{"name": n, "import_path": "m:f", "route_prefix": p}
            for n, p in (("a", "/p"), ("b", None), ("c", None), ("d", "/p"))]
    with pytest.raises(ValueError) as e:  # no route (None) twice is fine; "/p" twice is not
        validated(ServeFile, {"applications": apps}, "file")
    assert str(e.value) == ("file: (whole): Value error, application route_prefix /p used "
                            "more than once")
    validated(ServeFile, {"applications": apps[:3]}, "file")


def test_read_yaml_refusals_name_the_file_and_line(tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text("a: 1\nb: {<<: {c: 1}, d: 2, d: 3}\n")  # after a merge key: still checked
    with pytest.raises(ValueError) as e:
        read_yaml(path)
    assert str(e.value) == (f'{path}: not valid YAML: duplicate key \'d\' in "{path}", line 2, '
                            "column 23")
    path.write_text("a: 1\na: 2\n")
    with pytest.raises(ValueError, match=r"duplicate key 'a' in .*line 2, column 1$"):
        read_yaml(path)
    path.write_bytes(b"a: \xff\n")
    with pytest.raises(ValueError) as e:
        read_yaml(path)
    assert str(e.value) == f"{path}: not UTF-8 text (invalid start byte)"
    path.write_text("? [a, b]\n: 1\n")
    with pytest.raises(ValueError) as e:
        read_yaml(path)
    assert str(e.value) == (f'{path}: not valid YAML: a mapping key must be a plain value in '
                            f'"{path}", line 1, column 3')
    # too deep a nesting ("nested too deeply") is test_deploy's BAD_FILES: seconds to parse
    path.write_text("a: " + "9" * 5000 + "\n")
    with pytest.raises(ValueError) as e:
        read_yaml(path)
    assert str(e.value) == (f"{path}: Exceeds the limit (4300 digits) for integer string "
                            "conversion: value has 5000 digits; use "
                            "sys.set_int_max_str_digits() to increase the limit")
    path.write_text("- 1\n- 2\n")
    with pytest.raises(ValueError) as e:
        read_yaml(path)
    assert str(e.value) == f"{path}: expected a mapping with 'applications', got list"
    path.write_text("a: 1\nb: {c: 2}\n")
    assert read_yaml(path) == {"a": 1, "b": {"c": 2}}


# ---- schemas: the refusal messages ---------------------------------------------------------

def test_describe_errors_shows_short_values_and_cuts_long_ones():
    # repr of 78 characters + quotes = 80: shown whole; 79 + quotes = 81: cut to 77 + "..."
    for length, shown in ((78, "'" + "!" * 78 + "'"), (79, "'" + "!" * 76 + "...")):
        with pytest.raises(ValueError) as e:
            validated(GatewayConfig, {"sticky_header": "!" * length, "max_n": 0}, "gw")
        assert str(e.value) == (
            f"gw: sticky_header: String should match pattern "
            f"'^[A-Za-z0-9!#$%&'*+.^_`|~-]{{1,64}}$' (got {shown}); "
            "max_n: Input should be greater than or equal to 1 (got 0)")


def test_validated_treats_none_as_empty_and_names_the_whole_model():
    assert validated(ClassifierConfig, None, "c").max_batch_size == 8
    with pytest.raises(ValueError) as e:
        validated(ClassifyRequest, None, "body")
    assert str(e.value) == "body: (whole): Value error, give exactly one of 'text' or 'ids'"
    with pytest.raises(ValueError) as e:
        validated(ClassifyRequest, {"text": "1", "ids": [1]}, "body")
    assert str(e.value) == "body: (whole): Value error, give exactly one of 'text' or 'ids'"
    with pytest.raises(ValueError) as e:  # a list value is not repeated
        validated(GatewayConfig, {"weights": [1]}, "gw")
    assert str(e.value) == "gw: weights: Input should be a valid dictionary"


def test_weights_need_a_positive_sum_not_a_sum_of_one():
    assert GatewayConfig(weights={"mita": 0.3, "dense": 0.2}).weights == {"mita": 0.3,
                                                                          "dense": 0.2}
    assert GatewayConfig(weights={"mita": 5e-324, "dense": 0.0}).weights["mita"] == 5e-324
    with pytest.raises(ValueError) as e:
        validated(GatewayConfig, {"weights": {"mita": 0.0, "dense": 0.0}}, "gw")
    assert str(e.value) == "gw: weights: Value error, weights must be ≥ 0 with a positive sum"


@pytest.mark.parametrize("url", ["http://127.0.0.1:9090/?x=1", "http://127.0.0.1:9090/#top",
                                 "http://user@127.0.0.1:9090", "http://:pw@127.0.0.1:9090"])
def test_prometheus_url_is_a_bare_base_url(url):
    with pytest.raises(ValueError) as e:
        validated(GatewayConfig, {"prometheus_url": url}, "gw")
    assert str(e.value).startswith("gw: prometheus_url: Value error, a base URL without query, "
                                   "fragment or user:password, e.g. http://127.0.0.1:9090 (got ")
    ok = GatewayConfig(prometheus_url="http://127.0.0.1:9090/prom").prometheus_url
    assert str(ok) == "http://127.0.0.1:9090/prom"


def test_mita_setting_overrides_are_the_fields_set():
    assert MiTASetting(topk=8, shared_scale="paper").overrides() == {"topk": 8,
                                                                     "shared_scale": "paper"}
    assert MiTASetting().overrides() == {}


# ---- request inputs: the 4xx messages -----------------------------------------------------

def refusal(call, *args) -> tuple[int, str]:
    with pytest.raises(ApiError) as e:
        call(*args)
    return e.value.status, e.value.message


def test_ids_at_the_edges_of_the_vocabulary_and_max_n():
    ids = np.array([1, 15, 7], dtype=np.uint8)
    out = check_ids(ids, 3, LISTOPS)  # N = max_n is allowed; 15 = size - 1 is a token
    assert out.tolist() == [1, 15, 7] and np.shares_memory(out, ids)  # no second copy
    assert refusal(check_ids, np.array([1, 2, 3, 4]), 3, LISTOPS) == (
        422, "sequence length N = 4 exceeds max_n = 3")
    assert refusal(check_ids, np.array([3, 16, 0]), 10, LISTOPS) == (  # the first bad one
        422, "token id 16 at position 1 is out of range [1, 15] (0 is padding)")
    assert refusal(check_ids, np.array([3, 4, 0]), 10, LISTOPS) == (
        422, "token id 0 at position 2 is out of range [1, 15] (0 is padding)")
    assert refusal(check_ids, np.array([2, -1]), 10, LISTOPS) == (
        422, "token id -1 at position 1 is out of range [1, 15] (0 is padding)")
    # range before emptiness before length
    assert refusal(check_ids, np.array([], dtype=np.int64), 3, LISTOPS) == (
        422, "empty sequence: no tokens to classify")
    assert refusal(check_ids, np.array([1, 1, 1, 99]), 3, LISTOPS)[1].startswith("token id 99")
    byte = Vocabulary(300, pad_id=7)
    assert refusal(check_ids, np.array([0, 7]), 10, byte) == (
        422, "token id 7 at position 1 is out of range [0, 299] except the padding id 7")
    assert check_ids(np.array([0, 299]), 10, byte).dtype == np.int32


def test_ids_travel_in_the_smallest_dtype():
    assert Vocabulary(256).dtype is np.uint8 and Vocabulary(257).dtype is np.int32
    assert Vocabulary(16, 0).listops and not Vocabulary(17, 0).listops
    assert not Vocabulary(16, 1).listops


def test_huge_ids_are_named_and_cut_at_30_characters():
    assert refusal(to_ids, ClassifyRequest(ids=[1, 10 ** 29]), 10, LISTOPS) == (
        422, f"token id {10 ** 29} at position 1 is out of range [1, 15] (0 is padding)")
    assert refusal(to_ids, ClassifyRequest(ids=[1, 2, 10 ** 30]), 10, LISTOPS) == (
        422, f"token id {'1' + '0' * 29}… at position 2 is out of range [1, 15] (0 is padding)")
    # int64's edges: -2^63 fits (then out of range as any negative id), -2^63 - 1 does not
    assert refusal(to_ids, ClassifyRequest(ids=[-(2 ** 63)]), 10, LISTOPS)[1].startswith(
        f"token id {-(2 ** 63)} at position 0")
    # past int64, the first such id is named (here after an in-range-of-int64 bad one)
    assert refusal(to_ids, ClassifyRequest(ids=[1, 2 ** 63 - 1, -(2 ** 63) - 1]), 10,
                   LISTOPS)[1].startswith(f"token id {-(2 ** 63) - 1} at position 2")
    assert refusal(to_ids, ClassifyRequest(ids=[1, -(2 ** 63) - 1, 2 ** 63]), 10,
                   LISTOPS)[1].startswith(f"token id {-(2 ** 63) - 1} at position 1")
    assert refusal(to_ids, ClassifyRequest(ids=[-(2 ** 63), 2 ** 63]), 10,
                   LISTOPS)[1].startswith(f"token id {2 ** 63} at position 1")


def test_ids_are_free_form_and_text_is_checked_only_for_listops():
    assert to_ids(ClassifyRequest(ids=[12, 3, 4]), 3, LISTOPS).tolist() == [12, 3, 4]
    assert to_ids(ClassifyRequest(text="[MAX 2 3"), 3, Vocabulary(257)).tolist() == [12, 3, 4]
    assert to_ids(ClassifyRequest(text="[MAX 2 3 ]"), 4, LISTOPS).tolist() == [12, 3, 4, 15]


def test_text_refusals_say_what_and_where():
    assert refusal(to_ids, ClassifyRequest(text="[MAX 2 x ]"), 100, LISTOPS) == (
        422, "unknown token 'x' at position 2; expected one of 0 1 2 3 4 5 6 7 8 9 [MIN [MAX "
             "[MED [SM ]")
    assert refusal(to_ids, ClassifyRequest(text="[MAX 2 3"), 100, LISTOPS) == (
        422, "text is not a well-formed ListOps expression: unbalanced brackets: '[MAX' at "
             "position 0 is never closed")


def test_binary_bodies_messages():
    int32 = np.array([1, 300], dtype="<i4").tobytes()
    assert binary_ids(np.array([1, 15], dtype="<i4").tobytes(), "int32", 10,
                      LISTOPS).tolist() == [1, 15]
    assert binary_ids(int32, "int32", 10, Vocabulary(301)).tolist() == [1, 300]
    assert refusal(binary_ids, b"", "int32", 10, LISTOPS) == (
        400, "empty request body: send the token ids as bytes (int32, little-endian)")
    assert refusal(binary_ids, b"\x01" * 5, "int32", 10, LISTOPS) == (
        400, "a body of 5 bytes is not a whole number of int32 ids (4 bytes each)")
    assert refusal(binary_ids, int32, "int32", 10, LISTOPS) == (
        422, "token id 300 at position 1 is out of range [1, 15] (0 is padding); the body "
             "was read as int32 little-endian (?dtype=int32): uint8 ids need ?dtype=uint8")
    # uint8 ids 1, 2, 3, 4 read as one int32: 0x04030201 = 67,305,985
    assert refusal(binary_ids, bytes([1, 2, 3, 4]), "int32", 10, LISTOPS) == (
        422, "token id 67305985 at position 0 is out of range [1, 15] (0 is padding); the "
             "body was read as int32 little-endian (?dtype=int32): uint8 ids need ?dtype=uint8")
    assert refusal(binary_ids, bytes([1, 0, 0, 0]), "uint8", 10, LISTOPS) == (
        422, "token id 0 at position 1 is out of range [1, 15] (0 is padding); the body was "
             "read as uint8 little-endian (?dtype=uint8): int32 ids need ?dtype=int32")
    assert refusal(binary_ids, bytes([1, 2, 3]), "uint8", 2, LISTOPS) == (
        422, "sequence length N = 3 exceeds max_n = 2")
    assert refusal(binary_ids, b"", "uint8", 2, LISTOPS)[0] == 400


def json_of(body: bytes):
    async def receive():
        return {"type": "http.request", "body": body, "more_body": False}

    async def parse():
        request = StrictJSONRequest({"type": "http", "method": "POST", "headers": []}, receive)
        first = await request.json()
        assert await request.json() is first  # parsed once
        return first
    return asyncio.run(parse())


@pytest.mark.parametrize("body,why", [
    (b'{"a": 1, "b": {"c": 2, "c": 3}}', "duplicate key 'c'"),
    (b"[" * 100_000 + b"]" * 100_000, "nesting too deep"),
    # UTF-16 JSON (Python reads it): its bytes are not UTF-8, the message's doc replaces them
    (("[" * 100_000 + '"é"' + "]" * 100_000).encode("utf-16-le"), "nesting too deep"),
    (b'{"n": ' + b"1" * 5000 + b"}", "an integer with too many digits"),
    (b'{"a": "\xff"}', "'utf-8' codec can't decode byte 0xff in position 7: invalid start "
                        "byte"),
])
def test_strict_json_refusals_are_decode_errors(body, why):
    with pytest.raises(json.JSONDecodeError) as e:
        json_of(body)
    assert e.value.msg == why
    assert (e.value.doc, e.value.pos) == (body.decode(errors="replace"), 0)


def test_strict_json_route_hands_the_endpoint_a_strict_request():
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from service.inputs import StrictJSONRoute

    app = FastAPI()
    app.router.route_class = StrictJSONRoute

    @app.post("/echo")
    async def echo(request: Request):
        try:
            return {"body": await request.json()}
        except json.JSONDecodeError as e:
            return {"refused": e.msg}

    with TestClient(app) as client:
        assert client.post("/echo", content=b'{"a": 1}').json() == {"body": {"a": 1}}
        assert client.post("/echo", content=b'{"a": 1, "a": 2}').json() == {
            "refused": "duplicate key 'a'"}


def test_strict_json_parses_a_plain_body():
    assert json_of(b'{"a": [1, 2], "b": {"a": 3}}') == {"a": [1, 2], "b": {"a": 3}}


def test_api_error_defaults():
    e = ApiError(503, "busy")
    assert (e.status, e.message, e.headers, e.rejected, str(e)) == (503, "busy", {}, False,
                                                                    "busy")
    e = ApiError(503, "busy", {"Retry-After": "1"}, rejected=True)
    assert (e.headers, e.rejected) == ({"Retry-After": "1"}, True)
