"""A forward whose caller left, in the classifier's engine without Ray: it stops at the next chunk,
and the grouped and deterministic runs leave the abandoned sequences out (the service's side:
tests/service/test_abandoned.py)."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from service.engine import ClassifierEngine

from ..helpers import CHECKPOINT


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
