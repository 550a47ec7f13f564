"""The configuration surfaces a person writes (pydantic v2, strict): the application's
``args``, each classifier's and the gateway's ``user_config``, and the variant and deployment
names they use. No HTTP here (the API's models: ``service.schemas``)."""

from __future__ import annotations

from typing import Annotated, Literal, get_args

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    HttpUrl,
    ValidationError,
    field_validator,
    model_validator,
)

from mita.config import BACKENDS, SHARED_SCALES

Variant = Literal["mita", "dense"]
# The API's word for a model's ``attention`` (mita.config.ATTENTIONS, the same two names;
# tests/no_ray/test_ids.py keeps them equal), MiTA listed first in answers.
VARIANTS: tuple[str, ...] = get_args(Variant)
# The Serve deployment names (``service.app`` gives them): the gateway, and the classifier of
# each variant. Config files name deployments by these (deploy/*.yaml spell them out;
# tests/no_ray/test_deployment_names.py keeps them equal).
DEPLOYMENTS: dict[str, str] = {"gateway": "Gateway", "mita": "MiTAClassifier",
                               "dense": "DenseClassifier"}


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
    MiTA serves when it is faster than dense by ``margin`` with confidence — the upper end of
    the sign-test interval of MiTA's median forward is at most (1 − ``margin``) × the lower
    end of dense's, each interval at two-sided erf(``confidence_z``/√2), over at least
    ``min_latency_samples`` forwards of each — and the lower bound of its label agreement with
    dense (Wilson score interval at ``confidence_z``, over at least ``min_pairs`` shadow
    comparisons) is at least ``min_agreement``; else dense. ``min_latency_samples`` and
    ``min_pairs`` must fit in the ``window`` (a bucket could never settle)."""

    model_config = STRICT_CONFIG

    margin: float = Field(0.1, ge=0, lt=1, description="MiTA must be faster than dense by "
                          "this fraction of dense's median forward, at the confidence")
    min_agreement: float = Field(0.95, ge=0, le=1, description="lowest admissible lower "
                                 "confidence bound of MiTA's label agreement with dense")
    confidence_z: float = Field(1.96, ge=0, le=5, description="standard normal quantile of "
                                "the Wilson bound and of both medians' intervals (1.96: "
                                "two-sided 95 %; MiTA called faster at ≥ that confidence)")
    min_pairs: int = Field(30, ge=1, le=100_000, description="shadow comparisons a bucket "
                           "needs before MiTA can serve it")
    # 20: at 1.96 a finite sign-test bound needs 6 forwards, but then it is the sample's
    # extreme, set by one timing; at 20 it is the 6th from each end, so 5 lucky (or unlucky)
    # timings cannot settle a bucket, and 20 is what exploration at 50 % gathers in ~40
    # requests of a bucket.
    min_latency_samples: int = Field(20, ge=1, le=10_000, description="forwards of each "
                                     "variant a bucket needs before either can be called "
                                     "faster")
    explore: float = Field(0.05, ge=0, le=1, description="fraction of auto requests also "
                           "shadowed to the other variant in a settled bucket")
    explore_unsettled: float = Field(0.5, ge=0, le=1, description="the same while the bucket "
                                     "has too few forwards or pairs, or MiTA's medians look "
                                     "faster without the confidence yet (not_enough_data)")
    window: int = Field(200, ge=10, le=100_000, description="recent forwards per variant and "
                        "shadow comparisons kept per bucket; once both variants' are full, "
                        "MiTA not shown faster is called slower")
    warm_start: str | None = Field(None, min_length=1, max_length=4096, description="an "
                                   "advisor report (python -m profiler advise's advise.json) "
                                   "whose latencies and agreement for the served MiTA "
                                   "setting stand in until live evidence replaces them")

    @model_validator(mode="after")
    def _can_settle(self):
        # After all fields (a field validator on window was skipped when window was left at
        # its default): thresholds the live evidence could never meet are refused.
        for name in ("min_pairs", "min_latency_samples"):
            if getattr(self, name) > self.window:
                raise ValueError(f"{name} ({getattr(self, name)}) must be ≤ window "
                                 f"({self.window}): the window keeps no more, so a bucket "
                                 "could never settle")
        # The Wilson lower bound of `window` agreeing pairs out of `window` is
        # window / (window + z²): the most the live evidence can show.
        best = self.window / (self.window + self.confidence_z ** 2)
        if best < self.min_agreement:
            raise ValueError(f"min_agreement ({self.min_agreement}) is above what {self.window} "
                             f"pairs can show: even with all of them agreeing, the lower bound "
                             f"at confidence_z {self.confidence_z} is {best:.4f}; raise window "
                             "(or lower confidence_z or min_agreement)")
        return self


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
