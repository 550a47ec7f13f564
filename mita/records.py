"""One forward's record and the sums read from it: ``StageRecord`` (one stage's time) and
``ForwardProfile``, the one record of a forward — what the stage timer measured
(``mita.timer``), with what ``mita.timer.profile_forward`` and the service's engine know
around it — read unchanged by every reader: the profiler, the gateway's recorder (Prometheus
metrics and ``/v1/stats``) and a response's ``profile``. Plain Python, no torch: the gateway
reads forwards' records without importing it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
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


@dataclass(frozen=True)
class ForwardProfile:
    """One forward of ``batch_size`` sequences padded to ``padded_n`` tokens.

    Measured by the stage timer (``mita.timer.StageTimer.result``): ``records``, one
    ``(stage, layer or None, ms)`` per stage per encoder block as timed (``StageRecord``
    named tuples; plain tuples in a ``shipped`` copy), ``total_ms`` the whole forward in
    milliseconds, ``device`` (``"cpu"``, ``"cuda:0"``), ``flops`` analytic FLOPs per stage
    for the padded batch (``mita.cost``; {}: not given), ``peak_memory_bytes`` with
    ``peak_memory_kind``: ``"cuda_max_allocated"`` (measured, reset per forward) or
    ``"analytic_activation_estimate"`` (CPU: not measured), or None for both.

    Context, each default meaning "not known here" where the record was made:
    ``dtype`` the weights' and activations' dtype (``"float32"``, ``"bfloat16"``; None),
    ``batch_size`` and ``padded_n`` the ids' shape (None) — ``profile_forward`` fills these
    three; ``staged`` every stage timed apart (True: the timer times each stage the model
    marks; False for a CUDA-graph replay, which is timed as a whole, and in the engine for a
    fused MiTA backend's forward, whose stages cover several); ``cuda_graph`` replayed from a
    CUDA graph (False); ``started_at`` the classifier's wall clock, Unix seconds, when the
    forward began (None: only the engine sets it); ``topk_path`` the Triton top-k path that
    served it, ``"select"`` | ``"bitonic"`` | ``"torch"`` (None: no Triton top-k ran, or not
    known). The service's engine adds its context with ``shipped``.

    Derived, each computed when first read and kept (``functools.cached_property``, in the
    instance's ``__dict__``, which a frozen dataclass allows), not where the forward ran: a
    service's record travels to the gateway and is mostly recorded without them, and is read
    several times by the readers that want them. ``flops_total`` (all stages' FLOPs),
    ``stages_ms``, ``layers_ms`` and ``gflops_per_s`` (the module's functions of
    ``records`` and ``flops``). ``records`` and ``flops`` are not to be changed in place.
    Equality and ``dataclasses.fields`` cover the fields only.
    """

    records: Sequence[tuple[str, int | None, float]]
    total_ms: float
    device: str
    flops: dict[str, int] = field(default_factory=dict)
    peak_memory_bytes: int | None = None
    peak_memory_kind: str | None = None
    dtype: str | None = None
    batch_size: int | None = None
    padded_n: int | None = None
    staged: bool = True
    cuda_graph: bool = False
    started_at: float | None = None
    topk_path: str | None = None

    @cached_property
    def flops_total(self) -> int:
        """Analytic FLOPs of the whole forward: the sum over stages of ``flops``."""
        return sum(self.flops.values())

    @cached_property
    def stages_ms(self) -> dict[str, float]:
        """Milliseconds per stage, summed over layers, in first-seen order (``stages_ms``)."""
        return stages_ms(self.records)

    @cached_property
    def layers_ms(self) -> list[dict[str, float]]:
        """One ``{stage: ms}`` dict per encoder block, in block order (``layers_ms``)."""
        return layers_ms(self.records)

    @cached_property
    def gflops_per_s(self) -> dict[str, float]:
        """Achieved GFLOP/s per stage with FLOPs and time (``gflops_per_s``)."""
        return gflops_per_s(self.flops, self.stages_ms)

    def shipped(self, **context) -> ForwardProfile:
        """A copy with ``context`` (fields by name) for the trip to another process: the
        records as plain tuples — a named tuple is pickled field by field by reference to its
        class, which made a classifier's answer ~4× slower to pickle on its way to the
        gateway. Raises TypeError for an unknown field."""
        return replace(self, records=list(map(tuple, self.records)), **context)
