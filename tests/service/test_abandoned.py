"""Work whose caller has gone is not started: the engine asks before each forward
(``ClassifierEngine.run(abandoned=...)``), and a batch whose HTTP client left stops after the
forward that was running. A forward that is running stops before its next block, or its next
query chunk of a long dense sequence on the CPU (``mita.hooks.cancellable``)."""

from __future__ import annotations

import copy
import time

import httpx
import numpy as np
import pytest

from mita.data.listops import generate_long


def set_dense_user_config(service, **changes) -> None:
    """Redeploy the session's service with DenseClassifier's user_config changed (applied by
    ``reconfigure``, no restart); no changes: back to the session's config."""
    from service import launch

    overrides = copy.deepcopy(service.overrides)
    shipped = launch.load_config(launch.CPU_CONFIG).applications[0].deployments
    dense = overrides["deployments"]["DenseClassifier"]
    dense["user_config"] = {**next(d for d in shipped if d.name == "DenseClassifier").user_config,
                            **dense.get("user_config", {}), **changes}
    launch.deploy(launch.load_config(launch.CPU_CONFIG, overrides))


def test_a_batch_whose_client_left_stops_after_the_running_forward(service):
    """8 dense sequences in one batch request, gathered into one ``@serve.batch`` call; the
    client leaves after 1 s. The next request waits at most for the forward that was running,
    not for the other 7."""
    text, _ = generate_long(8192, seed=5)
    solo = service.post("/v1/classify", json={"text": text, "variant": "dense", "profile": True})
    assert solo.status_code == 200, solo.text
    forward_s = solo.json()["profile"]["total_ms"] / 1000
    body = {"items": [{"text": text, "variant": "dense"}] * 8}
    set_dense_user_config(service, batch_wait_timeout_s=0.25)  # all 8 in one batch
    try:
        with httpx.Client(base_url=service.url) as client, pytest.raises(httpx.ReadTimeout):
            client.post("/v1/classify/batch", json=body, timeout=httpx.Timeout(60, read=1.0))
        left = time.monotonic()
        after = service.post("/v1/classify", json={"text": "[MAX 2 3 ]", "variant": "dense"})
        waited = time.monotonic() - left
    finally:
        set_dense_user_config(service)
    assert after.status_code == 200, after.text
    # Before: the 7 forwards still queued ran first (~7 × forward_s).
    assert waited < 2.5 * forward_s + 1.0, (waited, forward_s)


def test_a_long_dense_forward_past_the_timeout_frees_its_replica(service, serve_reset):
    """max_n raised to 262,144 and request_timeout_s lowered to 4 s: a dense request at
    N = 262,144 on the CPU (its forward: minutes on 2 cores) is answered 504 at the timeout,
    and the dense replica answers the next request within seconds. Before, the forward ran on
    to its end and every dense request behind it timed out too."""
    from ..helpers import set_gateway

    set_gateway(service, max_n=262_144, request_timeout_s=4.0)
    ids = np.random.default_rng(7).integers(1, 10, 262_144).tolist()
    t0 = time.monotonic()
    long = service.post("/v1/classify", json={"ids": ids, "variant": "dense"})
    long_s = time.monotonic() - t0
    t1 = time.monotonic()
    after = service.post("/v1/classify", json={"text": "[MAX 2 3 ]", "variant": "dense"})
    after_s = time.monotonic() - t1
    assert long.status_code == 504, long.text
    assert long_s < 4.0 + 3.0, long_s
    assert after.status_code == 200, after.text
    assert after_s < 3.0, after_s  # one query chunk (~1 s here) at most
