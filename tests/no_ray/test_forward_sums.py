"""One record type per forward, ``mita.records.ForwardProfile``: its sums (``flops_total``,
``stages_ms``, ``layers_ms``, ``gflops_per_s``) are the module's functions of its records and
FLOPs, worked out here by hand, computed once per record, and the same after the engine's
``shipped`` copy (records as plain tuples) goes through pickle, read before or after."""

from __future__ import annotations

import dataclasses
import pickle

import pytest

from mita import records
from mita.records import ForwardProfile, StageRecord

SUMS = ("flops_total", "stages_ms", "layers_ms", "gflops_per_s")
RECORDS = [StageRecord("embed", None, 0.5), StageRecord("attention", 0, 1.5),
           StageRecord("ffn", 0, 0.25), StageRecord("attention", 1, 2.5),
           StageRecord("head", None, 0.125)]
FLOPS = {"embed": 0, "attention": 8_000_000, "ffn": 500_000}
# by hand: attention 1.5 + 2.5 = 4 ms; 8e6 FLOPs in 4 ms = 2 GFLOP/s, 5e5 in 0.25 ms = 2;
# embed has no FLOPs, head none given: left out
EXPECTED = {"flops_total": 8_500_000,
            "stages_ms": {"embed": 0.5, "attention": 4.0, "ffn": 0.25, "head": 0.125},
            "layers_ms": [{"attention": 1.5, "ffn": 0.25}, {"attention": 2.5}],
            "gflops_per_s": {"attention": 2.0, "ffn": 2.0}}


def profile() -> ForwardProfile:
    return ForwardProfile(records=list(RECORDS), total_ms=6.0, device="cpu", flops=dict(FLOPS))


def test_the_sums_are_the_records_functions():
    p = profile()
    assert {s: getattr(p, s) for s in SUMS} == EXPECTED
    assert p.stages_ms == records.stages_ms(RECORDS)
    assert p.layers_ms == records.layers_ms(RECORDS)
    assert p.gflops_per_s == records.gflops_per_s(FLOPS, records.stages_ms(RECORDS))
    assert p.flops_total == sum(FLOPS.values())


def test_each_sum_is_computed_once(monkeypatch):
    calls = []
    for name in ("stages_ms", "layers_ms", "gflops_per_s"):
        real = getattr(records, name)
        monkeypatch.setattr(records, name,
                            lambda *a, real=real, name=name: calls.append(name) or real(*a))
    p = profile()
    for _ in range(3):
        assert {s: getattr(p, s) for s in SUMS} == EXPECTED
    assert sorted(calls) == ["gflops_per_s", "layers_ms", "stages_ms"]


def test_a_bare_record_says_not_known_and_the_context_is_added():
    p = profile()
    assert (p.dtype, p.batch_size, p.padded_n, p.started_at, p.topk_path) == (None,) * 5
    assert (p.staged, p.cuda_graph, p.peak_memory_bytes, p.peak_memory_kind) == (
        True, False, None, None)
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.total_ms = 1.0  # type: ignore[misc]
    shipped = p.shipped(dtype="float32", batch_size=2, padded_n=8, started_at=1.0,
                        staged=False, cuda_graph=True, topk_path="select")
    assert (shipped.dtype, shipped.batch_size, shipped.padded_n, shipped.started_at,
            shipped.staged, shipped.cuda_graph, shipped.topk_path) == (
        "float32", 2, 8, 1.0, False, True, "select")
    assert (shipped.total_ms, shipped.device, shipped.flops) == (6.0, "cpu", FLOPS)
    assert p.batch_size is None  # the timer's record is left as it was
    with pytest.raises(TypeError):
        p.shipped(flops_total=1)  # derived, not a field


def test_the_shipped_record_pickles_with_plain_tuples_and_the_same_sums():
    shipped = profile().shipped(dtype="float32", batch_size=1, padded_n=8, started_at=1.0)
    assert shipped.records == [tuple(r) for r in RECORDS]
    assert all(type(r) is tuple for r in shipped.records)
    unread = pickle.loads(pickle.dumps(shipped))  # before any sum was read
    for s in (shipped, unread, pickle.loads(pickle.dumps(shipped))):  # the last: after
        assert {n: getattr(s, n) for n in SUMS} == EXPECTED
        assert all(type(r) is tuple for r in s.records)
    assert shipped == unread  # equality compares the fields only, not the kept sums
    assert [f.name for f in dataclasses.fields(shipped)] == [
        "records", "total_ms", "device", "flops", "peak_memory_bytes", "peak_memory_kind",
        "dtype", "batch_size", "padded_n", "staged", "cuda_graph", "started_at", "topk_path"]
