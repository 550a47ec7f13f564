"""HTTP request/response models (pydantic v2): what the API takes and answers (the
configuration a person writes: ``service.settings``), and ``profile_body``: a forward's
profile as a response carries it, written without a model pass."""

from __future__ import annotations

from typing import Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    FiniteFloat,
    StrictBool,
    StrictInt,
    field_validator,
    model_validator,
)

from mita.records import ForwardProfile

from .settings import AutoPolicy, Variant

# The top-k paths of MiTA's Triton launcher (mita.kernels.choose.PATHS, the same names;
# tests/kernels/test_topk_choice.py keeps them equal).
TopkPath = Literal["select", "bitonic", "torch"]


class ClassifyRequest(BaseModel):
    """One sequence: ListOps ``text`` (space-separated tokens; LRA's ``(``/``)`` are ignored)
    or token ``ids`` — exactly one of them."""

    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [
        {"text": "[MAX 2 [MIN 4 7 ] 0 ]"},
        {"ids": [12, 3, 11, 5, 8, 15, 1, 15], "variant": "mita", "profile": True},
    ]})

    text: str | None = Field(None, description="ListOps tokens, e.g. '[MAX 2 [MIN 4 7 ] 0 ]'")
    ids: list[StrictInt] | None = Field(None, description="token ids (1..15; 0 is padding)")
    variant: Variant | None = Field(None, description="force a variant; default: A/B policy")
    profile: StrictBool | Literal["staged"] = Field(
        False, description="true: return per-stage timings and FLOPs; \"staged\": also run "
                           "this forward with every MiTA stage timed apart (the fused kernels "
                           "report fewer, merged stages)")

    @field_validator("text", "ids", "variant", mode="before")
    @classmethod
    def _not_null(cls, value, info):
        # Only a value given is validated: a null given is not taken as the field left out.
        if value is None:
            hint = (" for the A/B policy, or give 'mita' or 'dense'"
                    if info.field_name == "variant" else "")
            raise ValueError(f"null is not a value of '{info.field_name}': leave the field "
                             f"out{hint}")
        return value

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
    dtype: str = Field(description="weights' and activations' dtype of the forward")
    staged: bool = Field(description="every stage timed apart (dense; MiTA on the PyTorch "
                                     "stages, sampled or asked for); false: fused stages")
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
    pre_forward_ms: float = Field(
        description="arrival at the gateway → start of this forward: body parsing, validation, "
                    "transfer to the classifier, batching wait and queueing (wall clocks of the "
                    "gateway's and the classifier's nodes: across nodes, their skew adds in)")
    topk_path: TopkPath | None = Field(
        None, description="the top-k path of MiTA's Triton kernels that served this forward "
                          "(a CUDA-graph replay: the one captured); absent (null) when the "
                          "PyTorch or compiled CPU stages served it, and for dense")


# What a response's profile carries, in the schema's order (started_at, cuda_graph stay inside)
PROFILE_FIELDS = tuple(StageProfile.model_fields)


def profile_body(profile: ForwardProfile, arrived_at: float) -> dict:
    """A forward's ``profile`` (as the classifier's engine made it) as a response's JSON
    carries it, without a pass through ``StageProfile``: its fields in the schema's order,
    None left out, with ``pre_forward_ms``, the milliseconds from ``arrived_at`` (the
    gateway's wall clock at the request's arrival, Unix seconds) to the forward's
    ``started_at``. A shallow copy (``dataclasses.asdict`` deep-copies every dict and list,
    ~0.4 ms a request), serialised straight away."""
    pre_forward_ms = (profile.started_at - arrived_at) * 1e3
    out = {}
    for name in PROFILE_FIELDS:
        value = pre_forward_ms if name == "pre_forward_ms" else getattr(profile, name)
        if value is not None:
            out[name] = value
    return out


class ClassifyResponse(BaseModel):
    label: int = Field(description="the class index")
    label_name: str = Field(description="the class's name in the checkpoint's task "
                                        "(ListOps: the value, \"0\" … \"9\")")
    probabilities: list[FiniteFloat] = Field(description="softmax of the logits, finite (a "
                                             "forward with non-finite logits is a 500)")
    variant: Variant
    n: int = Field(description="the sequence's length in tokens as the model read it (after "
                               "the cut to the trained length, if any)")
    original_n: int | None = Field(
        None, description="the sequence's length in tokens as sent (a text: after tokenizing), "
                          "before the cut to the trained length (task.max_length in "
                          "/v1/models); present only when it was cut")
    truncated: Literal["tail", "head"] | None = Field(
        None, description="the end cut off a sequence longer than the trained length, as "
                          "training cut it (task.truncate): tail = the first max_length tokens "
                          "were read, head = the last; present only when it was cut")
    model_id: str
    shadow: Variant | None = Field(None, description="variant run in shadow for comparison")
    profile: StageProfile | None = None


