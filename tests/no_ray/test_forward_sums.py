"""One definition of a forward's sums: the timer's ``ForwardProfile`` and the service's
``ForwardStats`` both take ``stages_ms``, ``layers_ms`` and ``gflops_per_s`` from
``mita.records.ForwardSums``, give the same numbers, and ``ForwardStats`` still pickles
(before and after the sums are read) with its records as plain tuples."""

from __future__ import annotations

import pickle

from mita.records import ForwardProfile, ForwardSums, StageRecord
from service.forward_stats import ForwardStats

SUMS = ("stages_ms", "layers_ms", "gflops_per_s")
PROFILE = ForwardProfile(
    records=[StageRecord("embed", None, 0.5), StageRecord("attention", 0, 1.5),
             StageRecord("ffn", 0, 0.25), StageRecord("attention", 1, 2.5),
             StageRecord("head", None, 0.125)],
    total_ms=6.0, device="cpu", flops={"embed": 0, "attention": 8_000_000, "ffn": 500_000})


def test_the_sums_are_defined_once():
    for cls in (ForwardProfile, ForwardStats):
        assert issubclass(cls, ForwardSums)
        assert not set(SUMS) & set(vars(cls))  # inherited, not defined again


def test_profile_and_stats_give_the_same_sums():
    stats = ForwardStats.of(PROFILE, dtype="float32", staged=True, batch_size=1, padded_n=8,
                            started_at=1.0)
    assert PROFILE.stages_ms == {"embed": 0.5, "attention": 4.0, "ffn": 0.25, "head": 0.125}
    assert PROFILE.layers_ms == [{"attention": 1.5, "ffn": 0.25}, {"attention": 2.5}]
    # 8e6 FLOPs in 4 ms = 2 GFLOP/s; 5e5 in 0.25 ms = 2; embed has no FLOPs: left out
    assert PROFILE.gflops_per_s == {"attention": 2.0, "ffn": 2.0}
    unread = pickle.loads(pickle.dumps(stats))  # before any sum was read
    for s in (stats, unread, pickle.loads(pickle.dumps(stats))):  # the last: after
        assert {n: getattr(s, n) for n in SUMS} == {n: getattr(PROFILE, n) for n in SUMS}
        assert all(type(r) is tuple for r in s.records)
    assert stats == unread  # equality still compares the fields only
