"""The top-k path of the Triton launcher: stage ``topk`` (eq. 7) has several exact
implementations, and the fastest one depends on the shape and the device, so each is timed
once per shape on the device and the fastest kept — as cuDNN's benchmark mode or Triton's
autotune do for their kernels.

Every path keeps one contract: each landmark's k best keys by s_ij = q̃_i·k_j/√d (eq. 6),
lowest key index on ties, indices ascending (``mita.stages.topk_tokens``'s). On exact
scores they return the same indices; otherwise their score arithmetic differs in the last bits
(tile shapes, where the scale is applied), so two keys within rounding of the k-th score may
be chosen differently by two paths — and so by two replicas that timed differently; set
``MITA_TOPK_PATH`` to pin one. The paths, in the order tried without timing:

- ``"select"``: ``mita.kernels.topk.threshold_topk`` (a threshold select);
- ``"bitonic"``: ``mita.kernels.routing.landmark_topk`` (k ≤ ``routing.MAX_TOPK``);
- ``"torch"``: the m × N float32 scores (``landmark_scores``) and ``torch.topk``
  (``topk_tokens``) — always available, the last resort.

Each path is imported when first called, so this module imports neither Triton nor a kernel
module, and a path whose import or launch fails is dropped for that shape (one warning per
path and process), never an error to the caller. ``CHOOSER`` is the one chooser
``triton_mita.mita_triton`` calls; the service reports its decisions (``report()``) and the
path that served each forward (``take_served()``).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

log = logging.getLogger(__name__)

PATHS = ("select", "bitonic", "torch")  # the preference order without timing
FORCE_ENV = "MITA_TOPK_PATH"  # select | bitonic | torch: run that path, no choice
TIMING_REPEATS = 5  # launches timed per path, after one warm-up (compile, autotune)


def select_topk(landmarks: Tensor, k: Tensor, topk: int, scale: float,
                key_padding_mask: Tensor | None = None,
                key_valid: Tensor | None = None) -> Tensor:
    """Path ``"select"``: ``mita.kernels.topk.threshold_topk`` (arguments as
    ``bitonic_topk``; k ≤ 2,048)."""
    from . import topk as kernels  # the module: a reloaded kernel module is what runs

    return kernels.threshold_topk(landmarks, k, topk, scale, key_padding_mask, key_valid)


def bitonic_topk(landmarks: Tensor, k: Tensor, topk: int, scale: float,
                 key_padding_mask: Tensor | None = None,
                 key_valid: Tensor | None = None) -> Tensor:
    """Path ``"bitonic"``: ``routing.landmark_topk``, scores streamed, no m × N matrix.

    Args: ``landmarks`` ``(B, H, m, d)``, ``k`` ``(B, H, N, d)`` float16 / bfloat16 / float32
    keys, ``1 ≤ topk ≤ min(N, 512)``, ``scale`` 1/√d, optional ``(B, N)`` bool mask
    (True = padding) and the same mask as the kernels' ``(B, N)`` int8 (1 = a real key), when
    the caller built it once for the forward. Returns ``(B, H, m, topk)`` int64. Raises
    ValueError for k > 512.
    """
    from . import routing  # the module, not the name: a reloaded kernel module is what runs

    return routing.landmark_topk(landmarks, k, topk, scale, key_padding_mask, key_valid)


def torch_topk(landmarks: Tensor, k: Tensor, topk: int, scale: float,
               key_padding_mask: Tensor | None = None,
               key_valid: Tensor | None = None) -> Tensor:
    """Path ``"torch"``: ``topk_tokens(landmark_scores(landmarks, k.float(), mask), topk)`` —
    float32 scores (cuBLAS on CUDA), any k ≤ N. Arguments as ``bitonic_topk``; ``scale`` must
    be 1/√d, which ``landmark_scores`` applies itself. Raises ValueError for another scale."""
    from .. import stages as S

    # 1/√d computed another way (1 / math.sqrt(d)) may differ in the last bit
    if not math.isclose(scale, k.shape[-1] ** -0.5, rel_tol=1e-12):
        raise ValueError(f"the torch top-k path scales by 1/√d = {k.shape[-1] ** -0.5}, got "
                         f"scale = {scale}")
    scores = S.landmark_scores(landmarks.float(), k.float(), key_padding_mask)
    return S.topk_tokens(scores, topk)


CANDIDATES = {"select": select_topk, "bitonic": bitonic_topk, "torch": torch_topk}


def cuda_event_timer(fn: Callable[[], object], repeats: int = TIMING_REPEATS) -> float:
    """Seconds per call of ``fn`` on the current CUDA device: one warm-up call (Triton's
    compile and autotune, allocator growth), then ``repeats`` calls between two CUDA events,
    with ``torch.cuda.synchronize`` before and after. Raises what ``fn`` raises, and a launch
    error at the synchronisation. Never call it while a CUDA graph is being captured."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / repeats  # elapsed_time is in ms


