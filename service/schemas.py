"""HTTP request/response models (pydantic v2) and the gateway's configuration."""

from __future__ import annotations

from typing import Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    field_validator,
    model_validator,
)

Variant = Literal["mita", "dense"]
VARIANTS: tuple[str, ...] = ("mita", "dense")


class ClassifyRequest(BaseModel):
    """One sequence: ListOps ``text`` (space-separated tokens; LRA's ``(``/``)`` are ignored)
    or token ``ids`` — exactly one of them."""

    model_config = ConfigDict(extra="forbid")

    text: str | None = Field(None, description="ListOps tokens, e.g. '[MAX 2 [MIN 4 7 ] 0 ]'")
    ids: list[StrictInt] | None = Field(None, description="token ids (1..15; 0 is padding)")
    variant: Variant | None = Field(None, description="force a variant; default: A/B policy")
    profile: StrictBool = Field(False, description="return per-stage timings and FLOPs")

    @model_validator(mode="after")
    def _exactly_one_input(self):
        if (self.text is None) == (self.ids is None):
            raise ValueError("give exactly one of 'text' or 'ids'")
        return self


class BatchRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    items: list[ClassifyRequest] = Field(..., min_length=1)


class StageProfile(BaseModel):
    device: str
    batch_size: int = Field(description="requests sharing this forward")
    padded_n: int
    total_ms: float
    stages_ms: dict[str, float]
    layers_ms: list[dict[str, float]]
    flops: dict[str, int]
    flops_total: int
    gflops_per_s: dict[str, float]
    peak_memory_bytes: int | None
    peak_memory_kind: str | None


class ClassifyResponse(BaseModel):
    label: int
    probabilities: list[float]
    variant: Variant
    n: int
    model_id: str
    shadow: Variant | None = Field(None, description="variant run in shadow for comparison")
    profile: StageProfile | None = None


class BatchResponse(BaseModel):
    results: list[ClassifyResponse]


class ErrorResponse(BaseModel):
    error: str
    detail: list | dict | None = None


class GatewayConfig(BaseModel):
    """The gateway's ``user_config`` (Serve config file); changes apply without a restart."""

    model_config = ConfigDict(extra="forbid")

    weights: dict[Variant, float] = Field(default_factory=lambda: {"mita": 0.5, "dense": 0.5})
    sticky_header: str = "x-client-key"
    shadow: bool = False
    max_n: int = Field(16384, ge=1, le=1_048_576)
    max_body_bytes: int = Field(4 * 1024 * 1024, ge=1024)
    max_batch_items: int = Field(64, ge=1)
    request_timeout_s: float = Field(120.0, gt=0)
    retry_after_s: int = Field(1, ge=0)

    @field_validator("weights")
    @classmethod
    def _weights_ok(cls, w):
        if any(v < 0 for v in w.values()) or sum(w.values()) <= 0:
            raise ValueError("weights must be ≥ 0 with a positive sum")
        return w
