"""The A/B policy and the shadow KL on hand-worked numbers (no Ray): weights that do not sum to
1, the boundaries of the draw, and KL(dense ‖ MiTA) whichever variant is primary."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from mita.quality import KL_FLOOR, kl_divergence
from profiler.advise import compare
from service.metrics import DURATION_BUCKETS_S, n_bucket
from service.policy import choose_variant, shadow_comparison, sticky_unit
from service.recorder import Recorder
from service.settings import GatewayConfig

# KL([0.9, 0.1] ‖ [0.5, 0.5]) = 0.9 ln 1.8 + 0.1 ln 0.2 and the other direction
# 0.5 ln(5/9) + 0.5 ln 5, worked out by hand (7 digits).
DENSE, MITA = [0.9, 0.1], [0.5, 0.5]
KL_DENSE_MITA, KL_MITA_DENSE = 0.3680642, 0.5108256


class FixedDraw(random.Random):
    """A generator whose next draws are given: the policy's ``u`` on the boundaries."""

    def __init__(self, *draws: float):
        super().__init__(0)
        self.draws = list(draws)

    def random(self) -> float:
        return self.draws.pop(0)


@pytest.mark.parametrize("u,want", [(0.0, "mita"), (0.2499, "mita"), (0.25, "dense"),
                                    (0.9999, "dense")])
def test_weights_that_do_not_sum_to_one_split_by_their_share(u, want):
    # {mita: 1, dense: 3}: mita takes [0, 0.25) of the draw, dense the rest
    cfg = GatewayConfig(weights={"mita": 1.0, "dense": 3.0})
    assert choose_variant(cfg, None, None, FixedDraw(u)) == (want, None)


def test_a_zero_weight_never_serves_and_shadow_is_the_other_variant():
    only_dense = GatewayConfig(weights={"mita": 0.0, "dense": 5.0}, shadow=True)
    assert choose_variant(only_dense, None, None, FixedDraw(0.0)) == ("dense", "mita")
    only_mita = GatewayConfig(weights={"mita": 2.0, "dense": 0.0})
    assert choose_variant(only_mita, None, None, FixedDraw(0.9999)) == ("mita", None)
    # a variant left out of the weights has weight 0
    only_named = GatewayConfig(weights={"dense": 2.0})
    assert choose_variant(only_named, None, None, FixedDraw(0.0)) == ("dense", None)
    with pytest.raises(ValueError):
        GatewayConfig(weights={"mita": 0, "dense": 0})


def test_override_wins_and_a_random_split_follows_the_weights():
    cfg = GatewayConfig(weights={"mita": 0.25, "dense": 0.75})
    rng = random.Random(0)
    picks = [choose_variant(cfg, None, None, rng)[0] for _ in range(4000)]
    # binomial(4000, 0.25): sd 0.0068, so 0.03 is 4.4 sd
    assert abs(picks.count("mita") / 4000 - 0.25) < 0.03
    assert choose_variant(cfg, "mita", "k", rng) == ("mita", None)
    assert choose_variant(cfg.model_copy(update={"shadow": True}), "dense", None, rng) == (
        "dense", "mita")


def test_sticky_unit_is_the_first_64_bits_of_sha256():
    # SHA-256("abc") = ba7816bf8f01cfea… (the FIPS 180-2 example): 0xba7816bf8f01cfea / 2^64
    assert sticky_unit("abc") == 0xBA7816BF8F01CFEA / 2**64  # exact: both are 53-bit rounded
    cfg = GatewayConfig(weights={"mita": 0.7, "dense": 0.3})  # 0.728 ≥ 0.7: dense
    assert choose_variant(cfg, None, "abc", FixedDraw()) == ("dense", None)
    cfg = GatewayConfig(weights={"mita": 0.73, "dense": 0.27})
    assert choose_variant(cfg, None, "abc", FixedDraw()) == ("mita", None)


