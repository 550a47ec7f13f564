"""Latency-optimal routing: the gateway policy ``auto``.

Per N bucket (``metrics.n_bucket``, the buckets of the latency metrics), the gateway keeps
each variant's recent forward times and, from shadowed requests, whether MiTA's label agreed
with dense's and the KL between their probabilities. A request of that bucket goes to MiTA
when MiTA's median forward is faster than dense's by ``margin`` **and** the lower bound of the
agreement's Wilson score interval reaches ``min_agreement``; otherwise to dense, the
reference. A fraction of ``auto`` requests is also shadowed to the other variant, more while
a bucket has too little evidence, so both latencies and the agreement stay current.

``RoutingTable`` holds the evidence (bounded deques, one gateway replica's own) and answers
``decide``; ``decide_bucket`` is the rule on plain numbers. Ray-free: tested without Serve.
"""

from __future__ import annotations

import json
import logging
import math
import threading
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from . import PROJECT_ROOT
from .metrics import N_BUCKETS, ROUTING_DECISIONS, n_bucket
from .settings import VARIANTS, AutoPolicy

log = logging.getLogger("ray.serve")

# Why a bucket's requests go where they go (the decision counter's ``reason`` label):
# faster_and_agreeing → mita; slower (MiTA not faster than dense by the margin),
# agreement_too_low (its lower bound below min_agreement), not_enough_data (too few forwards
# of a variant, or shadow pairs) → dense
(_, FASTER_AND_AGREEING), (_, SLOWER), (_, AGREEMENT_TOO_LOW), (_, NOT_ENOUGH_DATA) = (
    ROUTING_DECISIONS)


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


def decide_bucket(mita_ms: float | None, dense_ms: float | None, samples: tuple[int, int],
                  agree: float, pairs: float, policy: AutoPolicy) -> tuple[str, str]:
    """(variant, reason) for one bucket: ``mita_ms``/``dense_ms`` the variants' median
    forward times (ms; None without any), ``samples`` how many forwards of (mita, dense) they
    are medians of, ``agree`` of ``pairs`` shadow comparisons with equal labels. Checked in
    this order: too few forwards of either → not_enough_data; MiTA not faster than
    (1 − margin) × dense → slower; too few pairs → not_enough_data; Wilson lower bound below
    min_agreement → agreement_too_low; else MiTA, faster_and_agreeing."""
    if min(samples) < policy.min_latency_samples or mita_ms is None or dense_ms is None:
        return "dense", NOT_ENOUGH_DATA
    if mita_ms > (1 - policy.margin) * dense_ms:
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

    def latency(self, policy: AutoPolicy) -> dict[str, tuple[float | None, int, bool]]:
        """Per variant (median ms or None, forwards counted, from the prior)."""
        out = {}
        for v, d in self.forwards.items():
            if self.prior is not None and len(d) < policy.min_latency_samples:
                out[v] = (self.prior["latency_ms"][v], self.prior["latency_samples"][v], True)
            else:
                out[v] = (float(np.median(d)) if d else None, len(d), False)
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
        e = self._buckets[bucket]
        lat = e.latency(self.policy)
        agree, pairs, kl, prior_pairs = e.agreement(self.policy)
        (mita_ms, mita_n, prior_mita), (dense_ms, dense_n, prior_dense) = (
            lat["mita"], lat["dense"])
        variant, reason = decide_bucket(mita_ms, dense_ms, (mita_n, dense_n), agree, pairs,
                                        self.policy)
        return {"n_bucket": bucket, "variant": variant, "reason": reason,
                "mita_p50_ms": mita_ms, "dense_p50_ms": dense_ms,
                "mita_forwards": mita_n, "dense_forwards": dense_n,
                "pairs": int(pairs), "agreement": agree / pairs if pairs else None,
                "agreement_lower_bound": wilson_lower(agree, pairs,
                                                      self.policy.confidence_z),
                "kl_mean": kl, "from_warm_start": prior_mita or prior_dense or prior_pairs}

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
