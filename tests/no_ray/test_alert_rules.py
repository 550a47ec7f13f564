"""The alert rules under promtool's unit tests, and the series they need: every error and
refusal counter exists from start-up, at 0, so its first increase is seen by ``rate()``."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from ..helpers import REJECTION_SERIES, REQUEST_SERIES

ROOT = Path(__file__).resolve().parents[2]
_required = os.environ.get("MITA_SERVE_REQUIRE_PROMETHEUS") == "1"

# What the service can answer, written out here rather than taken from service.metrics: a
# routed request is answered 200, 500, 503 or 504; one refused before routing (variant none)
# 400, 405, 411, 413, 415, 422, or 503 while draining.


def promtool() -> str:
    binary = shutil.which("promtool")
    if binary is None:
        if _required:
            pytest.fail("promtool is not installed but MITA_SERVE_REQUIRE_PROMETHEUS=1")
        pytest.skip("promtool not installed (.ci/run installs Debian's prometheus package)")
    return binary


def test_alert_rules_pass_promtool_unit_tests():
    """``deploy/prometheus/alerts_test.yml``: a burst of 30 timeouts inside one scrape on a
    series that starts at 0 fires MitaServeHighErrorRate, the same burst on a series that
    starts at its first event does not, a low error rate fires nothing, primary refusals
    above 10 % fire MitaServeOverloaded, a refused live update fires MitaServeConfigRefused."""
    done = subprocess.run([promtool(), "test", "rules", "deploy/prometheus/alerts_test.yml"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "SUCCESS" in done.stdout, done.stdout


def test_service_metrics_record_every_counter_series_at_zero(monkeypatch):
    """Constructing the gateway's metrics records 0 for every (variant, status) of
    requests_total and every (variant, role) of rejections_total: no Ray needed."""
    from ray.util import metrics

    from service.metrics import ServiceMetrics

    calls = []
    monkeypatch.setattr(metrics.Metric, "_record",
                        lambda self, value, tags=None: calls.append((self._name, value, tags)))
    ServiceMetrics()
    zeros = {(name, tuple(sorted(tags.items()))) for name, value, tags in calls if value == 0}
    assert {("mita_serve_requests_total", (("status", s), ("variant", v)))
            for v, s in REQUEST_SERIES} <= zeros
    assert {("mita_serve_rejections_total", (("role", r), ("variant", v)))
            for v, r in REJECTION_SERIES} <= zeros
    assert {("mita_serve_retries_total", (("reason", r), ("variant", v)))
            for v in ("mita", "dense") for r in ("replica_died", "replica_unavailable")} <= zeros
    assert all(value == 0 for _, value, _ in calls)  # nothing but the zeros


