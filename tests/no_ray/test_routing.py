"""Policy ``auto`` (``service.routing``) on fixed numbers: the Wilson bound, the decision rule,
the routing table's evidence and exploration, the advisor warm start, and the gateway's use of
it (explicit variant and sticky header win, decisions counted). End to end through HTTP:
``test_routing_service.py``."""

from __future__ import annotations

import asyncio
import json
import random
from pathlib import Path

import numpy as np
import pytest
from starlette.requests import Request

from mita.config import ModelConfig
from mita.data.task import checkpoint_task
from service.gateway import Gateway
from service.http import query_refusal
from service.request_book import RequestBook
from service.routing import Latency, RoutingTable, advisor_priors, decide_bucket, wilson_lower
from service.settings import AutoPolicy, GatewayConfig

from ..fakes import Scripted, answer, spied_recorder

# a real advisor report of the shipped checkpoint (python -m profiler advise, on this CPU)
REPORT = str(Path(__file__).resolve().parents[2] / "benchmarks" / "advise-cpu" / "advise.json")


def test_wilson_lower_bound_values():
    # Wilson (1927) 95 % interval of 8/10 is [0.4902, 0.9433]; of 10/10 [0.7225, 1]
    assert wilson_lower(8, 10, 1.96) == pytest.approx(0.4902, abs=1e-4)
    assert wilson_lower(10, 10, 1.96) == pytest.approx(0.7225, abs=1e-4)
    assert wilson_lower(95, 100, 1.96) == pytest.approx(0.8883, abs=1e-4)
    assert wilson_lower(7, 10, 0) == pytest.approx(0.7)  # z = 0: the proportion itself
    assert wilson_lower(0, 0, 1.96) == 0.0
    for bad in ((11, 10, 1.96), (-1, 10, 1.96), (5, 10, -1)):
        with pytest.raises(ValueError, match="need 0 ≤ agree ≤ pairs"):
            wilson_lower(*bad)


POLICY = AutoPolicy(margin=0.1, min_agreement=0.8, min_pairs=30, min_latency_samples=5)


def tight(ms: float, n: int = 10) -> Latency:
    """``n`` live forwards of exactly ``ms``: the median's interval is [ms, ms]."""
    return Latency(ms, (ms, ms), n)


@pytest.mark.parametrize("mita, dense, agree, pairs, want", [
    (tight(5.0), tight(40.0), 95, 100, ("mita", "faster_and_agreeing")),  # bound 0.888 ≥ 0.8
    (tight(5.0), tight(40.0), 80, 100, ("dense", "agreement_too_low")),  # bound 0.711 < 0.8
    (tight(5.0), tight(40.0), 29, 29, ("dense", "not_enough_data")),  # 29 pairs < 30
    (tight(1.0), tight(0.8), 100, 100, ("dense", "slower")),  # dense faster
    (tight(0.91), tight(1.0), 100, 100, ("dense", "slower")),  # faster, not by the 10 % margin
    (tight(0.9), tight(1.0), 100, 100, ("mita", "faster_and_agreeing")),  # exactly the margin
    (tight(5.0, 4), tight(40.0), 100, 100, ("dense", "not_enough_data")),  # 4 forwards < 5
    (Latency(None, None, 0), tight(40.0), 0, 0, ("dense", "not_enough_data")),
    # medians 5 against 40 ms, but MiTA's interval reaches 37 ms: 37 > 0.9 × 39, not shown
    (Latency(5.0, (4.0, 37.0), 10), Latency(40.0, (39.0, 41.0), 10), 100, 100,
     ("dense", "not_enough_data")),
    # the same once both windows are full: no more evidence will come, slower
    (Latency(5.0, (4.0, 37.0), 10, full=True), Latency(40.0, (39.0, 41.0), 10, full=True),
     100, 100, ("dense", "slower")),
    # no interval yet (too few forwards for one at 95 %): not shown either
    (Latency(5.0, None, 5), Latency(40.0, None, 5), 100, 100, ("dense", "not_enough_data")),
    # a warm start's medians (no interval, 3 repeats below min_latency_samples) still decide
    (Latency(5.0, None, 3, from_warm_start=True), tight(40.0), 100, 100,
     ("mita", "faster_and_agreeing")),
    (Latency(39.0, None, 3, from_warm_start=True), tight(40.0), 100, 100, ("dense", "slower")),
])
def test_decision_rule_on_fixed_numbers(mita, dense, agree, pairs, want):
    assert decide_bucket(mita, dense, agree, pairs, POLICY) == want


