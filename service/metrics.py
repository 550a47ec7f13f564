"""Every Prometheus metric of the service, declared in one place.

Metrics go through ``ray.serve.metrics`` and are exported on Ray's metrics endpoint with the
prefix ``ray_`` (``mita_serve_stage_duration_seconds`` → ``ray_mita_serve_stage_duration_seconds
_bucket/_count/_sum``). Serve adds the ``deployment``, ``replica`` and ``application`` tags.

Counters are kept in the process (``TotalCounter``) and exported as Ray gauges of their
running totals, under the counter's name (``..._total``), which PromQL reads as it reads a
counter (``rate``, ``increase``). Why: Ray 2.60's metrics agent never drops a dead worker's
counter series — all of a killed Gateway replica's series were still exported 5 minutes later,
one more set per death — while it drops a gauge series two of its export intervals after the
last report. A dead replica's ``_total`` series thus leave ``/metrics`` within
``DEAD_SERIES_S``, and its last counts are lost for at most ``EXPORT_INTERVAL_S`` plus one of
Ray's export intervals (``metrics_report_interval_ms``). Histograms stay Ray's own (their
series of a dead replica stay, frozen, until the node's Ray restarts: ``rate()`` reads them as
0): as gauges, one series per bucket edge, a replica's stage histogram alone reached Ray's
agent's limit of 2,000 attribute sets per metric (OpenTelemetry's default; the agent never
releases a set), and every set past it was folded into one overflow series without labels.

Label values come from small fixed sets: ``variant`` ∈ {mita, dense}, ``stage`` ∈ the
profiler's stage names, ``n_bucket`` ∈ ``N_BUCKETS``, ``status`` ∈ HTTP status codes.
Every counter series the service can produce exists from start-up, at 0 (``start_at_zero``).
Only the gateway records them (``service.recorder.Recorder`` holds the one ``ServiceMetrics``
of a gateway replica): classifier replicas export none, so one scrape target has them all.
"""

from __future__ import annotations

import bisect
import threading
import time

from ray.serve.metrics import Gauge, Histogram

from .settings import MAX_REQUEST_TIMEOUT_S, VARIANTS

# Upper edges of the sequence-length buckets (log-spaced, ×4); label value = the edge.
N_BUCKET_EDGES = (1024, 4096, 16384, 65536, 262144, 1048576)
N_BUCKETS = tuple(f"le_{e}" for e in N_BUCKET_EDGES)


def n_bucket(n: int) -> str:
    """The ``n_bucket`` label of a sequence of length n: the first bucket whose edge is at least
    n (``le_1024`` … ``le_1048576``; longer sequences in the last)."""
    return N_BUCKETS[min(bisect.bisect_left(N_BUCKET_EDGES, n), len(N_BUCKETS) - 1)]


def _one_two_five(lo_exp: int, hi: float) -> list[float]:
    out = []
    e = lo_exp
    while True:
        for m in (1, 2, 5):
            v = round(m * 10.0 ** e, 12)
            if v >= hi:  # hi on the 1-2-5 grid: listed once, not twice
                return out + [hi]
            out.append(v)
        e += 1


# 10 µs … MAX_REQUEST_TIMEOUT_S (300 s), three buckets per decade (1-2-5): fine enough for
# sub-millisecond GPU stages, and no duration the service allows (its request timeouts are
# capped there) lands in +Inf, where histogram_quantile cannot place it.
DURATION_BUCKETS_S = _one_two_five(-5, MAX_REQUEST_TIMEOUT_S)
# Ray drops a gauge series that is not set again for a while (~20 s): the service's gauges
# are set again this often.
GAUGE_REFRESH_S = 5.0
# A counter's changed series are exported this often, and every series again each
# GAUGE_REFRESH_S (Ray drops a gauge series no longer reported).
EXPORT_INTERVAL_S = 0.5
# How long a dead replica's series stay on Ray's exporter: its agent keeps a gauge series for
# two of its export intervals (10 s by default) after the last report (measured: 18-20 s).
DEAD_SERIES_S = 30
# KL in nats has no upper bound; past 100 nats the two answers are simply different.
KL_BUCKETS = [0.0001, 0.001, 0.01, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0]

