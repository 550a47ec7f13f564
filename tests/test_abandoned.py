"""Work whose caller has gone is not started: the engine asks before each forward
(``ClassifierEngine.run(abandoned=...)``), and a batch whose HTTP client left stops after the
forward that was running."""

from __future__ import annotations

import copy
import threading
import time

import httpx
import numpy as np
import pytest

from mita.data.listops import generate_long
from service.engine import ClassifierEngine

CHECKPOINT = "checkpoints/listops-default"


@pytest.fixture(scope="module")
def engine():
    return ClassifierEngine(CHECKPOINT, "dense", device="cpu")


def sequences(*lengths: int) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    return [rng.integers(1, 10, n) for n in lengths]


def test_deterministic_run_checks_between_sequences(engine, monkeypatch):
    batch = sequences(40, 50, 60)
    gone = [threading.Event() for _ in batch]
    forward = engine.model.forward

    def leave_during_first_forward(*args, **kwargs):
        gone[2].set()  # the caller of the last sequence leaves while the first one runs
        return forward(*args, **kwargs)

    monkeypatch.setattr(engine.model, "forward", leave_during_first_forward)
    before = engine._forwards
    results = engine.run(batch, True, None, [g.is_set for g in gone])
    assert engine._forwards - before == 2
    assert [r.get("abandoned", False) for r in results] == [False, False, True]
    assert "profile" not in results[2] and "label" not in results[2]
    assert results[2]["n"] == 60 and results[2]["error"]
    monkeypatch.undo()
    alone = engine.run(batch[:2])
    assert [r["probabilities"] for r in results[:2]] == [r["probabilities"] for r in alone]


def test_grouped_run_leaves_abandoned_sequences_out_of_their_group(engine):
    batch = sequences(40, 41, 42, 300)
    before = engine._forwards
    results = engine.run(batch, False, None,
                         [lambda: False, lambda: True, lambda: False, lambda: True])
    assert engine._forwards - before == 1  # the 300-token group had only an abandoned sequence
    assert [r.get("abandoned", False) for r in results] == [False, True, False, True]
    assert results[0]["profile"].batch_size == 2 and results[0]["profile"].padded_n == 42


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
