"""What a stage timer records of one forward, and the sums read from it: ``StageRecord``,
``ForwardSums`` (milliseconds per stage and per block, achieved GFLOP/s: the one definition,
shared by the timer's ``ForwardProfile`` and the service's ``ForwardStats``) and
``ForwardProfile``. Plain Python, no torch: the gateway reads forwards' profiles without
importing it (``mita.timer`` times them).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import NamedTuple


class StageRecord(NamedTuple):
    """One stage's time in one forward (a named tuple: a forward makes one per stage per
    layer, and a tuple is several times cheaper to create than a frozen dataclass)."""

    name: str
    layer: int | None  # encoder block index; None for embed/head
    ms: float


def stages_ms(records: Sequence[tuple[str, int | None, float]]) -> dict[str, float]:
    """Milliseconds per stage, summed over layers, in first-seen order; ``records``:
    ``StageRecord`` named tuples or plain ``(name, layer, ms)`` tuples."""
    out: dict[str, float] = {}
    for name, _, ms in records:
        out[name] = out.get(name, 0.0) + ms
    return out


def layers_ms(records: Sequence[tuple[str, int | None, float]]) -> list[dict[str, float]]:
    """One ``{stage: ms}`` dict per encoder block, in block order (stages outside a block,
    ``embed`` and ``head``, are left out)."""
    layers: dict[int, dict[str, float]] = {}
    for name, layer, ms in records:
        if layer is not None:
            per = layers.setdefault(layer, {})
            per[name] = per.get(name, 0.0) + ms
    return [layers[i] for i in sorted(layers)]


def gflops_per_s(flops: dict[str, int], ms: dict[str, float]) -> dict[str, float]:
    """Achieved GFLOP/s per stage: analytic ``flops`` over the stage's ``ms``; stages with no
    FLOPs or no time are left out."""
    return {s: f / (ms[s] * 1e6) for s, f in flops.items() if ms.get(s, 0) > 0 and f}


class ForwardSums:
    """The sums read from one forward's ``records`` and ``flops``, for any record of a forward
    that has those two attributes (``ForwardProfile`` here, ``service.forward_stats.ForwardStats``
    in the service): ``stages_ms``, ``layers_ms``, ``gflops_per_s``.

    Each is computed when first read and kept (``functools.cached_property``, stored in the
    instance's ``__dict__``, so it works on frozen dataclasses too): a service's forward record
    travels to the gateway and is mostly recorded without them, and a record is read several
    times by the sinks that do want them. A record's ``records`` and ``flops`` are therefore
    not to be changed once a sum has been read. No fields and no ``__init__``: the dataclasses
    that use it keep their own fields, constructors, equality and pickling."""

    records: Sequence[tuple[str, int | None, float]]
    flops: dict[str, int]

    @cached_property
    def stages_ms(self) -> dict[str, float]:
        """Milliseconds per stage, summed over layers, in first-seen order."""
        return stages_ms(self.records)

    @cached_property
    def layers_ms(self) -> list[dict[str, float]]:
        """One ``{stage: ms}`` dict per encoder block, in block order."""
        return layers_ms(self.records)

    @cached_property
    def gflops_per_s(self) -> dict[str, float]:
        """Achieved GFLOP/s per stage with FLOPs and time (``gflops_per_s``)."""
        return gflops_per_s(self.flops, self.stages_ms)


@dataclass
class ForwardProfile(ForwardSums):
    """What one profiled forward returns.

    ``stages_ms``: total milliseconds per stage (summed over layers), in first-seen order.
    ``layers_ms``: one ``{stage: ms}`` dict per encoder block. ``total_ms``: end-to-end
    forward. ``flops``: analytic FLOPs per stage (``mita.cost``) and ``gflops_per_s`` the
    achieved rate (the three sums: ``ForwardSums``). ``peak_memory_bytes`` with
    ``peak_memory_kind``: ``"cuda_max_allocated"`` (measured, reset per forward) or
    ``"analytic_activation_estimate"`` (CPU: not measured).
    """

    records: list[StageRecord]
    total_ms: float
    device: str
    flops: dict[str, int] = field(default_factory=dict)
    peak_memory_bytes: int | None = None
    peak_memory_kind: str | None = None