class BatchResponse(BaseModel):
    results: list[ClassifyResponse]


class ErrorResponse(BaseModel):
    error: str
    detail: list | dict | None = None


class RoutingBucket(BaseModel):
    """One N bucket of policy ``auto`` (``service.routing``). MiTA is called faster when
    ``latency_ratio_upper_bound`` ≤ 1 − margin: the upper end of MiTA's median interval over
    the lower end of dense's, a bound that holds at ≥ ``confidence``. While a warm start's
    prior (a median alone) stands in for a variant, that variant has no interval, the bound is
    null and the medians' ratio decides."""

    n_bucket: str = Field(description="the bucket's label: N up to the number (le_1024 …)")
    variant: Variant = Field(description="where auto sends this bucket's requests now")
    reason: Literal["faster_and_agreeing", "slower", "agreement_too_low", "not_enough_data"]
    mita_p50_ms: float | None = Field(description="median recent MiTA forward, ms")
    dense_p50_ms: float | None = Field(description="median recent dense forward, ms")
    mita_p50_interval_ms: tuple[float, float] | None = Field(
        description="[low, high] distribution-free (sign-test) confidence interval of MiTA's "
                    "median forward at confidence, ms; null with too few forwards for a "
                    "finite one (fewer than 6 at 95 %) or while a warm start's prior stands "
                    "in")
    dense_p50_interval_ms: tuple[float, float] | None = Field(
        description="the same of dense's median forward")
    mita_forwards: int = Field(description="live MiTA forwards in the window, or the prior's "
                                           "repeats while it stands in")
    dense_forwards: int = Field(description="the same of dense")
    latency_ratio: float | None = Field(description="mita_p50_ms / dense_p50_ms (< 1: MiTA "
                                                    "faster)")
    latency_ratio_upper_bound: float | None = Field(
        description="upper end of MiTA's interval / lower end of dense's: the true ratio of "
                    "medians is at most this at ≥ confidence; null without both intervals "
                    "(too few forwards, or a warm start's prior standing in)")
    confidence: float = Field(description="two-sided confidence of each interval and of the "
                                          "agreement's bound, erf(confidence_z / √2) (0.95 "
                                          "for 1.96); the ratio bound holds at ≥ this too")
    pairs: int = Field(description="shadow comparisons (MiTA and dense on one request)")
    agreement: float | None = Field(description="share of pairs with equal labels")
    agreement_lower_bound: float = Field(description="its Wilson score lower bound (0 "
                                                     "without pairs)")
    kl_mean: float | None = Field(description="mean KL(dense ‖ MiTA) of the pairs, nats")
    from_warm_start: bool = Field(description="a warm start's prior still stands in for "
                                              "missing live evidence (its latencies have no "
                                              "interval)")


class RoutingResponse(BaseModel):
    policy: Literal["weighted", "auto"]
    auto: AutoPolicy
    warm_start: dict | None = Field(description="the report read (file), the buckets it "
                                    "seeded, or why it could not be used (error)")
    buckets: list[RoutingBucket]


class VariantInfo(BaseModel):
    model_id: str
    attention: str
    device: str
    dtype: str | None = Field(None, description="weights' and activations' dtype")
    m: int | None = Field(None, description="landmarks (MiTA only)")
    k: int | None = Field(None, description="routed keys per landmark (MiTA only)")
    s: int | None = Field(None, description="landmarks each query routes to (MiTA only)")


class TopkDecision(BaseModel):
    """The top-k path chosen for one shape (``mita.kernels.choose.TopkChooser``)."""

    dtype: str = Field(description="the keys' dtype")
    d: int = Field(description="head dim")
    m: int
    k: int
    n_bucket: int = Field(description="N rounded up to a power of two")
    path: TopkPath
    basis: Literal["timed", "fixed_order"] = Field(
        description="timed: the fastest on this device (CUDA events); fixed_order: the first "
                    "that worked of select, bitonic, torch (no timing off CUDA)")
    timings_ms: dict[str, float] | None = Field(
        description="ms per call of each path timed; null for fixed_order")
    dropped: list[TopkPath] = Field(description="paths that failed for this shape")


class TopkReport(BaseModel):
    """The MiTA classifier's top-k paths, in ``/v1/models`` (``variants.mita.topk``)."""

    triton: bool = Field(description="the Triton kernels serve the unstaged forwards (CUDA); "
                                     "false: the PyTorch or compiled CPU stages, whose top-k "
                                     "has no choice")
    forced: str | None = Field(description="the path MITA_TOPK_PATH forces; null: chosen")
    decisions: list[TopkDecision] = Field(description="one per shape this replica has seen "
                                                      "on the Triton kernels")