def feed(table: RoutingTable, n: int, mita_ms: float, dense_ms: float, forwards: int,
         agree: int, pairs: int) -> None:
    for _ in range(forwards):
        table.add_forward("mita", n, mita_ms)
        table.add_forward("dense", n, dense_ms)
    for i in range(pairs):
        table.add_pair(n, i < agree, 0.05)


def test_routing_table_decides_per_bucket_and_explores_less_once_settled():
    table = RoutingTable(AutoPolicy(min_agreement=0.55, min_pairs=20, explore=0.05,
                                    explore_unsettled=0.5))
    assert table.decide(64) == ("dense", "not_enough_data", 0.5)  # no data: dense, explore
    feed(table, 64, mita_ms=1.0, dense_ms=0.8, forwards=20, agree=20, pairs=20)
    feed(table, 4096, mita_ms=13.0, dense_ms=108.0, forwards=20, agree=16, pairs=20)
    assert table.decide(64) == ("dense", "slower", 0.05)
    assert table.decide(1024) == ("dense", "slower", 0.05)  # one bucket: le_1024
    assert table.decide(4096) == ("mita", "faster_and_agreeing", 0.05)  # bound 0.584 ≥ 0.55
    rows = {r["n_bucket"]: r for r in table.table()}
    long = rows["le_4096"]
    assert (long["mita_p50_ms"], long["dense_p50_ms"], long["pairs"]) == (13.0, 108.0, 20)
    assert long["agreement"] == 0.8 and long["kl_mean"] == pytest.approx(0.05)
    assert long["agreement_lower_bound"] == pytest.approx(wilson_lower(16, 20, 1.96))
    # 20 equal forwards each: both intervals are the one time, the ratio bound 13 / 108
    assert (long["mita_p50_interval_ms"], long["dense_p50_interval_ms"]) == ((13.0, 13.0),
                                                                           (108.0, 108.0))
    assert long["latency_ratio"] == long["latency_ratio_upper_bound"] == 13.0 / 108.0
    assert long["confidence"] == pytest.approx(0.95, abs=1e-5)  # erf(1.96 / √2) = 0.9500042
    assert rows["le_16384"]["reason"] == "not_enough_data" and not long["from_warm_start"]
    # a stricter guard, live: the same evidence now keeps dense
    table.configure(AutoPolicy(min_agreement=0.6, min_pairs=20))
    assert table.decide(4096)[:2] == ("dense", "agreement_too_low")


def test_the_window_keeps_the_most_recent_evidence():
    table = RoutingTable(AutoPolicy(window=20, min_pairs=20, min_agreement=0.5))
    feed(table, 4096, 50.0, 10.0, forwards=20, agree=0, pairs=20)  # old: MiTA slow, disagrees
    feed(table, 4096, 5.0, 10.0, forwards=20, agree=20, pairs=20)  # new evidence replaces it
    assert table.decide(4096)[:2] == ("mita", "faster_and_agreeing")
    table.configure(AutoPolicy(window=40, min_pairs=20, min_agreement=0.5))
    feed(table, 4096, 50.0, 10.0, forwards=21, agree=0, pairs=21)  # now the median is slow
    assert table.decide(4096)[:2] == ("dense", "slower")


