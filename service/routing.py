"""Latency-optimal routing: the gateway policy ``auto``.

Per N bucket (``metrics.n_bucket``, the buckets of the latency metrics), the gateway keeps
each variant's recent forward times and, from shadowed requests, whether MiTA's label agreed
with dense's and the KL between their probabilities. A request of that bucket goes to MiTA
when MiTA is faster than dense by ``margin`` **with stated confidence** — the upper end of the
distribution-free (sign-test) confidence interval of MiTA's median forward is at most
(1 − margin) × the lower end of dense's, over at least ``min_latency_samples`` forwards of
each — **and** the lower bound of the agreement's Wilson score interval reaches
``min_agreement``; otherwise to dense, the reference. A fraction of ``auto`` requests is also
shadowed to the other variant, more while a bucket is unsettled, so both latencies and the
agreement stay current.

``RoutingTable`` holds the evidence (bounded deques, one gateway replica's own) and answers
``decide``; ``decide_bucket`` is the rule on plain numbers, ``median_interval`` the interval.
Ray-free: tested without Serve.
"""

from __future__ import annotations

import json
import logging
import math
import threading
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction
from functools import lru_cache
from pathlib import Path

import numpy as np

from . import PROJECT_ROOT
from .metrics import N_BUCKETS, ROUTING_DECISIONS, n_bucket
from .settings import VARIANTS, AutoPolicy

log = logging.getLogger("ray.serve")

# Why a bucket's requests go where they go (the decision counter's ``reason`` label):
# faster_and_agreeing → mita; slower (MiTA not shown faster than dense by the margin),
# agreement_too_low (its lower bound below min_agreement), not_enough_data (too few forwards
# of a variant or shadow pairs, or MiTA's medians look faster by the margin but their
# interval does not show it yet while the windows still have room) → dense
(_, FASTER_AND_AGREEING), (_, SLOWER), (_, AGREEMENT_TOO_LOW), (_, NOT_ENOUGH_DATA) = (
    ROUTING_DECISIONS)

# Up to this many samples the sign test's binomial tail is summed in exact integers (math.comb
# and the tail as an exact fraction), so a rank is never off by one from float rounding;
# above it (only with a ``window`` over 1,000) in float logs via lgamma, whose relative error
# (~1e-10 at n = 100,000) can only matter where the tail equals the binomial sum to 10 digits.
EXACT_RANK_UP_TO = 1000
# The float sum stops once a term is below this share of the sum so far: the terms fall
# geometrically away from the mode, so what is left is below double precision.
TAIL_TERM_EPS = 1e-17


def wilson_lower(agree: float, pairs: float, z: float) -> float:
    """Lower end of the Wilson score interval (Wilson 1927) of a proportion: ``agree``
    successes in ``pairs`` trials at ``z`` standard normal quantiles (1.96: two-sided 95 %).
    0 for no pairs. Raises ValueError unless 0 ≤ agree ≤ pairs and z ≥ 0."""
    if not 0 <= agree <= pairs or z < 0:
        raise ValueError(f"need 0 ≤ agree ≤ pairs and z ≥ 0, got {agree}, {pairs}, {z}")
    if pairs == 0:
        return 0.0
    p, z2 = agree / pairs, z * z
    centre = p + z2 / (2 * pairs)
    spread = z * math.sqrt(p * (1 - p) / pairs + z2 / (4 * pairs * pairs))
    return max(0.0, (centre - spread) / (1 + z2 / pairs))


def confidence(z: float) -> float:
    """The two-sided confidence of ``z`` standard normal quantiles, erf(z / √2): 0.95 for
    1.96 (0.9500042). Each end of such an interval holds at one-sided 1 − (1 − confidence)/2
    (0.975), so two ends of two independent intervals hold together at ≥ the confidence."""
    return math.erf(z / math.sqrt(2))


