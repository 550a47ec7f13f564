"""Per-stage timing of one forward pass, with CUDA events on GPU and a host clock on CPU, and
``profile_forward``: one classifier forward timed by stage, with its analytic cost.

A ``StageTimer`` is the hook (``mita.hooks.StageHook``) the model passes down to every block
and attention call. Make one per forward (per request): it holds no global state, so
concurrent forwards in one process keep separate records. Disabled profiling is simply the
model's default hook, ``mita.NULL_HOOK``.

On CUDA each stage records a pair of ``torch.cuda.Event(enable_timing=True)`` on the current
stream and nothing synchronises between stages; ``result()`` synchronises once, on the last
event, and resolves every elapsed time. On CPU the same interface reads
``time.perf_counter_ns``.
"""

from __future__ import annotations

import time
from functools import lru_cache

import torch

from .config import ModelConfig
from .cost import activation_bytes_estimate, model_stage_flops
from .model import EncoderClassifier
from .records import ForwardProfile, StageRecord

# CUDA events whose timings were read, for reuse, per device index (list append/pop are atomic
# in CPython, so concurrent timers in one process can share them).
_FREE_EVENTS: dict[int, list] = {}
_MAX_FREE_EVENTS = 4096


class _Stage:
    """``StageTimer.stage``'s context manager: a class, not ``@contextmanager`` — a forward
    enters ~20 stages, and a generator-based manager costs several times more per entry
    (~45 µs more a forward of the shipped model on CPU, measured in process)."""

    __slots__ = ("timer", "name", "layer", "start")

    def __init__(self, timer: StageTimer, name: str):
        self.timer, self.name = timer, name

    def __enter__(self):
        self.layer = self.timer._layer  # the block the stage starts in
        self.start = self.timer._now()
        return self

    def __exit__(self, *exc) -> None:
        self.timer._marks.append((self.name, self.layer, self.start, self.timer._now()))


class _Layer:
    """``StageTimer.layer``'s context manager: stages inside belong to block ``index``."""

    __slots__ = ("timer", "index", "previous")

    def __init__(self, timer: StageTimer, index: int):
        self.timer, self.index = timer, index

    def __enter__(self):
        self.previous, self.timer._layer = self.timer._layer, self.index
        return self

    def __exit__(self, *exc) -> None:
        self.timer._layer = self.previous


class _Forward:
    """``StageTimer.forward``'s context manager (a class, as ``_Stage``)."""

    __slots__ = ("timer", "start")

    def __init__(self, timer: StageTimer):
        self.timer = timer

    def __enter__(self) -> StageTimer:
        timer = self.timer
        if timer.cuda:
            torch.cuda.reset_peak_memory_stats(timer.device)
        self.start = timer._now()
        return timer

    def __exit__(self, *exc) -> None:
        self.timer._forward = (self.start, self.timer._now())


