"""Work whose caller has gone is not started: the engine asks before each forward
(``ClassifierEngine.run(abandoned=...)``), and a batch whose HTTP client left stops after the
forward that was running. A forward that is running stops before its next block, or its next
query chunk of a long dense sequence on the CPU (``mita.hooks.cancellable``)."""

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


def test_a_running_forward_stops_at_the_next_chunk_once_its_caller_left(engine, monkeypatch):
    """Dense attention in query chunks of 40 rows (DENSE_CHUNK_ELEMENTS lowered to 40 × 300):
    the caller leaves during the third chunk of the first block. The engine stops there, 5
    chunks before the first block's end, and answers it as abandoned."""
    import mita.attention

    monkeypatch.setattr(mita.attention, "DENSE_CHUNK_ELEMENTS", 40 * 300)
    asked = []

    def gone() -> bool:  # asked before the forward, before block 0, before each chunk
        asked.append(1)
        return len(asked) >= 5
    before = engine._forwards
    results = engine.run(sequences(300), True, None, [gone])
    assert len(asked) == 5  # 300 rows = 8 chunks: stopped before the third
    assert engine._forwards - before == 1
    assert results[0]["abandoned"] is True and "label" not in results[0]
    assert results[0]["error"] == "the caller left while this sequence ran"
    assert results[0]["n"] == 300 and results[0]["variant"] == "dense"


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
    from .helpers import set_gateway

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