@lru_cache(maxsize=4096)
def median_rank(n: int, z: float) -> int:
    """The 1-based rank j such that the order statistics x_(j) ≤ x_(n+1−j) of ``n`` samples
    bound their distribution's median m, each end at one-sided confidence ≥ 1 − t, t = ½ erfc(z
    / √2) (z's upper normal tail: 0.025 for 1.96), so the interval at two-sided ≥ 1 − 2t =
    ``confidence(z)``: the largest j ≤ (n + 1)/2 with P(Binomial(n, ½) ≤ j − 1) ≤ t.

    Why it holds for any distribution (the sign test's interval): x_(j) > m only when fewer
    than j samples are ≤ m, and the count of samples ≤ m is Binomial(n, p) with p = P(X ≤ m) ≥
    ½, so P(x_(j) > m) ≤ P(Binomial(n, ½) ≤ j − 1) ≤ t; the upper end likewise. Exact sums up
    to ``EXACT_RANK_UP_TO`` samples, float logs above. 0 when even j = 1 misses (2^−n > t:
    fewer samples than a finite bound needs at this confidence, 6 at 1.96). Raises ValueError
    unless n ≥ 0 and z is finite and ≥ 0."""
    if n < 0 or not 0 <= z < math.inf:
        raise ValueError(f"need n ≥ 0 and a finite z ≥ 0, got {n}, {z}")
    tail = 0.5 * math.erfc(z / math.sqrt(2))
    most = (n - 1) // 2  # j − 1 at most: j ≤ n + 1 − j, the lower end is not above the upper
    if n <= EXACT_RANK_UP_TO:
        # P(Bin(n, ½) ≤ k) ≤ t ⟺ Σ_{i≤k} C(n, i) ≤ t·2^n, in integers and an exact fraction
        bound = Fraction(tail) * 2**n
        k, c, total = -1, 1, 1  # c = C(n, k + 1), total = Σ_{i ≤ k+1} C(n, i)
        while k < most and total <= bound:
            k += 1
            c = c * (n - k) // (k + 1)
            total += c
        return k + 1
    # from the normal approximation of the rank, step to the exact one
    k = max(-1, min(most, math.floor(n / 2 - z * math.sqrt(n) / 2) - 1))
    while k >= 0 and _half_binomial_cdf(k, n) > tail:
        k -= 1
    while k < most and _half_binomial_cdf(k + 1, n) <= tail:
        k += 1
    return k + 1


def _half_binomial_cdf(k: int, n: int) -> float:
    """P(Binomial(n, ½) ≤ k) for 0 ≤ k < n, summed from k down in float logs (lgamma), so
    that 2^−n does not underflow at large n; exactly ½ at k = (n − 1)/2 (symmetry), the one
    sum a tail (z = 0) can equal exactly."""
    if 2 * k + 1 == n:
        return 0.5
    log_scale = math.lgamma(n + 1) - n * math.log(2)
    total = 0.0
    for i in range(k, -1, -1):
        term = math.exp(log_scale - math.lgamma(i + 1) - math.lgamma(n - i + 1))
        total += term
        if term < TAIL_TERM_EPS * total:
            break
    return total


def median_interval(times_ms: Sequence[float], z: float
                    ) -> tuple[float, tuple[float, float] | None]:
    """(median, its interval or None) of forward times (ms, any order, at least one): the
    sample median and [x_(j), x_(n+1−j)] with j = ``median_rank(n, z)``, a distribution-free
    interval of the true median at two-sided confidence ≥ ``confidence(z)`` (each end at
    one-sided ≥ 1 − ½ erfc(z/√2)); None when ``n`` is too small for a finite one (j = 0).
    O(n log n). Raises ValueError for no times."""
    if not times_ms:
        raise ValueError("no times: a median needs at least one")
    s = sorted(times_ms)
    n, h = len(s), len(s) // 2
    median = s[h] if n % 2 else (s[h - 1] + s[h]) / 2
    j = median_rank(n, z)
    return float(median), ((float(s[j - 1]), float(s[n - j])) if j else None)


@dataclass(frozen=True)
class Latency:
    """One variant's forward times in one bucket as the rule sees them: the median (ms, None
    without forwards), its ``median_interval`` (ms, None when too few forwards or from a
    prior), the forwards counted, whether the ``window`` is full (no more evidence will come
    before old evidence goes), and whether a warm start's prior (a median alone) stands in."""

    median_ms: float | None
    interval_ms: tuple[float, float] | None
    count: int
    full: bool = False
    from_warm_start: bool = False

    @classmethod
    def of(cls, times_ms: Sequence[float], z: float, window: int) -> Latency:
        """The live evidence of ``times_ms`` (ms), the last ``window`` forwards kept."""
        if not times_ms:
            return cls(None, None, 0)
        median, interval = median_interval(times_ms, z)
        return cls(median, interval, len(times_ms), len(times_ms) >= window)