class ABSplit(BaseModel):
    policy: Literal["weighted", "auto"] = Field(
        "weighted", description="the gateway's policy; under auto the weights split only "
        "requests with the sticky header")
    weights: dict[str, float] = Field(description="configured traffic split")
    observed: dict[str, float] = Field(
        description="share of the answered requests of the window that observed_basis says: "
                    "those the A/B policy routed (local mode), or all (prometheus mode)")
    observed_requests: float = Field(description="the answered requests observed counts")
    observed_basis: Literal["policy_routed", "all_answered"] = Field(
        description="policy_routed: requests that named their variant are left out (they are "
                    "overrides); all_answered: Prometheus' counter does not say how a request "
                    "was routed")
    overrides: dict[str, float] | None = Field(
        description="answered requests that named their variant (body 'variant', "
                    "?variant=), per variant; null in prometheus mode (not recorded there)")
    shadow: bool
    sticky_header: str


class RequestCount(BaseModel):
    variant: str = Field(description="mita, dense, or none when refused before routing")
    status: str = Field(description="HTTP status code")
    count: float


SUM_MS = ("sum of the durations; exact in local mode, in prometheus mode Ray's exported "
          "histogram sum (bucket midpoint × count, an approximation)")


class LatencyStat(BaseModel):
    """End-to-end request latency at the gateway (answered requests)."""

    variant: Variant
    n_bucket: str
    count: float
    sum_ms: float = Field(description=SUM_MS)
    p50_ms: float | None
    p95_ms: float | None
    p99_ms: float | None


class StageStat(BaseModel):
    """One model stage (summed over layers) per request, as in
    mita_serve_stage_duration_seconds: primary and shadow runs."""

    variant: Variant
    n_bucket: str
    stage: str
    count: float = Field(description="n: the staged forwards behind p50/p95 (below the "
                                     "response's min_stage_samples: too few to compare)")
    sum_ms: float = Field(description=SUM_MS)
    p50_ms: float | None
    p95_ms: float | None


class RatioStat(BaseModel):
    """MiTA / dense median request latency in one N bucket (< 1: MiTA faster)."""

    n_bucket: str
    mita_p50_ms: float
    dense_p50_ms: float
    ratio: float = Field(description="like_for_like: geometric mean over the N values both "
                                     "variants served of each N's ratio of medians (weighted "
                                     "by the smaller request count); otherwise mita_p50_ms / "
                                     "dense_p50_ms over the whole bucket")
    like_for_like: bool = Field(description="true: only N values served by both variants "
                                            "(local mode); false: the bucket's N mix may differ "
                                            "between variants (prometheus mode)")
    n_values: int | None = Field(description="distinct N compared (like_for_like)")
    n_min: int | None
    n_max: int | None


class TimelinePoint(BaseModel):
    t: float = Field(description="bin start, Unix seconds")
    variant: Variant
    requests: float = Field(description="answered requests in the bin")
    rps: float
    p50_ms: float | None
    p99_ms: float | None


class TimelineByN(TimelinePoint):
    n_bucket: str


class ShadowStat(BaseModel):
    comparisons: float
    agree: float
    rate: float | None = Field(description="agree / comparisons; null without comparisons")
    kl_mean: float | None = Field(
        description="mean KL(dense ‖ MiTA) of the class probabilities, nats, whichever "
                    "variant is primary; in "
                    "prometheus mode from Ray's histogram sum (bucket midpoints: approximate)")
    kl_p50: float | None = Field(
        description="median of the same KL, nats (prometheus mode: histogram_quantile)")
    dropped: float = Field(0.0, description="shadow calls that gave no comparison: shed or "
                           "refused so as not to delay primary requests, or failed "
                           "(shadow_dropped_total + rejections_total{role=shadow})")


class StatsResponse(BaseModel):
    """Per-stage latency, request latency and throughput, the A/B split and shadow agreement
    over a recent window: what /dashboard shows. Counts are exact in local mode and
    Prometheus' increase() (extrapolated) in prometheus mode."""

    source: Literal["local", "prometheus"]
    scope: Literal["replica", "all_replicas"] = Field(
        description="local: this gateway replica's records; prometheus: every replica")
    window_s: float = Field(description="the window summarised, seconds up to generated_at")
    bin_s: float = Field(description="timeline bin width, seconds")
    generated_at: float = Field(description="Unix seconds")
    truncated: bool = Field(description="the record cap cut the window short (local mode)")
    models: dict[str, VariantInfo]
    ab: ABSplit
    requests: list[RequestCount]
    latency: list[LatencyStat]
    stages: list[StageStat]
    ratios: list[RatioStat]
    timeline: list[TimelinePoint]
    timeline_by_n: list[TimelineByN] = Field(description="the timeline per N bucket served")
    shadow: ShadowStat
    stage_colors: dict[str, str] = Field(description="every stage in forward order, with the "
                                                     "colour plots and Grafana draw it in")
    variant_colors: dict[str, str] = Field(description="each variant's colour, as the load "
                                                       "tester's plots draw it")
    min_stage_samples: int = Field(description="a stage row with a smaller count is too few "
                                               "samples to compare (the dashboard greys it)")