class TopkKey(NamedTuple):
    """What a decision is cached by: the keys' dtype, head dim d, landmarks m, k, and N
    rounded up to a power of two."""

    dtype: str
    d: int
    m: int
    k: int
    n_bucket: int


def topk_key(landmarks: Tensor, k: Tensor, topk: int) -> TopkKey:
    """The cache key of ``(landmarks (B, H, m, d), k (B, H, N, d), topk)``."""
    n = k.shape[2]
    return TopkKey(str(k.dtype).removeprefix("torch."), k.shape[-1], landmarks.shape[2], topk,
                   1 << max(n - 1, 0).bit_length())


@dataclass
class Decision:
    path: str
    timings_ms: dict[str, float] | None  # None: the fixed order, not timed


def _capturing() -> bool:
    # torch.cuda.is_current_stream_capturing raises on a build without CUDA
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


class TopkChooser:
    """Call it as a top-k path: ``chooser(landmarks, k, topk, scale, key_padding_mask)`` →
    ``(B, H, m, topk)`` int64 (shapes as ``bitonic_topk``).

    The first call with an unseen ``TopkKey`` times every path not dropped for it on the
    actual inputs (``timer``), keeps the fastest (ties: the earlier path), caches it and logs
    one INFO line with every timing; later calls with that key run the cached path. Without a
    timer (the default off CUDA: the Triton interpreter, tests) the paths are tried in order
    and the first that works is kept. Under CUDA-graph capture nothing is timed: the cached
    path runs, or, with none, the first that works (not cached: it was not timed). A path that
    raises is dropped for that key (one warning per path and process) and the next one serves.

    Args:
        candidates: path name → callable with the signature above, in preference order
            (default ``CANDIDATES``).
        timer: ``timer(fn) -> seconds per call of fn``; default ``cuda_event_timer`` for CUDA
            inputs and no timing otherwise.
        force: a path name that always runs (no choice, its errors raised); default: the
            ``MITA_TOPK_PATH`` environment variable when set, read on each call.
    Raises: ValueError for a forced name that is not a path; the last path's error when every
        path fails (then the inputs are at fault: ``"torch"`` takes any valid input).
    """

    def __init__(self, candidates: dict[str, Callable] | None = None,
                 timer: Callable[[Callable[[], object]], float] | None = None,
                 force: str | None = None):
        self.candidates = OrderedDict(CANDIDATES if candidates is None else candidates)
        self.timer, self.force = timer, force
        self.decisions: dict[TopkKey, Decision] = {}
        self.dropped: dict[TopkKey, list[str]] = {}
        self._warned: set[str] = set()
        self._lock = threading.Lock()  # one choice at a time: concurrent timings skew
        self._served = threading.local()

    def forced(self) -> str | None:
        """The forced path name, or None. Raises ValueError for an unknown name."""
        name = self.force or os.environ.get(FORCE_ENV) or None
        if name is not None and name not in self.candidates:
            raise ValueError(f"top-k path must be one of {tuple(self.candidates)}, got "
                             f"{name!r} ({FORCE_ENV} or force=)")
        return name

    def __call__(self, landmarks: Tensor, k: Tensor, topk: int, scale: float,
                 key_padding_mask: Tensor | None = None,
                 key_valid: Tensor | None = None) -> Tensor:
        args = (landmarks, k, topk, scale, key_padding_mask, key_valid)
        name = self.forced()
        if name is not None:
            return self._serve(name, self.candidates[name](*args))
        key = topk_key(landmarks, k, topk)
        decision = self.decisions.get(key)
        if decision is not None:
            try:
                return self._serve(decision.path, self.candidates[decision.path](*args))
            except Exception as e:  # e.g. a launch that fails only now: choose again
                if _capturing():  # a failed capture is void: drop nothing, retry nothing
                    raise
                self._drop(key, decision.path, e)
        with self._lock:
            decision = self.decisions.get(key)
            if decision is not None and decision.path not in self.dropped.get(key, ()):
                # another thread chose while this one waited
                return self._serve(decision.path, self.candidates[decision.path](*args))
            return self._choose(key, args)

    def _choose(self, key: TopkKey, args: tuple) -> Tensor:
        self.decisions.pop(key, None)
        live = [n for n in self.candidates if n not in self.dropped.get(key, ())]
        k = args[1]
        capturing = _capturing()
        timer = self.timer or (cuda_event_timer if k.is_cuda else None)
        if capturing or timer is None:
            for name in live:
                if capturing and name == "torch":
                    continue  # its tie check may read the device, which a capture forbids
                try:
                    out = self.candidates[name](*args)
                except Exception as e:
                    if capturing:  # the capture is void after a failure: drop nothing
                        raise
                    self._drop(key, name, e)
                    continue
                if not capturing:
                    self.decisions[key] = Decision(name, None)
                return self._serve(name, out)
            raise RuntimeError(f"no top-k path can run inside a CUDA-graph capture for "
                               f"{_describe(key)} (the torch path may read the device)")
        timings, outs = {}, {}
        device = torch.cuda.device(k.device) if k.is_cuda else contextlib.nullcontext()
        for name in live:
            def run(fn=self.candidates[name], name=name):
                outs[name] = fn(*args)
                return outs[name]
            try:
                with device:
                    timings[name] = float(timer(run))
            except Exception as e:
                self._drop(key, name, e)
        best = min(timings, key=timings.get)  # min keeps the first of equal times
        ms = {n: t * 1e3 for n, t in timings.items()}
        self.decisions[key] = Decision(best, ms)
        log.info("top-k path for %s: %s (%s)", _describe(key), best,
                 ", ".join(f"{n} {t:.4g} ms" for n, t in ms.items()))
        out = outs.get(best)
        return self._serve(best, out if out is not None else self.candidates[best](*args))

    def _drop(self, key: TopkKey, name: str, error: Exception) -> None:
        """Drop path ``name`` for ``key``, or re-raise ``error`` when no other path is left
        for it (every path failed: the inputs are at fault)."""
        dropped = self.dropped.setdefault(key, [])
        if all(n == name or n in dropped for n in self.candidates):
            raise error
        dropped.append(name)
        if name not in self._warned:
            self._warned.add(name)
            log.warning("top-k path %r failed for %s (%s: %s); dropped for this shape, the "
                        "next path serves (logged once per path)", name, _describe(key),
                        type(error).__name__, str(error)[:200])

    def _serve(self, name: str, out: Tensor) -> Tensor:
        self._served.path = name
        return out

    def take_served(self) -> str | None:
        """The path that served this thread's last call since the previous
        ``take_served()`` (None: no call), and forget it."""
        name, self._served.path = getattr(self._served, "path", None), None
        return name

    def report(self) -> dict:
        """``{"forced": name | None, "decisions": [...]}`` (``forced`` as set, unchecked, so
        a report never fails), one decision per key seen: the
        ``TopkKey`` fields, ``path``, ``basis`` (``"timed"`` or ``"fixed_order"``),
        ``timings_ms`` (ms per call of each path timed; None for the fixed order) and
        ``dropped`` (the paths that failed for it)."""
        return {"forced": self.force or os.environ.get(FORCE_ENV) or None, "decisions": [
            key._asdict() | {"path": d.path,
                             "basis": "fixed_order" if d.timings_ms is None else "timed",
                             "timings_ms": d.timings_ms, "dropped": self.dropped.get(key, [])}
            for key, d in list(self.decisions.items())]}


def _describe(key: TopkKey) -> str:
    return f"{key.dtype} d={key.d} m={key.m} k={key.k} N≤{key.n_bucket}"


CHOOSER = TopkChooser()