def latency_ratio(mita: Latency, dense: Latency) -> tuple[float | None, float | None]:
    """(MiTA's median / dense's, its upper confidence bound): the bound is the upper end of
    MiTA's median interval over the lower end of dense's, both live; it holds at ≥
    ``confidence(z)`` (each end at one-sided 1 − t, so both at ≥ 1 − 2t: Bonferroni). None
    where a median (or, for the bound, a live interval) is missing or a divisor is not > 0."""
    ratio = bound = None
    if mita.median_ms is not None and dense.median_ms is not None and dense.median_ms > 0:
        ratio = mita.median_ms / dense.median_ms
    if (mita.interval_ms is not None and dense.interval_ms is not None
            and not (mita.from_warm_start or dense.from_warm_start)
            and dense.interval_ms[0] > 0):
        bound = mita.interval_ms[1] / dense.interval_ms[0]
    return ratio, bound


def decide_bucket(mita: Latency, dense: Latency, agree: float, pairs: float,
                  policy: AutoPolicy) -> tuple[str, str]:
    """(variant, reason) for one bucket from each variant's ``Latency`` and ``agree`` of
    ``pairs`` shadow comparisons with equal labels. Checked in this order:

    1. a variant without forwards, or with fewer live ones than ``min_latency_samples`` (a
       warm start's prior is not counted against it) → not_enough_data;
    2. MiTA faster by the margin: with both live, the ratio's upper bound (``latency_ratio``:
       MiTA's median interval's upper end / dense's lower end, at ≥ ``confidence(z)``) ≤ 1 −
       margin; with a prior standing in for either, no interval: the medians' ratio ≤ 1 −
       margin. Not so → slower, except while both are live, the medians' ratio is ≤ 1 −
       margin and a window still has room: → not_enough_data, so exploration gets the
       timings that settle it (once both windows are full the bucket is called slower);
    3. fewer than ``min_pairs`` pairs → not_enough_data;
    4. Wilson lower bound of the agreement below ``min_agreement`` → agreement_too_low;
    5. else MiTA, faster_and_agreeing."""
    if mita.median_ms is None or dense.median_ms is None or any(
            not v.from_warm_start and v.count < policy.min_latency_samples
            for v in (mita, dense)):
        return "dense", NOT_ENOUGH_DATA
    most = 1 - policy.margin
    ratio, bound = latency_ratio(mita, dense)
    point_faster = ratio is not None and ratio <= most
    if mita.from_warm_start or dense.from_warm_start:
        faster = point_faster
    else:
        faster = bound is not None and bound <= most
        if not faster and point_faster and not (mita.full and dense.full):
            return "dense", NOT_ENOUGH_DATA
    if not faster:
        return "dense", SLOWER
    if pairs < policy.min_pairs:
        return "dense", NOT_ENOUGH_DATA
    if wilson_lower(agree, pairs, policy.confidence_z) < policy.min_agreement:
        return "dense", AGREEMENT_TOO_LOW
    return "mita", FASTER_AND_AGREEING


@dataclass
class Evidence:
    """One bucket's recent evidence: forward times (ms) per variant, shadow pairs (labels
    agree, KL nats), and a prior from a warm start, which stands in for each until the live
    evidence is enough on its own (``min_latency_samples`` forwards of that variant,
    ``min_pairs`` pairs): one live forward must not throw a 1,000-pair prior away."""

    forwards: dict[str, deque]
    pairs: deque
    prior: dict | None = None

    def latency(self, policy: AutoPolicy) -> dict[str, Latency]:
        """Per variant its ``Latency``: the prior's median (no interval) while the live
        forwards are fewer than ``min_latency_samples``, else the live ones'."""
        out = {}
        for v, d in self.forwards.items():
            if self.prior is not None and len(d) < policy.min_latency_samples:
                out[v] = Latency(self.prior["latency_ms"][v], None,
                                 self.prior["latency_samples"][v], from_warm_start=True)
            else:
                out[v] = Latency.of(d, policy.confidence_z, policy.window)
        return out

    def agreement(self, policy: AutoPolicy) -> tuple[float, float, float | None, bool]:
        """(agreeing pairs, pairs, mean KL or None, from the prior)."""
        if self.prior is not None and len(self.pairs) < policy.min_pairs:
            p = self.prior
            return p["agree"], p["pairs"], p["kl_mean"], True
        agree = sum(1 for a, _ in self.pairs if a)
        kl = float(np.mean([k for _, k in self.pairs])) if self.pairs else None
        return float(agree), float(len(self.pairs)), kl, False


