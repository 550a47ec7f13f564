"""The service's one recorder (vLLM's stats/logger pattern): each outcome is recorded once,
here, into both Prometheus (``ServiceMetrics``) and the gateway's ``StatsWindow`` (what
``/v1/stats`` and the dashboard summarise), so the two cannot disagree.

It lives in the gateway replica. The classifier replicas record nothing: every forward's
profile (stage times, FLOPs, peak memory) comes back in the answer, and the gateway records it
with the request it served. All metrics therefore come from the ingress process — one
exporter to scrape however many nodes the classifier replicas run on.
"""

from __future__ import annotations

import math
import threading
import time

from .metrics import ServiceMetrics, n_bucket
from .stats import StatsWindow

GAUGE_REFRESH_S = 5.0


def kl_divergence(p: list[float], q: list[float]) -> float:
    """KL(p || q) in nats; probabilities clamped at 1e-12 so a zero in q stays finite."""
    return float(sum(pi * math.log(max(pi, 1e-12) / max(qi, 1e-12))
                     for pi, qi in zip(p, q, strict=True) if pi > 0))


class Recorder:
    """Records, each to Prometheus and to ``window``:

    - ``request``: a classification request's answer. ``variant`` is ``"none"`` for one
      refused before routing; ``n`` and ``latency_s`` (seconds from arrival) for answered ones.
    - ``rejection``: a back-pressure refusal (503 + Retry-After) by a classifier's queue limit,
      as the primary call or the shadow call; not in ``requests_total``.
    - ``forward``: one request's share of the forward that served it (a primary or shadow
      call): stage times (staged forwards only: a fused forward's stages cover several), the
      forward's time, the request's tokens, the forward's FLOPs divided by the requests it
      served, the forward's peak memory.
    - ``shadow``: a shadow comparison (label agreement, KL(primary ‖ shadow) in nats).
    """

    def __init__(self, window: StatsWindow | None = None):
        self.metrics = ServiceMetrics()
        self.window = window or StatsWindow()
        # Ray drops a gauge series that is not set for a while (~20 s): the last peak memory
        # of each variant is set again every few seconds while the replica lives.
        self._peak: dict[tuple[str, str], int] = {}
        threading.Thread(target=self._keep_gauges, daemon=True,
                         name="peak-memory-gauge").start()

    def request(self, variant: str, status: int, n: int | None = None,
                latency_s: float | None = None) -> None:
        self.metrics.requests.inc(1, {"variant": variant, "status": str(status)})
        if latency_s is not None:
            self.metrics.request_duration.observe(
                latency_s, {"variant": variant, "n_bucket": n_bucket(n)})
        self.window.add_request(variant, status, n, latency_s)

    def rejection(self, variant: str, role: str) -> None:
        self.metrics.rejections.inc(1, {"variant": variant, "role": role})

    def forward(self, variant: str, n: int, profile: dict) -> None:
        m, bucket = self.metrics, n_bucket(n)
        tags = {"variant": variant, "n_bucket": bucket}
        if profile["staged"]:
            for stage, ms in profile["stages_ms"].items():
                m.stage_duration.observe(ms / 1e3, tags | {"stage": stage})
            self.window.add_forward(variant, bucket, profile["stages_ms"])
        m.forward_duration.observe(profile["total_ms"] / 1e3, tags)
        m.tokens.inc(n, {"variant": variant})
        m.flops.inc(profile["flops_total"] / profile["batch_size"], {"variant": variant})
        if profile["peak_memory_bytes"] is not None:
            self._peak[(variant, profile["peak_memory_kind"])] = profile["peak_memory_bytes"]
            self._set_gauges()

    def shadow(self, primary: str, agree: bool, kl: float) -> None:
        self.metrics.shadow_comparisons.inc(1, {"primary": primary, "agree": str(agree).lower()})
        self.metrics.shadow_kl.observe(kl, {"primary": primary})
        self.window.add_shadow(primary, agree)

    def _set_gauges(self) -> None:
        for (variant, kind), value in list(self._peak.items()):
            self.metrics.peak_memory.set(value, {"variant": variant, "kind": kind})

    def _keep_gauges(self, period_s: float = GAUGE_REFRESH_S) -> None:
        while True:
            time.sleep(period_s)
            self._set_gauges()
