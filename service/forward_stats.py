"""One forward's statistics, made once by the classifier's engine and read unchanged by every
sink: the gateway's recorder (Prometheus metrics and the ``/v1/stats`` window) and the
response's ``profile``. vLLM's practice (``IterationStats`` handed to every stat logger), so
no sink reshapes what another one reads. Ray-free: the engine runs without Ray."""

from __future__ import annotations

from dataclasses import dataclass

from mita import records

from .schemas import StageProfile

# What a response's profile carries, in the schema's order (started_at, cuda_graph stay inside)
PROFILE_FIELDS = tuple(StageProfile.model_fields)


@dataclass(frozen=True)
class ForwardStats(records.ForwardSums):
    """A forward of ``batch_size`` requests padded to ``padded_n`` tokens.

    Times in milliseconds (``total_ms``: the whole forward; ``records``: each stage of each
    layer, as the stage timer took them; from them ``stages_ms``: per stage, summed over
    layers, ``layers_ms``: per encoder block, ``gflops_per_s``), FLOPs analytic
    (``mita.cost``) for the padded batch, ``peak_memory_bytes`` measured on CUDA or estimated
    on the CPU (``peak_memory_kind`` says which), ``started_at`` the classifier's wall clock
    (seconds since the epoch) when the forward began. ``staged``: every stage timed apart;
    ``cuda_graph``: replayed from a CUDA graph; ``topk_path``: the Triton top-k path that
    served it (None off the Triton path).

    ``stages_ms``, ``layers_ms`` and ``gflops_per_s`` are ``records.ForwardSums``' (the same
    sums as the timer's ``ForwardProfile``), computed when first read, not in the classifier:
    most answers travel to the gateway and are recorded without them (they are read for a
    staged forward's stage metrics and for a response that asks for the profile)."""

    device: str
    dtype: str
    staged: bool
    batch_size: int
    padded_n: int
    total_ms: float
    records: list[tuple[str, int | None, float]]  # (stage, layer or None, ms): StageRecord's
    flops: dict[str, int]
    flops_total: int
    peak_memory_bytes: int | None
    peak_memory_kind: str | None
    started_at: float
    cuda_graph: bool = False
    topk_path: str | None = None

    @classmethod
    def of(cls, profile: records.ForwardProfile, **context) -> ForwardStats:
        """From the stage timer's ``profile`` and the engine's ``context`` (``dtype``,
        ``staged``, ``batch_size``, ``padded_n``, ``started_at``, ``cuda_graph``,
        ``topk_path``). Raises TypeError for a missing or unknown field."""
        # plain tuples: a named tuple is pickled field by field by reference to its class, which
        # made the answer's trip to the gateway ~4× slower to pickle
        return cls(device=profile.device, total_ms=profile.total_ms,
                   records=list(map(tuple, profile.records)),
                   flops=profile.flops, flops_total=sum(profile.flops.values()),
                   peak_memory_bytes=profile.peak_memory_bytes,
                   peak_memory_kind=profile.peak_memory_kind, **context)

    def response(self, arrived_at: float) -> dict:
        """The response's ``profile`` as its JSON carries it: the fields of
        ``schemas.StageProfile`` in its order, None left out, with ``pre_forward_ms``, the
        milliseconds from ``arrived_at`` (the gateway's wall clock at the request's arrival) to
        ``started_at``. A shallow copy (``dataclasses.asdict`` deep-copies every dict and
        list, ~0.4 ms a request), serialised straight away."""
        pre_forward_ms = (self.started_at - arrived_at) * 1e3
        out = {}
        for name in PROFILE_FIELDS:
            value = pre_forward_ms if name == "pre_forward_ms" else getattr(self, name)
            if value is not None:
                out[name] = value
        return out