class RoutingTable:
    """The ``auto`` policy's evidence and decisions, per N bucket, in one gateway replica.
    Thread-safe (the recorder may feed it from Serve's threads)."""

    def __init__(self, policy: AutoPolicy | None = None):
        self.policy = policy or AutoPolicy()
        self._lock = threading.Lock()
        self.warm_start: dict | None = None  # what the warm start loaded, or why it did not
        self._buckets: dict[str, Evidence] = {}
        self.configure(self.policy)

    def configure(self, policy: AutoPolicy, mita_setting: str | None = None) -> None:
        """Apply ``policy`` (live): the evidence kept is trimmed or extended to its
        ``window``, and its ``warm_start`` file (``python -m profiler advise``'s
        ``advise.json``) is read for the served MiTA setting ``mita_setting`` (e.g.
        ``"m16 k16 s1 paper"``) when it names a new file. A file that cannot be used leaves
        the buckets without a prior and says why in ``warm_start``."""
        with self._lock:
            old = self._buckets
            self._buckets = {b: Evidence(
                {v: deque(old[b].forwards[v] if b in old else (), maxlen=policy.window)
                 for v in VARIANTS},
                deque(old[b].pairs if b in old else (), maxlen=policy.window),
                old[b].prior if b in old else None) for b in N_BUCKETS}
            file = policy.warm_start
            if file != (self.warm_start or {}).get("file"):
                for e in self._buckets.values():
                    e.prior = None
                self.warm_start = None
                if file is not None:
                    self.warm_start = {"file": file}
                    try:
                        priors = warm_start_priors(file, mita_setting)
                    except (OSError, ValueError) as e:
                        self.warm_start["error"] = f"{type(e).__name__}: {e}"[:300]
                        log.warning("policy auto: warm start %s not used: %s", file,
                                    self.warm_start["error"])
                    else:
                        for b, prior in priors.items():
                            self._buckets[b].prior = prior
                        self.warm_start["buckets"] = sorted(priors, key=N_BUCKETS.index)
            self.policy = policy

    def add_forward(self, variant: str, n: int, total_ms: float) -> None:
        """A forward of ``variant`` that served a request of ``n`` tokens in ``total_ms``."""
        with self._lock:
            self._buckets[n_bucket(n)].forwards[variant].append(float(total_ms))

    def add_pair(self, n: int, agree: bool, kl: float) -> None:
        """A shadow comparison of a request of ``n`` tokens: labels ``agree``, KL nats."""
        with self._lock:
            self._buckets[n_bucket(n)].pairs.append((bool(agree), float(kl)))

    def decide(self, n: int) -> tuple[str, str, float]:
        """(variant, reason, exploration fraction) for a request of ``n`` tokens: the
        fraction of such requests to shadow to the other variant (``explore_unsettled``
        while the bucket lacks data, else ``explore``)."""
        with self._lock:
            row = self._row(n_bucket(n))
        explore = (self.policy.explore_unsettled if row["reason"] == NOT_ENOUGH_DATA
                   else self.policy.explore)
        return row["variant"], row["reason"], explore

    def _row(self, bucket: str) -> dict:
        e, policy = self._buckets[bucket], self.policy
        lat = e.latency(policy)
        agree, pairs, kl, prior_pairs = e.agreement(policy)
        mita, dense = lat["mita"], lat["dense"]
        variant, reason = decide_bucket(mita, dense, agree, pairs, policy)
        ratio, bound = latency_ratio(mita, dense)
        return {"n_bucket": bucket, "variant": variant, "reason": reason,
                "mita_p50_ms": mita.median_ms, "dense_p50_ms": dense.median_ms,
                "mita_p50_interval_ms": mita.interval_ms,
                "dense_p50_interval_ms": dense.interval_ms,
                "mita_forwards": mita.count, "dense_forwards": dense.count,
                "latency_ratio": ratio, "latency_ratio_upper_bound": bound,
                "confidence": confidence(policy.confidence_z),
                "pairs": int(pairs), "agreement": agree / pairs if pairs else None,
                "agreement_lower_bound": wilson_lower(agree, pairs, policy.confidence_z),
                "kl_mean": kl, "from_warm_start": (mita.from_warm_start
                                                   or dense.from_warm_start or prior_pairs)}

    def table(self) -> list[dict]:
        """Every bucket's row: the decision, its reason and the evidence behind it."""
        with self._lock:
            return [self._row(b) for b in N_BUCKETS]

    def report(self, policy: str) -> dict:
        """``GET /v1/routing``'s body (``schemas.RoutingResponse``): the gateway's ``policy``
        in force, the auto thresholds, the warm start and every bucket's row."""
        return {"policy": policy, "auto": self.policy.model_dump(mode="json"),
                "warm_start": self.warm_start, "buckets": self.table()}


