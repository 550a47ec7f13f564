"""Every number the service's recorder hands a user, pinned on hand-made inputs (issue 33):
what it gives Prometheus and /v1/stats, and the metric labels and buckets it records under.
Expected values are worked out by hand in the comments; nothing here needs Ray, a server or
a subprocess."""

from __future__ import annotations

import pytest

import service.recorder as recorder_mod
from mita.records import ForwardProfile, StageRecord
from service.metrics import DURATION_BUCKETS_S, N_BUCKETS, _one_two_five, n_bucket
from service.recorder import PEAK_MEMORY_TTL_S

from ..fakes import FakeClock, spied_recorder

# numpy's linear interpolation and the s -> ms conversion round in the last bits; every
# mistake these tests look for moves a value by far more than this.
REL = 1e-9


# ---- the recorder: what Prometheus and the window get -------------------------------------



def profile(staged=False, stages=None, total_ms=8.0, flops=1_000_000, batch=1, peak=None,
            kind=None) -> ForwardProfile:
    return ForwardProfile(device="cpu", dtype="float32", staged=staged, batch_size=batch,
                          padded_n=64, total_ms=total_ms,
                          records=[StageRecord(s, None, ms) for s, ms in (stages or {}).items()],
                          flops={"ffn": flops}, peak_memory_bytes=peak, peak_memory_kind=kind,
                          started_at=1.7e9)


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
    # none of those had n: the routing table counted no pair; with n, its bucket's pairs
    assert [r["pairs"] for r in rec.routing.table()] == [0] * len(N_BUCKETS)
    rec.shadow("mita", True, 0.25, n=2000)
    rec.shadow("dense", False, 0.75, n=2000)
    rec.shadow("dense", True, 0.5, n=2000)
    row = rec.routing.table()[1]  # le_4096
    assert (row["n_bucket"], row["pairs"], row["agreement"], row["kl_mean"]) == (
        "le_4096", 3, 2 / 3, 0.5)


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
