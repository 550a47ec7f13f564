"""Policy ``auto``'s "faster" with a bound (issue 62, part 3): the sign-test interval of a
median (``median_rank``, ``median_interval``) against exact binomial sums worked out here and
against its coverage on fresh skewed samples; the decision on scripted timings at the margin's
boundary; the field case (MiTA measured slower, a handful of lucky exploration timings); and
``/v1/routing``'s counts, intervals and ratio bound. The rule on fixed ``Latency`` values:
``test_routing.py``."""

from __future__ import annotations

import math
import random
from fractions import Fraction
from statistics import NormalDist

import numpy as np
import pytest

from service.routing import Latency, RoutingTable, decide_bucket, median_interval, median_rank
from service.schemas import RoutingResponse
from service.settings import AutoPolicy

Z = 1.96
# P(Z > 1.96), from the standard library's normal distribution (not the code's erfc)
TAIL = NormalDist().cdf(-Z)


def pascal_rows(most: int) -> list[list[int]]:
    """Rows 0..most of Pascal's triangle by additions only (independent of math.comb)."""
    rows = [[1]]
    for _ in range(most):
        r = rows[-1]
        rows.append([1] + [a + b for a, b in zip(r, r[1:], strict=False)] + [1])
    return rows


ROWS = pascal_rows(300)


def exact_rank(n: int, tail: float, row: list[int] | None = None) -> int:
    """The largest j ≤ (n + 1)/2 with P(Bin(n, ½) ≤ j − 1) ≤ tail, in exact integers (the tail
    as its exact fraction num/den: Σ_{i<j} C(n, i) · den ≤ num · 2^n); 0 when none."""
    num, den = Fraction(tail).as_integer_ratio()
    limit = num * 2**n
    j, below = 0, 0
    while j + 1 <= (n + 1) // 2:
        below += row[j] if row is not None else math.comb(n, j)
        if below * den > limit:
            break
        j += 1
    return j


def exact_coverage(n: int, j: int) -> float:
    """Two-sided coverage of [x_(j), x_(n+1−j)] for a continuous distribution: 1 − 2 P(Bin(n,
    ½) ≤ j − 1)."""
    return 1 - 2 * sum(math.comb(n, i) for i in range(j)) / 2**n


def test_median_rank_on_hand_worked_values():
    # at 1.96 each end holds at one-sided 97.5 %: x_(1) needs 2^−n ≤ 0.025, n ≥ 6 (1/64)
    assert [median_rank(n, Z) for n in range(6)] == [0] * 6  # 2^−5 = 0.03125 > 0.025
    assert median_rank(6, Z) == 1  # 1/64 = 0.0156 ≤ 0.025 < 7/64
    assert median_rank(9, Z) == 2  # (1 + 9)/512 = 0.0195 ≤ 0.025 < (1 + 9 + 36)/512 = 0.0898
    # n = 20: Σ_{i≤5} C(20, i) = 1 + 20 + 190 + 1140 + 4845 + 15504 = 21700, / 2^20 = 0.0207;
    # adding C(20, 6) = 38760 gives 0.0577: the 6th from each end
    assert median_rank(20, Z) == 6
    # z = 0 (tail ½): the interval shrinks to the middle: n = 5 → x_(3); n = 6 → x_(3), x_(4)
    assert (median_rank(5, 0.0), median_rank(6, 0.0)) == (3, 3)
    with pytest.raises(ValueError, match="need n ≥ 0 and a finite z ≥ 0"):
        median_rank(10, -1.0)


@pytest.mark.parametrize("z", [0.0, 1.0, 1.645, 1.96, 2.576, 3.0])
def test_median_rank_against_exact_binomial_sums(z):
    tail = NormalDist().cdf(-z)
    assert [median_rank(n, z) for n in range(301)] == [
        exact_rank(n, tail, ROWS[n]) for n in range(301)]
    # above 1,000 forwards the code sums in float logs: the same ranks as exact sums
    for n in (1001, 1500, 2000, 5000):
        assert median_rank(n, z) == exact_rank(n, tail), n


