"""``mita.kernels.choose``: the Triton launcher's top-k path, chosen per shape, and how the
engine reports it. Fake paths (plain Python, each returning the exact indices) and an injected
timer stand in for the kernels and CUDA events, so the choice itself is checked on the CPU
without Triton; the real kernels' equality with the PyTorch stages is test_kernels.py's.

Expected indices come from float64 scores of small-integer inputs (every score exact, many
ties) ranked by a stable descending sort, so ties go to the lowest key index — computed here,
not by the code under test — and then sorted ascending (eq. 7's contract).
"""

from __future__ import annotations

import logging
import math
from typing import get_args

import numpy as np
import pytest
import torch

from mita import layers
from mita.data.listops import ListOpsConfig, encode, generate
from mita.kernels import choose
from mita.stages import pool
from service.engine import ClassifierEngine
from service.schemas import TopkPath, TopkReport

from ..helpers import CHECKPOINT

# 1/√d for d = 16: a power of two, so the scaled float32 scores of small integers stay exact
SCALE = 16 ** -0.5
# The injected timer's seconds per call of each fake path: bitonic fastest.
SECONDS = {"select": 3e-3, "bitonic": 1e-3, "torch": 2e-3}


def inputs(N, B=2, H=2, m=3, d=16, seed=0, masked=False):
    """Small-integer landmarks (B, H, m, d) and keys (B, H, N, d), float32 (exact), and an
    optional (B, N) padding mask (the last N // 4 keys of row 0)."""
    g = torch.Generator().manual_seed(seed)
    landmarks = torch.randint(-2, 3, (B, H, m, d), generator=g).float()
    k = torch.randint(-2, 3, (B, H, N, d), generator=g).float()
    mask = None
    if masked:
        mask = torch.zeros(B, N, dtype=torch.bool)
        mask[0, N - N // 4:] = True
    return landmarks, k, mask


def expected(landmarks, k, topk, mask=None):
    """Each landmark's topk best keys by q̃·k/√d in float64, lowest index on ties, ascending."""
    scores = landmarks.double() @ k.double().transpose(-1, -2) * k.shape[-1] ** -0.5
    if mask is not None:
        scores = scores.masked_fill(mask[:, None, None, :], float("-inf"))
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices
    return order[..., :topk].sort(-1).values


def fakes(calls, fail=()):
    """Fake paths in the default order: each appends its name to ``calls`` and returns the
    expected indices, or raises as a failing kernel would when its name is in ``fail``."""
    errors = {"select": ImportError("no module named 'mita.kernels.topk'"),
              "bitonic": ValueError("landmark_topk needs 1 ≤ k ≤ min(N, 512)"),
              "torch": RuntimeError("out of memory")}

    def make(name):
        def path(landmarks, k, topk, scale, key_padding_mask=None, key_valid=None):
            calls.append(name)
            if name in fail:
                raise errors[name]
            return expected(landmarks, k, topk, key_padding_mask)
        return path
    return {name: make(name) for name in choose.PATHS}


class Timer:
    """``timer(fn)``: runs fn once (the path it calls names itself in ``calls``) and answers
    SECONDS for that path; ``timed`` counts the calls."""

    def __init__(self, calls):
        self.calls, self.timed = calls, 0

    def __call__(self, fn):
        self.timed += 1
        fn()
        return SECONDS[self.calls[-1]]


def test_path_names_agree():
    assert choose.PATHS == get_args(TopkPath) == tuple(choose.CANDIDATES)


def test_bucket_key():
    lm, k, _ = inputs(65)
    assert choose.topk_key(lm, k, 5) == ("float32", 16, 3, 5, 128)
    assert choose.topk_key(lm, k[:, :, :64], 5).n_bucket == 64
    assert choose.topk_key(lm, k[:, :, :1], 1).n_bucket == 1


def test_fastest_is_chosen_and_cached_per_key(caplog):
    calls = []
    timer = Timer(calls)
    chooser = choose.TopkChooser(fakes(calls), timer=timer)
    lm, k, mask = inputs(40, masked=True)
    with caplog.at_level(logging.INFO, logger=choose.__name__):
        out = chooser(lm, k, 6, SCALE, mask)
    assert torch.equal(out, expected(lm, k, 6, mask)) and out.dtype == torch.int64
    assert timer.timed == 3 and chooser.take_served() == "bitonic"
    assert chooser.take_served() is None  # taken
    [line] = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert line == ("top-k path for float32 d=16 m=3 k=6 N≤64: bitonic "
                    "(select 3 ms, bitonic 1 ms, torch 2 ms)")
    [decision] = chooser.report()["decisions"]
    # seconds × 1e3 in float64: one rounding, 1e-12 relative
    assert decision["timings_ms"] == pytest.approx({"select": 3.0, "bitonic": 1.0,
                                                    "torch": 2.0}, rel=1e-12)
    assert {x: decision[x] for x in ("dtype", "d", "m", "k", "n_bucket", "path", "basis",
                                     "dropped")} == {
        "dtype": "float32", "d": 16, "m": 3, "k": 6, "n_bucket": 64, "path": "bitonic",
        "basis": "timed", "dropped": []}
    calls.clear()
    lm2, k2, _ = inputs(50, seed=1)  # N = 50: the same bucket (64)
    assert torch.equal(chooser(lm2, k2, 6, SCALE), expected(lm2, k2, 6))
    assert timer.timed == 3 and calls == ["bitonic"]
    lm3, k3, _ = inputs(70, seed=2)  # N = 70: bucket 128, timed again
    assert torch.equal(chooser(lm3, k3, 6, SCALE), expected(lm3, k3, 6))
    assert timer.timed == 6 and len(chooser.report()["decisions"]) == 2


def test_a_failing_path_is_dropped_with_one_warning(caplog):
    calls = []
    timer = Timer(calls)
    chooser = choose.TopkChooser(fakes(calls, fail={"bitonic"}), timer=timer)
    with caplog.at_level(logging.WARNING, logger=choose.__name__):
        for N in (40, 70, 40):  # two keys, the first seen again
            lm, k, _ = inputs(N, seed=N)
            assert torch.equal(chooser(lm, k, 4, SCALE), expected(lm, k, 4))
            assert chooser.take_served() == "torch"  # 2 ms beats select's 3 ms
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "'bitonic' failed" in warnings[0]
    assert "ValueError" in warnings[0]
    assert [d["dropped"] for d in chooser.report()["decisions"]] == [["bitonic"]] * 2
    # each new key times all three (bitonic fails again there, with no second warning)
    assert timer.timed == 2 * 3


@pytest.mark.parametrize("timed", [True, False])
def test_all_triton_paths_failing_leave_torch(timed):
    calls = []
    chooser = choose.TopkChooser(fakes(calls, fail={"select", "bitonic"}),
                                 timer=Timer(calls) if timed else None)
    lm, k, mask = inputs(33, masked=True)
    assert torch.equal(chooser(lm, k, 7, SCALE, mask), expected(lm, k, 7, mask))
    [decision] = chooser.report()["decisions"]
    assert (decision["path"], decision["dropped"]) == ("torch", ["select", "bitonic"])
    assert decision["basis"] == ("timed" if timed else "fixed_order")
    calls.clear()
    chooser(lm, k, 7, SCALE, mask)
    assert calls == ["torch"]  # the dropped paths are not tried again for this key


def test_fixed_order_without_a_timer_and_every_path_failing():
    calls = []
    chooser = choose.TopkChooser(fakes(calls))  # CPU tensors, no timer: no timing
    lm, k, _ = inputs(20)
    assert torch.equal(chooser(lm, k, 3, SCALE), expected(lm, k, 3))
    assert calls == ["select"] and chooser.report()["decisions"][0]["timings_ms"] is None
    broken = choose.TopkChooser(fakes([], fail=set(choose.PATHS)))
    with pytest.raises(RuntimeError, match="out of memory"):  # torch's own error
        broken(lm, k, 3, SCALE)


def test_capture_never_times(monkeypatch):
    calls = []
    timer = Timer(calls)
    chooser = choose.TopkChooser(fakes(calls), timer=timer)
    lm, k, _ = inputs(24)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert torch.equal(chooser(lm, k, 5, SCALE), expected(lm, k, 5))
    assert timer.timed == 0 and calls == ["select"]  # the first that works, in order
    assert chooser.report()["decisions"] == []  # not timed: not kept
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    chooser(lm, k, 5, SCALE)
    assert timer.timed == 3 and chooser.take_served() == "bitonic"
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    calls.clear()
    chooser(lm, k, 5, SCALE)
    assert timer.timed == 3 and calls == ["bitonic"]  # the cached choice


def test_a_failure_under_capture_drops_nothing(monkeypatch, caplog):
    """Inside a CUDA-graph capture a failing path is raised at once — the capture is void, so
    no other path is tried inside it and nothing is dropped — and the torch path, whose tie
    check may read the device, is never the untimed pick."""
    calls = []
    chooser = choose.TopkChooser(fakes(calls, fail=("select",)), timer=Timer(calls))
    lm, k, _ = inputs(24)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(ImportError):
        chooser(lm, k, 5, SCALE)
    assert calls == ["select"] and chooser.dropped == {} and not caplog.records
    only_torch = choose.TopkChooser({"torch": fakes(calls)["torch"]}, timer=Timer(calls))
    calls.clear()
    with pytest.raises(RuntimeError, match="no top-k path"):
        only_torch(lm, k, 5, SCALE)
    assert calls == []


def test_forced_path(monkeypatch):
    calls = []
    timer = Timer(calls)
    lm, k, _ = inputs(24)
    forced = choose.TopkChooser(fakes(calls), timer=timer, force="torch")
    assert torch.equal(forced(lm, k, 5, SCALE), expected(lm, k, 5))
    assert calls == ["torch"] and timer.timed == 0 and forced.report()["forced"] == "torch"
    calls.clear()
    monkeypatch.setenv(choose.FORCE_ENV, "bitonic")
    by_env = choose.TopkChooser(fakes(calls), timer=timer)
    by_env(lm, k, 5, SCALE)
    assert calls == ["bitonic"] and timer.timed == 0 and by_env.take_served() == "bitonic"
    with pytest.raises(ValueError, match="landmark_topk needs"):  # a forced path's error
        choose.TopkChooser(fakes([], fail={"bitonic"}))(lm, k, 5, SCALE)
    monkeypatch.setenv(choose.FORCE_ENV, "heap")
    with pytest.raises(ValueError, match="top-k path must be one of"):
        by_env(lm, k, 5, SCALE)


def test_torch_path_is_exact():
    """The real last-resort path on float32 inputs: every score is exact, so its indices equal
    the float64 ranking's, ties included."""
    lm, k, mask = inputs(90, m=5, seed=3, masked=True)
    got = choose.torch_topk(lm, k, 11, SCALE, mask)
    assert torch.equal(got, expected(lm, k, 11, mask))
    with pytest.raises(ValueError, match="scales by 1/√d"):
        choose.torch_topk(lm, k, 11, 0.5, mask)


@pytest.fixture(scope="module")
def batch():
    data = generate(3, seed=11, cfg=ListOpsConfig(min_length=100, max_length=300))
    return [np.array(encode(text), dtype=np.uint8) for text, _ in data]


def test_engine_on_cpu_reports_no_triton_topk(batch):
    engine = ClassifierEngine(CHECKPOINT, "mita", "cpu", "auto", "float32")
    report = engine.topk_report()
    assert report["triton"] is False and report["forced"] is None
    TopkReport.model_validate(report)
    assert [r["profile"].topk_path for r in engine.run(batch)] == [None] * 3
    dense = ClassifierEngine(CHECKPOINT, "dense", "cpu", "auto", "float32")
    assert dense.topk_report() is None and dense.run(batch[:1])[0]["profile"].topk_path is None


def test_engine_profile_names_the_path_eager_and_replayed(batch, monkeypatch):
    """The plumbing from the chooser to each profile: MiTA's attention calls a chooser of fake
    paths before each forward's real attention, as the Triton launcher would. A replay that
    runs no Python (as a CUDA graph) still names the path its capture used."""
    from service.graphs import Captured, GraphCache

    calls = []
    monkeypatch.setattr(choose, "CHOOSER", choose.TopkChooser(fakes(calls), timer=Timer(calls)))
    real = layers.mita_attention_unchecked

    def with_topk(q, k, v, *, num_landmarks, topk, key_padding_mask=None, **kw):
        landmarks, _ = pool(q, num_landmarks, key_padding_mask)
        choose.CHOOSER(landmarks, k, topk, k.shape[-1] ** -0.5, key_padding_mask)
        return real(q, k, v, num_landmarks=num_landmarks, topk=topk,
                    key_padding_mask=key_padding_mask, **kw)

    monkeypatch.setattr(layers, "mita_attention_unchecked", with_topk)

    def frozen_capture(model, ids, mask):  # replay re-uses the captured output: no Python
        with torch.no_grad():
            out = model(ids, mask)
        return Captured(ids.clone(), mask, out, lambda: None)

    engine = ClassifierEngine(CHECKPOINT, "mita", "cpu", "auto", "float32")
    engine.graphs = GraphCache(engine.model, capture=frozen_capture)
    seqs = [batch[0]] * 3
    got = engine.run(seqs)
    assert [r["profile"].cuda_graph for r in got] == [False, True, True]
    assert [r["profile"].topk_path for r in got] == ["bitonic"] * 3
    calls.clear()
    engine.run(seqs[:1])
    assert calls == []  # the replay called no path, and still reports one
    [decision] = engine.topk_report()["decisions"]
    # the shipped model: d = 64 / 2 heads, m = k = 16; N rounded up to a power of two
    assert [decision[x] for x in ("dtype", "d", "m", "k", "n_bucket", "path")] == [
        "float32", 32, 16, 16, 2 ** math.ceil(math.log2(len(batch[0]))), "bitonic"]