# The ``status`` values of ``requests_total``. A routed request (variant mita or dense) is
# answered 200, 500 (a replica error, non-finite logits), 503 (its replica failed and the
# resends or the time ran out, or its deployment is unavailable) or 504 (timeout):
# ``Gateway._call``. One refused before routing (variant
# "none") gets one of the refusals of ``CheckBody``, routing, parsing and validation, or
# 503 while draining.
ROUTED_STATUSES = (200, 500, 503, 504)
REFUSED_STATUSES = (400, 405, 411, 413, 415, 422, 503)
REJECTION_ROLES = ("primary", "shadow")
SHADOW_DROP_REASONS = ("busy", "failed")  # shadow_dropped_total's reason label
RETRY_REASONS = ("replica_died", "replica_unavailable")  # retries_total's reason label
# routing_decisions_total's (variant, reason) pairs under policy auto (service.routing)
ROUTING_DECISIONS = (("mita", "faster_and_agreeing"), ("dense", "slower"),
                     ("dense", "agreement_too_low"), ("dense", "not_enough_data"))


METRIC_NAMES = {  # ServiceMetrics' attribute → the metric's name, declared once here
    "stage_duration": "mita_serve_stage_duration_seconds",
    "forward_duration": "mita_serve_forward_duration_seconds",
    "request_duration": "mita_serve_request_duration_seconds",
    "requests": "mita_serve_requests_total",
    "rejections": "mita_serve_rejections_total",
    "retries": "mita_serve_retries_total",
    "tokens": "mita_serve_tokens_total",
    "flops": "mita_serve_flops_total",
    "peak_memory": "mita_serve_peak_memory_bytes",
    "shadow_comparisons": "mita_serve_shadow_comparisons_total",
    "shadow_dropped": "mita_serve_shadow_dropped_total",
    "shadow_kl": "mita_serve_shadow_kl_divergence",
    "routing_decisions": "mita_serve_routing_decisions_total",
}
EXPORTED_PREFIX = "ray_"  # Ray's metrics agent prefixes every application metric


def exported(metric: str) -> str:
    """The name Prometheus scrapes for ``ServiceMetrics.<metric>``: Ray's prefix + the declared
    name (the stats window's PromQL queries use it). Raises KeyError for an unknown metric."""
    return EXPORTED_PREFIX + METRIC_NAMES[metric]


class TotalCounter:
    """A counter (``inc``) kept in this process and exported as a Ray gauge of its running total
    per tag set, named as the counter (``..._total``), by one daemon thread for all of them:
    the changed series every ``EXPORT_INTERVAL_S``, every series each ``GAUGE_REFRESH_S``."""

    _all: list[TotalCounter] = []
    _lock = threading.Lock()
    _thread: threading.Thread | None = None

    def __init__(self, name: str, description: str, tag_keys: tuple[str, ...] = ()):
        self._gauge = Gauge(name, description=description + " (a running total)",
                            tag_keys=tag_keys)
        self._totals: dict[tuple, float] = {}
        self._dirty: set[tuple] = set()
        with TotalCounter._lock:
            TotalCounter._all.append(self)
            if TotalCounter._thread is None:
                TotalCounter._thread = threading.Thread(target=TotalCounter._run, daemon=True,
                                                        name="metrics-export")
                TotalCounter._thread.start()

    @staticmethod
    def _run() -> None:
        last_all = time.monotonic()
        while True:
            time.sleep(EXPORT_INTERVAL_S)
            every = time.monotonic() - last_all >= GAUGE_REFRESH_S
            if every:
                last_all = time.monotonic()
            for counter in list(TotalCounter._all):
                counter.export(every)

    def export(self, every: bool = False) -> None:
        """Set the gauge of each series changed since the last export (``every``: of all)."""
        with TotalCounter._lock:
            keys = self._totals if every else self._dirty
            values = [(self._totals[key], key) for key in keys]
            self._dirty.clear()
        for total, key in values:
            self._gauge.set(total, dict(key))

    def inc(self, value: float = 1.0, tags: dict[str, str] | None = None) -> None:
        """Add ``value`` (> 0) to the series of ``tags``. Raises ValueError for value ≤ 0."""
        if value <= 0:
            raise ValueError(f"a counter only grows: inc({value})")
        self._add(value, tags)

    def _record(self, value: float, tags: dict[str, str] | None = None) -> None:
        """The series of ``tags`` plus ``value`` (0 too: ``start_at_zero``), exported now."""
        self._gauge.set(self._add(value, tags), dict(tags or {}))

    def _add(self, value: float, tags: dict[str, str] | None) -> float:
        key = tuple(sorted((tags or {}).items()))
        with TotalCounter._lock:
            total = self._totals[key] = self._totals.get(key, 0.0) + float(value)
            self._dirty.add(key)
        return total


