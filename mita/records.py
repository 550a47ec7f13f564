"""What a stage timer records of one forward, and the sums read from it: ``StageRecord``,
``ForwardProfile``, milliseconds per stage and per block, achieved GFLOP/s. Plain Python, no
torch: the gateway reads forwards' profiles without importing it (``mita.timer`` times them).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
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


@dataclass
class ForwardProfile:
    """What one profiled forward returns.

    ``stages_ms``: total milliseconds per stage (summed over layers), in first-seen order.
    ``layers_ms``: one ``{stage: ms}`` dict per encoder block. ``total_ms``: end-to-end
    forward. ``flops``: analytic FLOPs per stage (``mita.cost``) and ``gflops_per_s`` the
    achieved rate. ``peak_memory_bytes`` with ``peak_memory_kind``: ``"cuda_max_allocated"``
    (measured, reset per forward) or ``"analytic_activation_estimate"`` (CPU: not measured).
    """

    records: list[StageRecord]
    total_ms: float
    device: str
    flops: dict[str, int] = field(default_factory=dict)
    peak_memory_bytes: int | None = None
    peak_memory_kind: str | None = None

    @property
    def stages_ms(self) -> dict[str, float]:
        return stages_ms(self.records)

    @property
    def layers_ms(self) -> list[dict[str, float]]:
        return layers_ms(self.records)

    @property
    def gflops_per_s(self) -> dict[str, float]:
        return gflops_per_s(self.flops, self.stages_ms)
