"""The service's error series are on /metrics at 0 before their first event, so the alert rules'
expressions answer from start-up (the rules themselves: tests/no_ray/test_alert_rules.py)."""

from __future__ import annotations

import pytest

from ..helpers import REJECTION_SERIES, REQUEST_SERIES, metric_families, wait_for

# sharing: answers, counts and refusals, nothing timed: runs beside the tests/own_ray/
# tests instead of waiting for the cores lock (tests/lanes.py)
pytestmark = pytest.mark.sharing


def test_error_series_are_on_metrics_before_their_first_event(service):
    """On the running service's /metrics, every requests_total (variant, status) and
    rejections_total (variant, role) series is there with a value ≥ 0 whether or not the test
    session has produced it; variant none's 503 (only a draining gateway answers it, never in
    this session) is there at exactly 0."""
    def scrape() -> tuple[dict, dict]:
        requests, rejections = {}, {}
        for fam in metric_families(service.metrics_text(), "mita_serve_"):
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