class ServiceMetrics:
    """The service's metrics, recorded by the gateway's ``Recorder``: requests, durations and
    shadow comparisons, and — from the profile each classifier answer carries — stages,
    forwards, tokens, FLOPs and peak memory."""

    def __init__(self):
        self.stage_duration = Histogram(
            METRIC_NAMES["stage_duration"],
            description="Time of one model stage for one request (summed over layers).",
            boundaries=DURATION_BUCKETS_S, tag_keys=("variant", "stage", "n_bucket"))
        self.forward_duration = Histogram(
            METRIC_NAMES["forward_duration"],
            description="End-to-end model forward time for one request's batch.",
            boundaries=DURATION_BUCKETS_S, tag_keys=("variant", "n_bucket"))
        self.request_duration = Histogram(
            METRIC_NAMES["request_duration"],
            description="Gateway time from request received to response ready.",
            boundaries=DURATION_BUCKETS_S, tag_keys=("variant", "n_bucket"))
        self.requests = TotalCounter(
            METRIC_NAMES["requests"],
            description="Classification requests answered, by variant and HTTP status "
                        "(overload refusals are not here: see rejections_total).",
            tag_keys=("variant", "status"))
        self.rejections = TotalCounter(
            METRIC_NAMES["rejections"],
            description="Requests refused by a classifier's back-pressure "
                        "(max_queued_requests) and answered 503 + Retry-After; role=shadow "
                        "when only the shadow call was refused (the primary answered).",
            tag_keys=("variant", "role"))
        self.retries = TotalCounter(
            METRIC_NAMES["retries"],
            description="Primary classifications sent again by the gateway within their "
                        "deadline after their classifier replica failed mid-request: "
                        "reason=replica_died (the actor died) or replica_unavailable (it "
                        "became unreachable); shadow calls are never resent.",
            tag_keys=("variant", "reason"))
        self.tokens = TotalCounter(
            METRIC_NAMES["tokens"],
            description="Tokens of the forwards whose answers reached the gateway.",
            tag_keys=("variant",))
        self.flops = TotalCounter(
            METRIC_NAMES["flops"],
            description="Analytic FLOPs of the forwards whose answers reached the gateway: "
                        "each request's share (forward FLOPs of the padded batch / requests "
                        "in it).",
            tag_keys=("variant",))
        self.peak_memory = Gauge(
            METRIC_NAMES["peak_memory"],
            description="Peak memory of a classifier replica's last forward (CUDA: measured "
                        "max allocated; CPU: analytic activation estimate, see kind).",
            tag_keys=("variant", "kind", "classifier_replica"))
        self.shadow_comparisons = TotalCounter(
            METRIC_NAMES["shadow_comparisons"],
            description="Shadow-mode comparisons of primary and shadow variant; agree=true "
                        "when the labels match.",
            tag_keys=("primary", "agree"))
        self.shadow_dropped = TotalCounter(
            METRIC_NAMES["shadow_dropped"],
            description="Shadow calls that gave no comparison: reason=busy when shed before "
                        "the call (the variant had shadow_max_inflight shadow calls or primary "
                        "calls in flight), failed when the call got no answer (timeout, "
                        "error). "
                        "Back-pressure refusals of shadow calls are rejections_total"
                        "{role=shadow}.",
            tag_keys=("variant", "reason"))
        self.shadow_kl = Histogram(
            METRIC_NAMES["shadow_kl"],
            description="KL(dense || MiTA) of the class probabilities of a shadow comparison, "
                        "in nats, whichever variant is primary.",
            boundaries=KL_BUCKETS, tag_keys=("primary",))
        self.routing_decisions = TotalCounter(
            METRIC_NAMES["routing_decisions"],
            description="Requests routed by policy auto, by N bucket, the variant chosen and "
                        "why: faster_and_agreeing (mita), slower, agreement_too_low, "
                        "not_enough_data (dense).",
            tag_keys=("n_bucket", "variant", "reason"))
        self.start_at_zero()

    def start_at_zero(self) -> None:
        """Export every counter series the service can produce, at 0. A series that first
        appears with its first event has no earlier sample, so ``rate()``/``increase()`` see
        no increase for that event: a burst of errors inside one scrape interval would never
        fire ``MitaServeHighErrorRate``. ``Counter.inc`` refuses 0, so the zero is recorded
        with ``_record``, which ``inc`` calls (Serve's replica tags are the default tags)."""
        zero = [(self.requests, {"variant": v, "status": str(s)})
                for v in VARIANTS for s in ROUTED_STATUSES]
        zero += [(self.requests, {"variant": "none", "status": str(s)})
                 for s in REFUSED_STATUSES]
        zero += [(self.rejections, {"variant": v, "role": r})
                 for v in VARIANTS for r in REJECTION_ROLES]
        zero += [(self.retries, {"variant": v, "reason": r})
                 for v in VARIANTS for r in RETRY_REASONS]
        zero += [(c, {"variant": v}) for c in (self.tokens, self.flops) for v in VARIANTS]
        zero += [(self.shadow_comparisons, {"primary": v, "agree": a})
                 for v in VARIANTS for a in ("true", "false")]
        zero += [(self.shadow_dropped, {"variant": v, "reason": r})
                 for v in VARIANTS for r in SHADOW_DROP_REASONS]
        zero += [(self.routing_decisions, {"n_bucket": b, "variant": v, "reason": r})
                 for b in N_BUCKETS for v, r in ROUTING_DECISIONS]
        for counter, tags in zero:
            counter._record(0, tags)


