"""HTTP request/response models (pydantic v2) and the gateway's configuration."""

from __future__ import annotations

from typing import Annotated, Literal, get_args

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    FiniteFloat,
    HttpUrl,
    StrictBool,
    StrictInt,
    ValidationError,
    field_validator,
    model_validator,
)

from mita.config import BACKENDS, SHARED_SCALES

Variant = Literal["mita", "dense"]
# The API's word for a model's ``attention`` (mita.config.ATTENTIONS, the same two names;
# tests/test_ids.py keeps them equal), MiTA listed first in answers.
VARIANTS: tuple[str, ...] = get_args(Variant)
# The Serve deployment names (``service.app`` gives them): the gateway, and the classifier of
# each variant. Config files name deployments by these (deploy/*.yaml spell them out;
# tests/test_deployment_names.py keeps them equal).
DEPLOYMENTS: dict[str, str] = {"gateway": "Gateway", "mita": "MiTAClassifier",
                               "dense": "DenseClassifier"}


# The top-k paths of MiTA's Triton launcher (mita.kernels.choose.PATHS, the same names;
# tests/test_topk_choice.py keeps them equal).
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


class ClassifyResponse(BaseModel):
    label: int = Field(description="the class index")
    label_name: str = Field(description="the class's name in the checkpoint's task "
                                        "(ListOps: the value, \"0\" … \"9\")")
    probabilities: list[FiniteFloat] = Field(description="softmax of the logits, finite (a "
                                             "forward with non-finite logits is a 500)")
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


# The longest request any configuration may allow (gateway and HTTP proxy timeouts): the
# duration histograms' last finite bucket (service.metrics).
MAX_REQUEST_TIMEOUT_S = 300.0

# Every configuration surface a person writes (Serve YAML user_config and application args):
# unknown keys refused, no str -> bool / float -> int / str -> number coercion, numbers finite.
STRICT_CONFIG = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class MiTASetting(BaseModel):
    """MiTA's setting at serving time, replacing the checkpoint's (the paper's swap without
    retraining, §4 Fig. 9; ``python -m profiler advise`` recommends one). Fields left out
    keep the checkpoint's value. Types only: ``mita.config.ModelConfig`` (``check_setting``,
    the one check of a setting) checks the result at deploy, before Ray starts."""

    model_config = STRICT_CONFIG

    num_landmarks: int | None = Field(None, description="m: landmarks = routed experts")
    topk: int | None = Field(None, description="k: tokens per routed expert")
    route_topk: int | None = Field(None, description="s: routed experts per query")
    shared_scale: Literal[SHARED_SCALES] | None = None

    def overrides(self) -> dict:
        """The fields set, as ``ModelConfig`` field overrides."""
        return self.model_dump(exclude_none=True)


class AppArgs(BaseModel):
    """The application's ``args`` (``service.app.build_app``): what both classifier
    deployments load and how."""

    model_config = STRICT_CONFIG

    checkpoint: str = Field("checkpoints/listops-default", min_length=1,
                            description="checkpoint folder, relative to the project root "
                                        "unless absolute")
    device: str = Field("auto", pattern=r"^(auto|cpu|cuda(:\d{1,3})?)$")
    mita_backend: Literal[BACKENDS] = "auto"
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    cuda_graphs: bool = Field(True, description="replay unstaged forwards from CUDA graphs "
                                                "per input shape (CUDA only)")
    mita_setting: MiTASetting = Field(default_factory=MiTASetting,
                                      description="the MiTA classifier's m, k, s, shared "
                                                  "scale; default: the checkpoint's")


class ClassifierConfig(BaseModel):
    """A classifier deployment's ``user_config``; changes apply without a restart."""

    model_config = STRICT_CONFIG

    max_batch_size: int = Field(8, ge=1, le=1024)
    batch_wait_timeout_s: float = Field(0.005, ge=0, le=10)
    deterministic: bool = True
    staged_profile_every: int = Field(
        100, ge=0, le=1_000_000, description="a fused MiTA backend times every stage apart on "
                                             "one forward in this many; 0: only on requests "
                                             "that ask")


def describe_errors(error: ValidationError) -> str:
    """One line per refused field: ``field: message (got value)``; a mapping or list value
    is not repeated, a long value is cut."""
    def got(value) -> str:
        if isinstance(value, dict | list):
            return ""
        text = repr(value)
        return f" (got {text if len(text) <= 80 else text[:77] + '...'})"
    return "; ".join(f"{'.'.join(str(p) for p in e['loc']) or '(whole)'}: {e['msg']}"
                     f"{got(e['input'])}" for e in error.errors())


def validated(model: type[BaseModel], values: dict | None, where: str) -> BaseModel:
    """``model.model_validate(values)``; raises ValueError naming ``where`` (the application
    or deployment and the surface) and every refused field."""
    try:
        return model.model_validate(values or {})
    except ValidationError as e:
        raise ValueError(f"{where}: {describe_errors(e)}") from None