def test_median_interval_is_order_statistics():
    times = [7.0, 1.0, 3.0, 9.0, 5.0, 2.0, 8.0, 4.0, 6.0]  # n = 9: j = 2, x_(2) and x_(8)
    assert median_interval(times, Z) == (5.0, (2.0, 8.0))
    assert median_interval(times[:5], Z) == (5.0, None)  # 5 samples: no finite bound at 95 %
    assert median_interval([1.0, 2.0], 0.0) == (1.5, (1.0, 2.0))
    with pytest.raises(ValueError, match="no times"):
        median_interval([], Z)


# Coverage checks: 4,000 seeded trials; a proportion near 0.95 has a standard error of
# sqrt(0.95 · 0.05 / 4000) = 0.0034 over them, so 0.014 is 4 standard errors.
TRIALS = 4000
COVERAGE_TOL = 0.014


@pytest.mark.parametrize("n", [6, 20, 60, 200])
def test_interval_coverage_on_skewed_samples(n):
    # lognormal(0, 1): strongly right-skewed like forward times, median exactly e^0 = 1
    rng = np.random.default_rng(62_000 + n)
    covered = 0
    for sample in rng.lognormal(0.0, 1.0, size=(TRIALS, n)):
        _, (lo, hi) = median_interval(sample.tolist(), Z)
        covered += lo <= 1.0 <= hi
    want = exact_coverage(n, exact_rank(n, TAIL))  # n = 20: 1 − 2 · 0.0207 = 0.9586
    assert want >= 0.95
    assert covered / TRIALS >= 0.95 - COVERAGE_TOL
    assert abs(covered / TRIALS - want) <= COVERAGE_TOL  # not wider than it says either


@pytest.mark.parametrize("n", [20, 200])
def test_ratio_bound_coverage_and_false_faster_rate_at_the_margin(n):
    """MiTA's true median exactly (1 − margin) × dense's (the boundary, not faster by the
    margin) and different shapes: the ratio bound covers the true ratio 0.9 at ≥ 95 %, and
    MiTA is called faster in at most 5 % of trials."""
    rng = np.random.default_rng(62_100 + n)
    policy = AutoPolicy(min_latency_samples=20, min_pairs=1, min_agreement=0.0, window=n)
    covered = faster = 0
    for _ in range(TRIALS):
        dense = 10.0 * rng.lognormal(0.0, 0.3, n)  # median 10 ms
        mita = 9.0 * rng.exponential(1.0, n) / math.log(2)  # median 9 ms, another shape
        m, d = (Latency.of(x.tolist(), Z, n) for x in (mita, dense))
        covered += 0.9 <= m.interval_ms[1] / d.interval_ms[0]
        faster += decide_bucket(m, d, 1, 1, policy)[0] == "mita"
    assert covered / TRIALS >= 0.95 - COVERAGE_TOL
    assert faster / TRIALS <= 0.05 + COVERAGE_TOL


# ---- scripted timings at the boundary, through the routing table ---------------------------

def script(table: RoutingTable, n: int, mita: list[float], dense: list[float],
           pairs: int = 50) -> dict:
    for t in mita:
        table.add_forward("mita", n, t)
    for t in dense:
        table.add_forward("dense", n, t)
    for _ in range(pairs):
        table.add_pair(n, True, 0.01)
    return table.table()[1]  # le_4096


DENSE_20 = [100.0 + i for i in range(20)]  # 100 … 119 ms: median 109.5, x_(6) 105, x_(15) 114
# each MiTA time 0.5 ms below 0.9 × a dense one: medians a hair inside the margin
HAIR_20 = [0.9 * t - 0.5 for t in DENSE_20]