def test_warm_start_from_an_advisor_report_and_its_refusals(tmp_path):
    priors = advisor_priors(Path(REPORT), "m8 k8 s1 paper")
    report = json.load(open(REPORT))
    row = next(r for r in report["rows"] if r["setting"] == "m8 k8 s1 paper")
    assert sorted(priors) == ["le_1024", "le_16384", "le_4096"]
    assert priors["le_4096"]["latency_ms"]["mita"] == row["latency"]["4096"]["p50_ms"]
    assert priors["le_4096"]["pairs"] == 1000 and priors["le_4096"]["agree"] == pytest.approx(
        row["agreement"] * 1000)
    # agreement 68.3 % over 1,000 sequences: bound ≈ 0.654, below the default 0.95 guard
    table = RoutingTable()
    table.configure(AutoPolicy(warm_start=REPORT), "m8 k8 s1 paper")
    assert table.warm_start == {"file": REPORT, "buckets": ["le_1024", "le_4096", "le_16384"]}
    assert table.decide(4096)[:2] == ("dense", "agreement_too_low")
    table.configure(AutoPolicy(warm_start=REPORT, min_agreement=0.6), "m8 k8 s1 paper")
    assert table.decide(4096)[:2] == ("mita", "faster_and_agreeing")
    row4096 = next(r for r in table.table() if r["n_bucket"] == "le_4096")
    assert row4096["from_warm_start"] and row4096["agreement_lower_bound"] == pytest.approx(
        wilson_lower(row["agreement"] * 1000, 1000, 1.96))
    # its bucket le_1024 was measured at N = 1,024: MiTA 1.9 ms, dense 3.4 ms
    assert table.decide(64)[:2] == ("mita", "faster_and_agreeing")
    # what cannot be used is said, and the buckets start cold
    (tmp_path / "config.json").write_text('{"dim": 64}')
    (tmp_path / "weights.bin").write_bytes(bytes(range(128, 256)))
    for file, setting, why in ((REPORT, "m3 k3 s1 paper", "no row for the served setting"),
                               (str(tmp_path / "none.json"), "m8 k8 s1 paper",
                                "FileNotFoundError"),
                               (str(tmp_path / "config.json"), "m8 k8 s1 paper",
                                "ValueError: not an advisor report (advise.json of python -m "
                                "profiler advise): KeyError 'rows'"),
                               (str(tmp_path / "weights.bin"), "m8 k8 s1 paper",
                                "not an advisor report: not a UTF-8 text file")):
        t = RoutingTable()
        t.configure(AutoPolicy(warm_start=file), setting)
        assert why in t.warm_start["error"] and t.decide(4096)[1] == "not_enough_data"


def gateway(policy: str = "auto", **cfg) -> tuple[Gateway, dict]:
    g = object.__new__(Gateway.func_or_class)  # no replica: only what _classify reads
    g.config = GatewayConfig(policy=policy, **cfg)
    g.recorder = spied_recorder()
    g.recorder.routing.configure(g.config.auto)
    handles = {v: Scripted(*[answer() | {"variant": v}] * 20) for v in ("mita", "dense")}
    g._classify_calls = handles
    g.task = checkpoint_task({}, ModelConfig(), ".")  # the ListOps task: label names "0"…"9"
    g.rng = random.Random(0)
    g._primaries = {"mita": 0, "dense": 0}
    g._shadow_tasks = {"mita": set(), "dense": set()}
    return g, handles


def request(headers: dict | None = None) -> Request:
    scope = {"type": "http", "method": "POST", "path": "/v1/classify", "headers": [
        (k.encode(), v.encode()) for k, v in (headers or {}).items()]}
    RequestBook.open(scope, arrived_at=0.0)
    return Request(scope)


def test_the_gateway_routes_by_the_table_and_lets_override_and_sticky_win():
    g, handles = gateway(weights={"mita": 0.0, "dense": 1.0},
                         auto=AutoPolicy(min_agreement=0.5, min_pairs=10, explore=0.0))
    feed(g.recorder.routing, 4096, 5.0, 50.0, forwards=20, agree=10, pairs=10)
    ids = np.ones(4096, dtype=np.uint8)

    async def main():
        auto = await g._classify(ids, None, False, request())
        forced = await g._classify(ids, "dense", False, request())
        sticky = await g._classify(ids, None, False, request({"x-client-key": "alice"}))
        return auto, forced, sticky
    auto, forced, sticky = asyncio.run(main())
    assert (auto["variant"], forced["variant"], sticky["variant"]) == ("mita", "dense", "dense")
    assert (len(handles["mita"].calls), len(handles["dense"].calls)) == (1, 2)
    calls = g.recorder.metrics.routing_decisions.calls
    assert [(v, t) for _, v, t in calls] == [
        (1, {"n_bucket": "le_4096", "variant": "mita", "reason": "faster_and_agreeing"})]