class AutoPolicy(BaseModel):
    """The thresholds of the gateway's ``policy: auto`` (``service.routing``): per N bucket,
    MiTA serves when its median forward is at most (1 − ``margin``) × dense's and the lower
    bound of its label agreement with dense (Wilson score interval at ``confidence_z``, over
    at least ``min_pairs`` shadow comparisons) is at least ``min_agreement``; else dense."""

    model_config = STRICT_CONFIG

    margin: float = Field(0.1, ge=0, lt=1, description="MiTA must be faster than dense by "
                          "this fraction of dense's median forward")
    min_agreement: float = Field(0.95, ge=0, le=1, description="lowest admissible lower "
                                 "confidence bound of MiTA's label agreement with dense")
    confidence_z: float = Field(1.96, ge=0, le=5, description="standard normal quantile of "
                                "the Wilson bound (1.96: two-sided 95 %)")
    min_pairs: int = Field(30, ge=1, le=100_000, description="shadow comparisons a bucket "
                           "needs before MiTA can serve it")
    min_latency_samples: int = Field(5, ge=1, le=10_000, description="forwards of each "
                                     "variant a bucket needs before either can be called "
                                     "faster")
    explore: float = Field(0.05, ge=0, le=1, description="fraction of auto requests also "
                           "shadowed to the other variant in a bucket with enough data")
    explore_unsettled: float = Field(0.5, ge=0, le=1, description="the same while the bucket "
                                     "has too few forwards or pairs")
    window: int = Field(200, ge=10, le=100_000, description="recent forwards per variant and "
                        "shadow comparisons kept per bucket")
    warm_start: str | None = Field(None, min_length=1, max_length=4096, description="an "
                                   "advisor report (python -m profiler advise's advise.json) "
                                   "whose latencies and agreement for the served MiTA "
                                   "setting stand in until live evidence replaces them")


class GatewayConfig(BaseModel):
    """The gateway's ``user_config`` (Serve config file); changes apply without a restart."""

    model_config = STRICT_CONFIG

    # Each weight at most 1e6, so that their sum stays finite.
    weights: dict[Variant, Annotated[float, Field(ge=0, le=1e6)]] = Field(
        default_factory=lambda: {"mita": 0.5, "dense": 0.5})
    policy: Literal["weighted", "auto"] = Field(
        "weighted", description="weighted: the A/B split by weights; auto: per N bucket the "
        "faster variant whose agreement with dense is high enough (auto's thresholds)")
    auto: AutoPolicy = Field(default_factory=AutoPolicy)
    sticky_header: str = Field("x-client-key", pattern=r"^[A-Za-z0-9!#$%&'*+.^_`|~-]{1,64}$",
                               description="an HTTP header name (RFC 9110 token)")
    shadow: bool = False
    shadow_max_inflight: int = Field(
        2, ge=1, le=1024, description="shadow calls in flight to one variant at most (per "
        "gateway replica); more, or any while that variant serves primary requests from this "
        "replica, are dropped and counted, so a primary request waits behind at most this "
        "many shadow forwards")
    max_n: int = Field(16384, ge=1, le=1_048_576)
    max_body_bytes: int = Field(4 * 1024 * 1024, ge=1024, le=256 * 1024 * 1024)
    max_batch_items: int = Field(64, ge=1, le=4096)
    request_timeout_s: float = Field(120.0, gt=0, le=MAX_REQUEST_TIMEOUT_S)
    retry_after_s: int = Field(1, ge=0, le=3600)
    prometheus_url: HttpUrl | None = Field(
        None, description="Prometheus base URL (e.g. http://127.0.0.1:9090): /v1/stats and the "
                          "dashboard then query it; unset: the gateway's own recent records")
    stats_window_s: float = Field(300.0, ge=10, le=3600,
                                  description="how long the gateway keeps its own records")

    @field_validator("prometheus_url")
    @classmethod
    def _base_url(cls, url):
        # the queries append /api/v1/query to it
        if url is not None and (url.query or url.fragment or url.username or url.password):
            raise ValueError("a base URL without query, fragment or user:password, e.g. "
                             "http://127.0.0.1:9090")
        return url

    @field_validator("weights")
    @classmethod
    def _weights_ok(cls, w):
        if any(v < 0 for v in w.values()) or sum(w.values()) <= 0:
            raise ValueError("weights must be ≥ 0 with a positive sum")
        return w


class RoutingBucket(BaseModel):
    """One N bucket of policy ``auto`` (``service.routing``)."""

    n_bucket: str = Field(description="the bucket's label: N up to the number (le_1024 …)")
    variant: Variant = Field(description="where auto sends this bucket's requests now")
    reason: Literal["faster_and_agreeing", "slower", "agreement_too_low", "not_enough_data"]
    mita_p50_ms: float | None = Field(description="median recent MiTA forward, ms")
    dense_p50_ms: float | None = Field(description="median recent dense forward, ms")
    mita_forwards: int
    dense_forwards: int
    pairs: int = Field(description="shadow comparisons (MiTA and dense on one request)")
    agreement: float | None = Field(description="share of pairs with equal labels")
    agreement_lower_bound: float = Field(description="its Wilson score lower bound (0 "
                                                     "without pairs)")
    kl_mean: float | None = Field(description="mean KL(dense ‖ MiTA) of the pairs, nats")
    from_warm_start: bool = Field(description="a warm start's prior still stands in for "
                                              "missing live evidence")


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