def test_a_hair_inside_the_margin_on_few_spread_samples_is_not_settled():
    table = RoutingTable(AutoPolicy(min_agreement=0.0, min_pairs=1))
    row = script(table, 4096, HAIR_20, DENSE_20)
    # medians 0.9 · 109.5 − 0.5 = 98.05 against 109.5: ratio 0.8954 ≤ 0.9; but MiTA's interval
    # [x_(6), x_(15)] = [94.0, 102.1] and dense's [105, 114]: bound 102.1 / 105 = 0.9724
    assert (row["variant"], row["reason"]) == ("dense", "not_enough_data")
    assert row["latency_ratio"] == pytest.approx(98.05 / 109.5, rel=1e-12)
    assert row["mita_p50_interval_ms"] == pytest.approx((94.0, 102.1), rel=1e-12)
    assert row["dense_p50_interval_ms"] == (105.0, 114.0)
    assert row["latency_ratio_upper_bound"] == pytest.approx(102.1 / 105.0, rel=1e-12)
    assert (row["mita_forwards"], row["dense_forwards"]) == (20, 20)
    assert table.decide(4096) == ("dense", "not_enough_data", 0.5)  # explore to settle it


def test_the_same_once_both_windows_are_full_is_slower():
    # the windows keep 20: no more evidence can come without old evidence going
    table = RoutingTable(AutoPolicy(min_agreement=0.0, min_pairs=1, window=20))
    row = script(table, 4096, HAIR_20, DENSE_20)
    assert (row["variant"], row["reason"]) == ("dense", "slower")
    assert table.decide(4096) == ("dense", "slower", 0.05)
    # one window full is not enough: the other could still settle it
    table = RoutingTable(AutoPolicy(min_agreement=0.0, min_pairs=1, window=20))
    row = script(table, 4096, HAIR_20[:19], DENSE_20)
    assert (row["variant"], row["reason"]) == ("dense", "not_enough_data")


def test_a_hair_inside_the_margin_on_many_tight_samples_is_mita():
    # 200 each: dense 100.0 … 100.4 ms, MiTA 89.90 … 89.94: every MiTA time is below 0.9 × every
    # dense one (90.0), so whatever ranks the interval takes, its bound is ≤ 89.94 / 100 < 0.9
    dense = [100.0 + 0.1 * (i % 5) for i in range(200)]
    mita = [89.9 + 0.01 * (i % 5) for i in range(200)]
    table = RoutingTable(AutoPolicy(min_agreement=0.0, min_pairs=1))
    row = script(table, 4096, mita, dense)
    assert (row["variant"], row["reason"]) == ("mita", "faster_and_agreeing")
    assert row["latency_ratio_upper_bound"] <= 89.94 / 100.0 < 0.9
    lo, hi = row["dense_p50_interval_ms"]
    assert 100.0 <= lo <= row["dense_p50_ms"] <= hi <= 100.4
    # and exactly on the margin: 9 ms against 10 ms, 20 each, 9.0 ≤ 0.9 × 10.0 → MiTA
    table = RoutingTable(AutoPolicy(min_agreement=0.0, min_pairs=1))
    assert script(table, 4096, [9.0] * 20, [10.0] * 20)["variant"] == "mita"
    table = RoutingTable(AutoPolicy(min_agreement=0.0, min_pairs=1))
    assert script(table, 4096, [9.001] * 20, [10.0] * 20)["reason"] == "slower"


def test_the_field_case_a_handful_of_lucky_exploration_timings_does_not_route_to_mita():
    """The report: min_agreement 0, the short bucket routed to MiTA for minutes although MiTA
    measured slower there, on 5 MiTA timings from exploration. Dense: 200 timings around 2.1
    ms; MiTA really ~4 ms, but its first timings were lucky."""
    rng = random.Random(62)
    dense = [2.1 * rng.lognormvariate(0.0, 0.2) for _ in range(200)]
    lucky = [1.2, 1.3, 1.5, 1.6, 4.0]  # median 1.5: under the old rule (5 samples) → MiTA
    # the field's own setting (min_latency_samples 5): no interval exists at 5 samples
    table = RoutingTable(AutoPolicy(min_agreement=0.0, min_pairs=1, min_latency_samples=5))
    script(table, 64, lucky, dense)
    row = next(r for r in table.table() if r["n_bucket"] == "le_1024")
    assert (row["variant"], row["reason"], row["mita_p50_interval_ms"]) == (
        "dense", "not_enough_data", None)
    assert row["latency_ratio"] < 0.9 and row["latency_ratio_upper_bound"] is None
    # the default (20): not enough forwards
    table = RoutingTable(AutoPolicy(min_agreement=0.0, min_pairs=1))
    script(table, 64, lucky, dense)
    assert table.decide(64)[:2] == ("dense", "not_enough_data")
    # 20 MiTA timings, 14 of them lucky (1 ms), 6 slow (4 ms): the median (1.0) says faster,
    # but the interval's upper end is x_(15) of the sorted 20 = 4.0, about twice dense's
    # lower end: not shown; exploration goes on
    table = RoutingTable(AutoPolicy(min_agreement=0.0, min_pairs=1))
    script(table, 64, [1.0] * 14 + [4.0] * 6, dense)
    row = next(r for r in table.table() if r["n_bucket"] == "le_1024")
    assert row["mita_p50_ms"] == 1.0 and row["mita_p50_interval_ms"] == (1.0, 4.0)
    assert (row["variant"], row["reason"]) == ("dense", "not_enough_data")
    assert row["latency_ratio"] < 0.9 < row["latency_ratio_upper_bound"]