def test_auto_explores_a_share_of_requests_in_shadow():
    g, handles = gateway(auto=AutoPolicy(explore_unsettled=1.0))  # no data: every request
    ids = np.ones(64, dtype=np.uint8)

    async def main():
        out = await g._classify(ids, None, False, request())
        await asyncio.gather(*g._shadow_tasks["mita"])
        return out
    out = asyncio.run(main())
    assert out["variant"] == "dense" and out["shadow"] == "mita"
    assert len(handles["mita"].calls) == 1  # the shadow call
    assert g.recorder.routing.table()[0]["pairs"] == 1  # its comparison reached the table


@pytest.mark.parametrize("raw, why", [
    ({"policy": "Auto"}, "Input should be 'weighted' or 'auto'"),
    ({"auto": {"margin": 1.0}}, "less than 1"),
    ({"auto": {"min_agreement": "0.9"}}, "Input should be a valid number"),
    ({"auto": {"min_agreement": float("nan")}}, "finite number"),
    ({"auto": {"min_pairs": 2.0}}, "Input should be a valid integer"),
    ({"auto": {"explore": 1.5}}, "less than or equal to 1"),
    ({"auto": {"window": 5}}, "greater than or equal to 10"),
    ({"auto": {"guard": 0.9}}, "Extra inputs are not permitted"),
    ({"auto": {"warm_start": ""}}, "at least 1 character"),
    # more than the window keeps: the bucket could never settle
    ({"auto": {"window": 19, "min_pairs": 10}},
     r"min_latency_samples \(20\) must be ≤ window \(19\)"),
    ({"auto": {"window": 50, "min_pairs": 51}}, r"min_pairs \(51\) must be ≤ window"),
    # the same against the default window (refused only when window was given, before)
    ({"auto": {"min_latency_samples": 500}},
     r"min_latency_samples \(500\) must be ≤ window \(200\)"),
    ({"auto": {"min_pairs": 1000}}, r"min_pairs \(1000\) must be ≤ window \(200\)"),
    # an agreement bound the window's pairs cannot reach even all agreeing: n / (n + z²),
    # 50 / 53.8416 = 0.9286 and 200 / 225 = 0.8889 (it said agreement_too_low at 100 %)
    ({"auto": {"window": 50}}, r"min_agreement \(0.95\) is above what 50 pairs can show: .* "
                               r"is 0\.9286"),
    ({"auto": {"confidence_z": 5}}, r"above what 200 pairs can show: .* 5\.0 is 0\.8889"),
])
def test_auto_fields_are_parsed_strictly(raw, why):
    with pytest.raises(ValueError, match=why):
        GatewayConfig.model_validate(raw)
    assert GatewayConfig.model_validate({"policy": "auto"}).auto == AutoPolicy()