def test_kl_on_hand_examples():
    assert kl_divergence(DENSE, MITA) == pytest.approx(KL_DENSE_MITA, abs=5e-8)
    assert kl_divergence(MITA, DENSE) == pytest.approx(KL_MITA_DENSE, abs=5e-8)
    assert kl_divergence([0.5, 0.5], [0.5, 0.5]) == 0
    assert kl_divergence([1.0, 0.0], [0.5, 0.5]) == pytest.approx(math.log(2), rel=1e-15)
    # a zero where the reference is not: clamped at KL_FLOOR, finite (1 · ln(1 / 1e-12))
    assert kl_divergence([1.0, 0.0], [0.0, 1.0]) == pytest.approx(-math.log(KL_FLOOR),
                                                                   rel=1e-12)
    assert type(kl_divergence(DENSE, MITA)) is float
    # float32 answers are compared in float64 (the docstring's promise)
    rows = kl_divergence(np.float32([DENSE, MITA]), np.float32([MITA, DENSE]))
    assert rows.shape == (2,) and rows.dtype == np.float64
    # 5e-8: the 7 digits above, and float32(0.9) is 0.9 to 2.4e-8
    assert rows == pytest.approx([KL_DENSE_MITA, KL_MITA_DENSE], abs=5e-8)
    # exactly: the float32 inputs widened first, then every log taken in float64
    wide = kl_divergence(np.float32([DENSE, MITA]).astype(np.float64),
                         np.float32([MITA, DENSE]).astype(np.float64))
    assert rows.tolist() == wide.tolist()
    assert kl_divergence(np.float32(DENSE), MITA) == kl_divergence(np.float32(DENSE).tolist(), MITA)
    with pytest.raises(ValueError, match="shape"):
        kl_divergence([0.5, 0.5], [0.2, 0.3, 0.5])


def test_the_advisor_averages_the_same_kl():
    got = compare(np.array([DENSE, MITA]), np.array([MITA, DENSE]), np.array([0, 1]))
    assert got["kl"] == pytest.approx((KL_DENSE_MITA + KL_MITA_DENSE) / 2, abs=5e-8)


@pytest.mark.parametrize("primary", ["mita", "dense"])
def test_shadow_kl_is_dense_against_mita_whichever_is_primary(primary):
    """The metric's and /v1/stats' value: KL(dense ‖ MiTA) = 0.3680642 nats in both A/B
    directions (the swapped KL would be 0.5108256)."""
    answers = {"mita": {"label": 0, "probabilities": MITA},
               "dense": {"label": 0, "probabilities": DENSE}}
    shadow = "dense" if primary == "mita" else "mita"
    agree, kl = shadow_comparison(primary, answers[primary], answers[shadow])
    assert agree is True and kl == pytest.approx(KL_DENSE_MITA, abs=5e-8)

    recorder = Recorder()
    observed = []

    class Histogram:  # what the recorder hands the Prometheus histogram
        def observe(self, value, tags):
            observed.append((value, tags))

    recorder.metrics.shadow_kl = Histogram()
    recorder.shadow(primary, agree, kl)
    assert observed == [(pytest.approx(KL_DENSE_MITA, abs=5e-8), {"primary": primary})]
    stats = recorder.window.summary()["shadow"]
    assert stats["comparisons"] == 1 and stats["agree"] == 1
    assert stats["kl_mean"] == pytest.approx(KL_DENSE_MITA, abs=5e-8)
    assert stats["kl_p50"] == pytest.approx(KL_DENSE_MITA, abs=5e-8)


def test_labels_that_differ_disagree():
    agree, _ = shadow_comparison("dense", {"label": 1, "probabilities": [0.2, 0.8]},
                                 {"label": 0, "probabilities": [0.6, 0.4]})
    assert agree is False


def test_n_buckets_and_duration_buckets():
    assert [n_bucket(n) for n in (1, 1024, 1025, 4096, 4097)] == [
        "le_1024", "le_1024", "le_4096", "le_4096", "le_16384"]
    assert n_bucket(5_000_000) == "le_1048576"
    assert DURATION_BUCKETS_S[0] == 1e-5 and DURATION_BUCKETS_S[-1] == 300.0
