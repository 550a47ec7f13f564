"""The session's service binds its HTTP and metrics ports to loopback only and starts no Ray
dashboard."""

from __future__ import annotations

import os

import psutil
import pytest

from ..processes import listening

# sharing: answers, counts and refusals, nothing timed: runs beside the tests/own_ray/
# tests instead of waiting for the cores lock (tests/lanes.py)
pytestmark = pytest.mark.sharing


def test_http_and_metrics_bind_to_loopback_no_dashboard(service):
    http_port = int(service.url.rsplit(":", 1)[1])
    metrics_port = int(service.metrics_url.split(":")[2].split("/")[0])
    assert listening(http_port) == {"127.0.0.1"}
    assert listening(metrics_port) == {"127.0.0.1"}
    # Ray's dashboard port: not started by default. This process's Ray is its children (the
    # README walkthrough's `make serve`, in another test worker, may hold 8265 meanwhile).
    ours = {os.getpid(), *(p.pid for p in psutil.Process().children(recursive=True))}
    assert len(ours) > 3 and listening(metrics_port, ours) == {"127.0.0.1"}
    assert listening(8265, ours) == set()
