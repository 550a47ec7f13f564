"""The processes the service starts reach it on loopback past an environment proxy (HTTP_PROXY
set), on the running service."""

from __future__ import annotations

import os

import pytest

from ..helpers import NO_PROXY_VARIABLES

# sharing: answers, counts and refusals, nothing timed: runs beside the tests/own_ray/
# tests instead of waiting for the cores lock (tests/lanes.py)
pytestmark = pytest.mark.sharing


def test_processes_the_service_started_bypass_proxies_for_loopback(service):
    """A Ray worker of the running service (started by the same raylet as the replicas, with
    its environment) has loopback in NO_PROXY and no_proxy: with a proxy variable set, the
    workers' metric export to the local agent went to the proxy and /metrics lost every
    ray_mita_serve_* and ray_serve_* series."""
    import ray

    @ray.remote(num_cpus=0)
    def environment() -> dict:
        return {name: os.environ.get(name, "") for name in NO_PROXY_VARIABLES}

    seen = ray.get(environment.remote(), timeout=60)
    for name, value in seen.items():
        assert {"127.0.0.1", "localhost", "::1"} <= set(value.split(",")), (name, value)
