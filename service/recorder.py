"""The service's one recorder (vLLM's stats/logger pattern): each outcome is recorded once,
here, into Prometheus (``ServiceMetrics``), the gateway's ``StatsWindow`` (what ``/v1/stats``
and the dashboard summarise) and the ``auto`` policy's ``RoutingTable`` (forward times and
shadow agreement per N bucket), so they cannot disagree.

It lives in the gateway replica. The classifier replicas record nothing: every forward's
profile (stage times, FLOPs, peak memory) comes back in the answer, and the gateway records it
with the request it served. All metrics therefore come from the ingress process — one
exporter to scrape however many nodes the classifier replicas run on.
"""

from __future__ import annotations

import threading
import time

from mita.records import ForwardProfile

from .metrics import GAUGE_REFRESH_S, ServiceMetrics, n_bucket
from .routing import RoutingTable
from .stats import StatsWindow

PEAK_MEMORY_TTL_S = 60.0  # a replica's peak is dropped when it has not answered for this long


class Recorder:
    """Records, each to Prometheus and to ``window``:

    - ``request``: a classification request's answer. ``variant`` is ``"none"`` for one
      refused before routing; ``n`` and ``latency_s`` (seconds from arrival) for answered ones.
    - ``rejection``: a back-pressure refusal (503 + Retry-After) by a classifier's queue limit,
      as the primary call or the shadow call; not in ``requests_total``.
    - ``forward``: one request's share of the forward that served it (a primary or shadow
      call whose answer reached the gateway, a 500 for non-finite logits included): stage
      times (staged forwards only: a fused forward's stages cover several), the forward's
      time, the request's tokens, the forward's FLOPs divided by the requests it served, and
      the forward's peak memory, per classifier replica. A forward whose answer never came
      (504 timeout, replica death) is not seen.
    - ``shadow``: a shadow comparison (label agreement, KL(dense ‖ MiTA) in nats).
    """

    def __init__(self, window: StatsWindow | None = None):
        self.metrics = ServiceMetrics()
        self.window = window if window is not None else StatsWindow()
        self.routing = RoutingTable()
        # Ray drops a gauge series that is not set for a while (~20 s): the last peak memory
        # of each classifier replica is set again every few seconds until that replica has
        # not answered for PEAK_MEMORY_TTL_S. (variant, kind, replica) -> (bytes, monotonic s)
        self._peak: dict[tuple[str, str, str], tuple[int, float]] = {}
        self._lock = threading.Lock()
        threading.Thread(target=self._keep_gauges, daemon=True,
                         name="peak-memory-gauge").start()

    def request(self, variant: str, status: int, n: int | None = None,
                latency_s: float | None = None, override: bool = False) -> None:
        """One classification request's answer: ``status`` (HTTP), ``n`` tokens and
        ``latency_s`` seconds from arrival for an answered one (both None otherwise);
        ``override``: the request named its variant (the A/B policy did not choose it)."""
        self.metrics.requests.inc(1, {"variant": variant, "status": str(status)})
        if latency_s is not None:
            self.metrics.request_duration.observe(
                latency_s, {"variant": variant, "n_bucket": n_bucket(n)})
        self.window.add_request(variant, status, n, latency_s, override)

    def rejection(self, variant: str, role: str) -> None:
        """A back-pressure refusal of ``variant``'s call; ``role``: primary or shadow."""
        self.metrics.rejections.inc(1, {"variant": variant, "role": role})
        if role == "shadow":
            self.window.add_shadow_drop(variant)

    def forward(self, variant: str, n: int, profile: ForwardProfile, replica: str = "") -> None:
        """A request of ``n`` tokens served by a forward of ``variant`` on classifier
        ``replica``; ``profile``: that forward's record, as ``ClassifierEngine.run`` made it.
        Both sinks, Prometheus and the stats window, read this one object."""
        m, bucket = self.metrics, n_bucket(n)
        tags = {"variant": variant, "n_bucket": bucket}
        if profile.staged:
            for stage, ms in profile.stages_ms.items():
                m.stage_duration.observe(ms / 1e3, tags | {"stage": stage})
            self.window.add_forward(variant, bucket, profile.stages_ms)
        m.forward_duration.observe(profile.total_ms / 1e3, tags)
        self.routing.add_forward(variant, n, profile.total_ms)
        m.tokens.inc(n, {"variant": variant})
        m.flops.inc(profile.flops_total / profile.batch_size, {"variant": variant})
        if profile.peak_memory_bytes is not None:
            key = (variant, profile.peak_memory_kind, replica)
            # the gauge is set under the lock, as in _set_gauges: a refresh that read the old
            # value cannot set it after this new one
            with self._lock:
                changed = self._peak.get(key, (None,))[0] != profile.peak_memory_bytes
                self._peak[key] = (profile.peak_memory_bytes, time.monotonic())
                if changed:  # else the gauge holds it, and _keep_gauges sets it again
                    self._set_peak(key, profile.peak_memory_bytes)

    def retry(self, variant: str, reason: str) -> None:
        """A primary classification sent to ``variant`` again after its replica failed
        mid-request: ``reason`` ``replica_died`` or ``replica_unavailable``."""
        self.metrics.retries.inc(1, {"variant": variant, "reason": reason})

    def shadow(self, primary: str, agree: bool, kl: float, n: int | None = None) -> None:
        """A shadow comparison of ``primary``'s answer to a request of ``n`` tokens: labels
        ``agree``, ``kl`` = KL(dense ‖ MiTA) in nats (``mita.quality.kl_divergence``),
        whichever is primary (``n`` None: not counted in the routing table's buckets)."""
        self.metrics.shadow_comparisons.inc(1, {"primary": primary, "agree": str(agree).lower()})
        self.metrics.shadow_kl.observe(kl, {"primary": primary})
        self.window.add_shadow(primary, agree, kl)
        if n is not None:
            self.routing.add_pair(n, agree, kl)

    def routed(self, n: int, variant: str, reason: str) -> None:
        """A request of ``n`` tokens sent to ``variant`` by policy auto, for ``reason``
        (``service.routing``)."""
        self.metrics.routing_decisions.inc(1, {"n_bucket": n_bucket(n), "variant": variant,
                                               "reason": reason})

    def shadow_dropped(self, variant: str, reason: str) -> None:
        """A shadow call to ``variant`` that gave no comparison: ``reason`` ``busy`` (shed
        before the call) or ``failed`` (no answer: timeout, error, replica lost).
        Back-pressure refusals go to ``rejection``."""
        self.metrics.shadow_dropped.inc(1, {"variant": variant, "reason": reason})
        self.window.add_shadow_drop(variant)

    def _set_gauges(self) -> None:
        now = time.monotonic()
        with self._lock:
            for key, (_, at) in list(self._peak.items()):
                if now - at > PEAK_MEMORY_TTL_S:
                    del self._peak[key]
            for key, (value, _) in self._peak.items():
                self._set_peak(key, value)

    def _set_peak(self, key: tuple[str, str, str], value: int) -> None:
        """The peak-memory gauge of ``key`` = (variant, kind, replica); under ``_lock``."""
        variant, kind, replica = key
        self.metrics.peak_memory.set(value, {"variant": variant, "kind": kind,
                                             "classifier_replica": replica})

    def _keep_gauges(self, period_s: float = GAUGE_REFRESH_S) -> None:
        while True:
            time.sleep(period_s)
            self._set_gauges()
