"""The alert rules under promtool's unit tests, and the series they need: every error and
refusal counter exists from start-up, at 0, so its first increase is seen by ``rate()``."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from .helpers import wait_for

ROOT = Path(__file__).resolve().parent.parent
_required = os.environ.get("MITA_SERVE_REQUIRE_PROMETHEUS") == "1"

# What the service can answer, written out here rather than taken from service.metrics: a
# routed request is answered 200, 500, 503 or 504; one refused before routing (variant none)
# 400, 405, 411, 413, 415, 422, or 503 while draining.
REQUEST_SERIES = ({(v, s) for v in ("mita", "dense") for s in ("200", "500", "503", "504")}
                  | {("none", s) for s in ("400", "405", "411", "413", "415", "422", "503")})
REJECTION_SERIES = {(v, r) for v in ("mita", "dense") for r in ("primary", "shadow")}


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


def test_error_series_are_on_metrics_before_their_first_event(service):
    """On the running service's /metrics, every requests_total (variant, status) and
    rejections_total (variant, role) series is there with a value ≥ 0 whether or not the test
    session has produced it; variant none's 503 (only a draining gateway answers it, never in
    this session) is there at exactly 0."""
    def scrape() -> tuple[dict, dict]:
        text = "\n".join(x for x in service.metrics_text().splitlines() if "mita_serve_" in x)
        requests, rejections = {}, {}
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                if s.name == "ray_mita_serve_requests_total":
                    key = (s.labels["variant"], s.labels["status"])
                    requests[key] = requests.get(key, 0.0) + s.value
                elif s.name == "ray_mita_serve_rejections_total":
                    key = (s.labels["variant"], s.labels["role"])
                    rejections[key] = rejections.get(key, 0.0) + s.value
        return requests, rejections

    def missing() -> set:
        requests, rejections = scrape()
        return (REQUEST_SERIES - set(requests)) | (REJECTION_SERIES - set(rejections))
    # Right after start-up the gateway's first export may still be on its way (0.5 s here).
    wait_for(lambda: not missing(), timeout_s=20)
    assert missing() == set()
    requests, rejections = scrape()
    assert requests["none", "503"] == 0