def check_warm_start(config, mita_setting: str | None) -> None:
    """Refuse (ValueError) a ``GatewayConfig`` whose ``auto.warm_start`` file cannot be used
    for the served MiTA setting (``warm_start_priors`` fails): ``python -m service --check``,
    its start and every live update refuse it, rather than a replica serving without the
    prior and only logging why."""
    file = config.auto.warm_start
    if file is None:
        return
    try:
        warm_start_priors(file, mita_setting)
    except (OSError, ValueError) as e:
        raise ValueError(f"auto.warm_start {file!r} cannot be used: {type(e).__name__}: "
                         f"{e}"[:600]) from None


def warm_start_priors(file: str, mita_setting: str | None) -> dict[str, dict]:
    """``advisor_priors`` of policy auto's ``warm_start`` file, a relative path taken from the
    project root (as the checkpoint's). Raises as ``advisor_priors``."""
    path = Path(file)
    return advisor_priors(path if path.is_absolute() else PROJECT_ROOT / path, mita_setting)


def advisor_priors(path: Path, mita_setting: str | None) -> dict[str, dict]:
    """Per N bucket, the prior evidence in an advisor report (``python -m profiler advise``'s
    ``advise.json``): the dense row's and the served MiTA setting's (``mita_setting``, as the
    report names settings, e.g. ``"m16 k16 s1 paper"``) median forward times per measured N,
    and that setting's agreement with dense over the report's sequences. The largest N measured
    in a bucket stands for it. Raises OSError (unreadable), ValueError (not JSON, no row for
    the setting, a number out of its range: a time not finite and > 0, an agreement outside
    [0, 1], a KL not finite and ≥ 0, a count not an integer ≥ 1, an N outside [1, 2^20]; not
    an advisor report: not UTF-8 text, not JSON, not its shape)."""
    try:
        report = json.loads(path.read_text())
    except UnicodeDecodeError:
        raise ValueError("not an advisor report: not a UTF-8 text file") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"not an advisor report: not JSON ({e})") from None
    try:
        return _priors(report, mita_setting)
    except (KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"not an advisor report (advise.json of python -m profiler advise): "
                         f"{type(e).__name__} {e}") from None


def _priors(report: dict, mita_setting: str | None) -> dict[str, dict]:
    rows = {r["setting"]: r for r in report["rows"]}
    if mita_setting not in rows:
        raise ValueError(f"no row for the served setting {mita_setting!r} (the report has "
                         f"{sorted(s for s in rows if s != 'dense')})")
    mita, dense = rows[mita_setting], rows["dense"]
    sequences = _count(report["config"]["sequences"], "config.sequences")
    repeats = _count(report["config"]["repeats"], "config.repeats")
    agreement = _number(mita["agreement"], f"{mita_setting} agreement", 0.0, 1.0)
    kl = _number(mita["kl"], f"{mita_setting} kl", 0.0)
    priors: dict[str, dict] = {}
    for n in sorted(_count(k, "a latency key (N)", 2**20) for k in mita["latency"]):
        if str(n) not in dense["latency"]:
            continue
        ms = {v: _number(row["latency"][str(n)]["p50_ms"], f"{name} p50_ms at N = {n}", 0.0,
                         positive=True) for v, name, row in (("mita", mita_setting, mita),
                                                              ("dense", "dense", dense))}
        priors[n_bucket(n)] = {
            "latency_ms": ms, "latency_samples": {"mita": repeats, "dense": repeats},
            "agree": agreement * sequences, "pairs": float(sequences), "kl_mean": kl, "n": n}
    return priors


def _number(x, what: str, lo: float, hi: float = math.inf, positive: bool = False) -> float:
    """``x`` as a finite float in [lo, hi] (> lo with ``positive``); ValueError naming
    ``what`` otherwise, also for a bool or a string."""
    if isinstance(x, bool) or not isinstance(x, int | float):
        raise ValueError(f"{what} must be a number, got {x!r}")
    v = float(x)
    if not math.isfinite(v) or v < lo or v > hi or (positive and v <= lo):
        raise ValueError(f"{what} = {x!r} is out of range ({'>' if positive else '≥'} {lo}"
                         f"{'' if hi == math.inf else f', ≤ {hi}'}, finite)")
    return v


def _count(x, what: str, most: int = 10**9) -> int:
    """``x`` (an int, or a string of one: JSON object keys) as an int in [1, most]."""
    if isinstance(x, str) and x.isdigit():
        x = int(x)
    if isinstance(x, bool) or not isinstance(x, int) or not 1 <= x <= most:
        raise ValueError(f"{what} must be an integer in [1, {most}], got {x!r}")
    return x