@pytest.mark.parametrize("change, why", [
    (lambda r, m: m["latency"]["4096"].update(p50_ms=float("nan")),
     "m8 k8 s1 paper p50_ms at N = 4096 = nan is out of range"),
    (lambda r, m: m["latency"]["4096"].update(p50_ms=-1.0), "p50_ms at N = 4096 = -1.0"),
    (lambda r, m: m["latency"]["4096"].update(p50_ms="3 ms"), "must be a number, got '3 ms'"),
    (lambda r, m: m.update(agreement=1.5), "agreement = 1.5 is out of range"),
    (lambda r, m: m.update(agreement=True), "must be a number, got True"),
    (lambda r, m: m.update(kl=float("inf")), "kl = inf is out of range"),
    (lambda r, m: r["config"].update(sequences=0), "config.sequences must be an integer"),
    (lambda r, m: m["latency"].update(abc={}), "a latency key (N) must be an integer"),
])
def test_a_warm_start_report_with_numbers_out_of_range_is_not_used(tmp_path, change, why):
    # a prior with NaN or an agreement above 1 would route on nonsense, or fail every request
    report = json.load(open(REPORT))
    change(report, next(r for r in report["rows"] if r["setting"] == "m8 k8 s1 paper"))
    bad = tmp_path / "advise.json"
    bad.write_text(json.dumps(report))
    with pytest.raises(ValueError) as e:
        advisor_priors(bad, "m8 k8 s1 paper")
    assert why in str(e.value)
    table = RoutingTable()
    table.configure(AutoPolicy(warm_start=str(bad)), "m8 k8 s1 paper")
    assert why in table.warm_start["error"] and table.decide(4096)[1] == "not_enough_data"
    assert all(r["from_warm_start"] is False for r in table.table())


def test_a_warm_start_stands_in_until_live_evidence_is_enough_on_its_own():
    # found by a user: one live forward replaced a 5-forward prior (and one pair 1,000 prior
    # pairs), and the bucket fell back to dense for want of data
    table = RoutingTable()
    policy = AutoPolicy(warm_start=REPORT, min_agreement=0.6, min_latency_samples=20,
                        min_pairs=30)
    table.configure(policy, "m8 k8 s1 paper")
    assert table.decide(4096)[:2] == ("mita", "faster_and_agreeing")
    row = next(r for r in table.table() if r["n_bucket"] == "le_4096")
    # the report's medians (5 repeats each, fewer than min_latency_samples: a prior is not
    # held to it) decide alone: no interval, no ratio bound
    assert (row["mita_forwards"], row["dense_forwards"], row["mita_p50_interval_ms"],
            row["dense_p50_interval_ms"], row["latency_ratio_upper_bound"]) == (
        5, 5, None, None, None)
    assert row["latency_ratio"] == row["mita_p50_ms"] / row["dense_p50_ms"]
    table.add_forward("mita", 4096, 101.0)  # one slow live forward: the prior still stands
    table.add_pair(4096, False, 2.0)
    row = next(r for r in table.table() if r["n_bucket"] == "le_4096")
    assert (row["variant"], row["mita_forwards"], row["pairs"], row["from_warm_start"]) == (
        "mita", 5, 1000, True)
    for _ in range(19):  # twenty live MiTA forwards: theirs is the median now
        table.add_forward("mita", 4096, 101.0)
    row = next(r for r in table.table() if r["n_bucket"] == "le_4096")
    assert (row["variant"], row["reason"], row["mita_p50_ms"], row["mita_forwards"]) == (
        "dense", "slower", 101.0, 20)
    # dense's median and the pairs are still the report's: MiTA's live interval is shown,
    # but no ratio bound (the prior has none), and the medians decide
    assert row["from_warm_start"] and row["mita_p50_interval_ms"] == (101.0, 101.0)
    assert row["dense_p50_interval_ms"] is None and row["latency_ratio_upper_bound"] is None
    for _ in range(20):
        table.add_forward("dense", 4096, 400.0)
    for _ in range(29):
        table.add_pair(4096, True, 0.5)
    row = next(r for r in table.table() if r["n_bucket"] == "le_4096")
    assert (row["variant"], row["pairs"], row["agreement"], row["from_warm_start"]) == (
        "mita", 30, 29 / 30, False)
    assert row["latency_ratio_upper_bound"] == 101.0 / 400.0


def test_routing_takes_no_query_parameters():
    # as /v1/stats refuses what it does not take (found by a user: ?x=1 was answered 200)
    req = Request({"type": "http", "method": "GET", "path": "/v1/routing",
                   "query_string": b"x=1", "headers": []})
    assert query_refusal(req, "/v1/routing") == (
        422, "unknown query parameter(s) ['x']; this endpoint takes none")
    assert query_refusal(Request({"type": "http", "method": "GET", "path": "/v1/routing",
                                  "query_string": b"", "headers": []}), "/v1/routing") is None