class StageTimer:
    """Stage hook that times each stage of one forward.

    Use::

        timer = StageTimer(device)
        with timer.forward():
            logits = model(ids, mask, hook=timer)
        profile = timer.result()

    Raises RuntimeError if ``result()`` is called before a forward was recorded.
    """

    def __init__(self, device: str | torch.device = "cpu"):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self._marks: list[tuple[str, int | None, object, object]] = []
        self._layer: int | None = None
        self._forward: tuple[object, object] | None = None
        self._resolved: tuple[list[StageRecord], float] | None = None
        # events are per device: one free list per device index
        self._free = _FREE_EVENTS.setdefault(
            self.device.index if self.device.index is not None else
            (torch.cuda.current_device() if self.cuda else -1), [])

    def _now(self):
        if self.cuda:
            try:  # a recycled event: creating one per stage boundary costs more than recording
                event = self._free.pop()
            except IndexError:
                event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter_ns()

    def layer(self, index: int) -> _Layer:
        return _Layer(self, index)

    def stage(self, name: str) -> _Stage:
        return _Stage(self, name)

    def forward(self) -> _Forward:
        """Wrap the whole forward: end-to-end time, and on CUDA the peak-memory window.
        ``with timer.forward() as t``: t is the timer."""
        return _Forward(self)

    def _ms(self, start, end) -> float:
        if self.cuda:
            return float(start.elapsed_time(end))
        return (end - start) / 1e6

    def result(self, flops: dict[str, int] | None = None,
               activation_bytes: int | None = None, **context) -> ForwardProfile:
        """Resolve all times (one synchronisation on CUDA) into a ``ForwardProfile``.

        ``flops``: analytic FLOPs per stage to attach. ``activation_bytes``: the analytic
        estimate reported as peak memory on CPU (ignored on CUDA, which measures).
        ``context``: the record's other fields the caller knows (``dtype``, ``batch_size``,
        ``padded_n``, ``staged``, ``cuda_graph``; TypeError for an unknown one).
        """
        if self._resolved is None:
            if self._forward is None:
                raise RuntimeError("no forward recorded: wrap the model call in "
                                   "timer.forward()")
            if self.cuda:
                self._forward[1].synchronize()
            records = [StageRecord(n, layer, self._ms(s, e)) for n, layer, s, e in self._marks]
            self._resolved = (records, self._ms(*self._forward))
            if self.cuda and len(self._free) < _MAX_FREE_EVENTS:
                # every event completed (the last one did): they can be recorded again
                self._free.extend(e for _, _, s, t in self._marks for e in (s, t))
                self._free.extend(self._forward)
        records, total_ms = self._resolved
        if self.cuda:
            peak = int(torch.cuda.max_memory_allocated(self.device))
            kind = "cuda_max_allocated"
        else:
            peak, kind = activation_bytes, (
                "analytic_activation_estimate" if activation_bytes is not None else None)
        return ForwardProfile(records=records, total_ms=total_ms,
                              device=str(self.device), flops=dict(flops or {}),
                              peak_memory_bytes=peak, peak_memory_kind=kind, **context)


def profile_forward(model: EncoderClassifier, ids: torch.Tensor,
                    key_padding_mask: torch.Tensor | None = None, replay=None
                    ) -> tuple[torch.Tensor, ForwardProfile]:
    """Run ``model(ids, key_padding_mask)`` under a fresh ``StageTimer`` on the ids' device.

    ``replay``: optional ``(ids, mask) -> logits | None`` tried first (``service.graphs``: a
    CUDA-graph replay, timed as a whole — its profile has no stages); None falls back to the
    hooked forward.
    Returns the logits ``(B, num_classes)`` and the ``ForwardProfile`` with analytic FLOPs and
    peak memory (CUDA: measured; CPU: ``activation_bytes_estimate``), the weights' ``dtype``,
    ``batch_size`` and ``padded_n`` (the ids' shape ``(B, N)``), and ``cuda_graph`` (with
    ``staged`` its opposite) whether ``replay`` served it.
    """
    timer = StageTimer(ids.device)
    with torch.no_grad(), timer.forward():
        logits = None if replay is None else replay(ids, key_padding_mask)
        replayed = logits is not None
        if not replayed:
            logits = model(ids, key_padding_mask, hook=timer)
    batch, n = ids.shape
    dtype = next(model.parameters()).dtype
    # a pretrained image model sees patches, not the pixel ids sent (PretrainedClassifier)
    tokens = model.model_tokens(n) if hasattr(model, "model_tokens") else n
    flops, activation_bytes = _forward_cost(model.config, batch, tokens, dtype)
    return logits, timer.result(flops=flops, activation_bytes=activation_bytes,
                                dtype=str(dtype).removeprefix("torch."), batch_size=batch,
                                padded_n=n, staged=not replayed, cuda_graph=replayed)


@lru_cache(maxsize=1024)
def _forward_cost(cfg: ModelConfig, batch: int, n: int, dtype: torch.dtype) -> tuple[dict, int]:
    """(``model_stage_flops``, ``activation_bytes_estimate``) of a ``(batch, n)`` forward: the
    same few shapes come again and again to a server, and ``result`` copies the dict."""
    return (model_stage_flops(cfg, batch, n),
            activation_bytes_estimate(cfg, batch, n, dtype))