def simulate(mita_ms: float, dense_ms: float, requests: int, seed: int
             ) -> tuple[list[str], RoutingTable]:
    """Policy auto as the gateway runs it, on lognormal forward times (medians ``mita_ms``,
    ``dense_ms``; σ 0.5, noisy): each request served by the decided variant and, with the
    decided exploration fraction, by the other too (a shadow pair that agrees)."""
    rng = random.Random(seed)
    table = RoutingTable(AutoPolicy(min_agreement=0.0, min_pairs=1))
    median = {"mita": mita_ms, "dense": dense_ms}
    served = []
    for _ in range(requests):
        variant, _, explore = table.decide(64)
        served.append(variant)
        table.add_forward(variant, 64, median[variant] * rng.lognormvariate(0.0, 0.5))
        if rng.random() < explore:
            other = "mita" if variant == "dense" else "dense"
            table.add_forward(other, 64, median[other] * rng.lognormvariate(0.0, 0.5))
            table.add_pair(64, True, 0.01)
    return served, table


@pytest.mark.parametrize("seed", range(5))
def test_policy_auto_never_routes_to_a_variant_measured_slower(seed):
    # MiTA 4.0 against dense 2.1 ms (the benchmark's short bucket), MiTA timings only from
    # exploration: not one request to MiTA, and the bucket ends settled as slower
    served, table = simulate(4.0, 2.1, 1500, seed)
    assert "mita" not in served
    row = table.table()[0]
    assert (row["reason"], row["mita_forwards"] >= 20) == ("slower", True)


@pytest.mark.parametrize("seed", range(5))
def test_exploration_gets_the_timings_that_settle_a_faster_mita(seed):
    served, table = simulate(1.0, 2.1, 600, seed)
    first = served.index("mita")
    # 20 forwards of each are needed (at 50 % exploration MiTA's come within ~40 requests),
    # then as many as the interval needs to clear the margin (~40–60 here, σ 0.5); while
    # its bound hovers at the margin a few requests may still go to dense (no hysteresis)
    assert 20 <= first <= 100
    assert set(served[200:]) == {"mita"}
    row = table.table()[0]
    assert row["reason"] == "faster_and_agreeing" and row["latency_ratio_upper_bound"] <= 0.9


def test_v1_routing_shows_counts_intervals_the_ratio_bound_and_the_confidence():
    table = RoutingTable(AutoPolicy(min_agreement=0.0, min_pairs=1))
    script(table, 4096, HAIR_20, DENSE_20)
    body = RoutingResponse.model_validate(table.report("auto")).model_dump(mode="json")
    row = body["buckets"][1]
    assert row["n_bucket"] == "le_4096" and row["dense_p50_interval_ms"] == [105.0, 114.0]
    assert (row["mita_forwards"], row["dense_forwards"], row["pairs"]) == (20, 20, 50)
    assert row["latency_ratio_upper_bound"] == pytest.approx(102.1 / 105.0, rel=1e-12)
    assert row["confidence"] == pytest.approx(0.95, abs=1e-5)  # erf(1.96/√2) = 0.9500042
    empty = body["buckets"][0]
    assert (empty["mita_p50_interval_ms"], empty["latency_ratio"],
            empty["latency_ratio_upper_bound"]) == (None, None, None)