def config_updates() -> TotalCounter:
    """``mita_serve_config_updates_total``: the live ``user_config`` updates a gateway replica
    applied or refused (``outcome``; Serve adds the ``deployment`` and ``replica`` tags). A
    refused update left the replica on its old config."""
    counter = TotalCounter("mita_serve_config_updates_total",
                      description="Live user_config updates applied or refused by a gateway "
                                  "replica (outcome); a refused one leaves the replica on its "
                                  "old config.",
                      tag_keys=("outcome",))
    for outcome in ("applied", "refused"):  # from start-up, as ServiceMetrics.start_at_zero
        counter._record(0, {"outcome": outcome})
    return counter


def config_refused_gauge() -> Gauge:
    """``mita_serve_config_refused``: 1 while a gateway replica's last live ``user_config``
    update was refused (it serves its last applied config), else 0."""
    return Gauge("mita_serve_config_refused",
                 description="1 while the gateway replica's last live user_config update was "
                             "refused (it serves the last applied config), else 0.")


def classifier_config_refused_gauge() -> Gauge:
    """``mita_serve_classifier_config_refused``: per ``variant``, 1 while the classifier replica
    the gateway last asked (``service.replicas.watch_classifier_configs``) serves its last
    applied ``user_config`` because it refused the live update after it, else 0."""
    gauge = Gauge("mita_serve_classifier_config_refused",
                  description="Per variant, 1 while the classifier replica last asked by the "
                              "gateway refused its latest live user_config update (it serves "
                              "the last applied config), else 0.",
                  tag_keys=("variant",))
    for variant in VARIANTS:  # 0 from start-up, so the alert's absence means no refusal
        gauge.set(0.0, {"variant": variant})
    return gauge
