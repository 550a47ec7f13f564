"""Reading a Serve config file strictly, before Ray's own schema sees it.

Ray's ``ServeDeploySchema`` ignores unknown keys (``http_options.prot``, ``max_replica``),
accepts ``.inf``/``.nan`` for durations and ``min_replicas > max_replicas``, and YAML keeps the
last of two equal keys. The service reads its config files here first: a YAML loader that
refuses duplicate keys, then one strict pydantic model per level of the file (unknown keys
refused, no coercion, numbers finite and bounded). It covers the subset of Serve's schema the
service's configs use; anything else (``runtime_env`` included) is refused by name rather than
passed on unchecked.
"""

from __future__ import annotations

from decimal import Decimal
from pathlib import Path
from typing import Annotated, Literal

import yaml
from pydantic import BaseModel, Field, model_validator

from .settings import MAX_REQUEST_TIMEOUT_S, STRICT_CONFIG, validated

MAX_DRAIN_S = 600.0  # longest drain (graceful_shutdown_timeout_s) a config may ask for
MAX_REPLICAS = 1024
HOUR_S = 3600.0


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, except that a mapping with two equal keys is an error (the
    standard loader silently keeps the last)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:  # as written: merged keys (<<) may be overridden
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            if not isinstance(key_node, yaml.ScalarNode):
                raise yaml.constructor.ConstructorError(
                    None, None, "a mapping key must be a plain value", key_node.start_mark)
            key = self.construct_object(key_node, deep=True)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r}", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep)


def read_yaml(path: str | Path) -> dict:
    """The mapping in YAML file ``path``. Raises OSError when it cannot be read, ValueError
    (naming the file and, for syntax errors, the line) when it is not YAML, holds a duplicate
    key, or is not a mapping."""
    with open(path, encoding="utf-8") as stream:  # a stream: YAML's messages then name the file
        try:
            raw = yaml.load(stream, Loader=_UniqueKeyLoader)  # noqa: S506 (SafeLoader's kind)
        except UnicodeDecodeError as e:
            raise ValueError(f"{path}: not UTF-8 text ({e.reason})") from None
        except yaml.YAMLError as e:
            raise ValueError(f"{path}: not valid YAML: {' '.join(str(e).split())}") from None
        except RecursionError:
            raise ValueError(f"{path}: nested too deeply") from None
        except ValueError as e:  # e.g. an integer past Python's 4,300-digit limit
            raise ValueError(f"{path}: {e}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: expected a mapping with 'applications', got "
                         f"{type(raw).__name__}")
    return raw


class HttpOptions(BaseModel):
    model_config = STRICT_CONFIG

    host: str = Field("127.0.0.1", min_length=1)
    port: int = Field(8000, ge=1, le=65535)
    request_timeout_s: float | None = Field(None, ge=0.1, le=MAX_REQUEST_TIMEOUT_S)
    keep_alive_timeout_s: float | None = Field(None, ge=0.1, le=HOUR_S)
    root_path: str = ""


class ActorOptions(BaseModel):
    model_config = STRICT_CONFIG

    num_cpus: float | None = Field(None, ge=0, le=1024)
    num_gpus: float | None = Field(None, ge=0, le=64)
    memory: int | None = Field(None, ge=0)
    resources: dict[str, Annotated[float, Field(ge=0, le=1e6)]] | None = None
    accelerator_type: str | None = None

    @model_validator(mode="after")
    def _ray_accepts(self):
        # Ray refuses these only when it deploys, after start-up
        if self.resources and {"CPU", "GPU", "memory"} & set(self.resources):
            raise ValueError("CPU, GPU and memory are set with num_cpus, num_gpus and memory, "
                             "not in resources")
        for name in ("num_cpus", "num_gpus"):
            value = getattr(self, name)
            if value and value < 1 and Decimal(str(value)) % Decimal("0.0001"):
                raise ValueError(f"{name} below 1 must be a multiple of 0.0001, got {value}")
        return self


class Autoscaling(BaseModel):
    model_config = STRICT_CONFIG

    min_replicas: int = Field(1, ge=0, le=MAX_REPLICAS)
    initial_replicas: int | None = Field(None, ge=0, le=MAX_REPLICAS)
    max_replicas: int = Field(1, ge=1, le=MAX_REPLICAS)
    target_ongoing_requests: float | None = Field(None, ge=0.01, le=100_000)
    metrics_interval_s: float | None = Field(None, ge=0.1, le=HOUR_S)
    look_back_period_s: float | None = Field(None, ge=0.1, le=HOUR_S)
    upscale_delay_s: float | None = Field(None, ge=0, le=HOUR_S)
    downscale_delay_s: float | None = Field(None, ge=0, le=HOUR_S)
    upscaling_factor: float | None = Field(None, ge=0.01, le=100)
    downscaling_factor: float | None = Field(None, ge=0.01, le=100)

    @model_validator(mode="after")
    def _ordered(self):
        initial = self.min_replicas if self.initial_replicas is None else self.initial_replicas
        if not self.min_replicas <= initial <= self.max_replicas:
            raise ValueError(f"need min_replicas ≤ initial_replicas ≤ max_replicas, got "
                             f"{self.min_replicas}, {self.initial_replicas}, "
                             f"{self.max_replicas}")
        return self


class Deployment(BaseModel):
    model_config = STRICT_CONFIG

    name: str = Field(min_length=1)
    num_replicas: Annotated[int, Field(ge=1, le=MAX_REPLICAS)] | Literal["auto"] | None = None
    max_ongoing_requests: int | None = Field(None, ge=1, le=100_000)
    max_queued_requests: int | None = Field(None, ge=-1, le=1_000_000,
                                            description="-1: no limit (Serve's default)")
    user_config: dict | None = None
    autoscaling_config: Autoscaling | None = None
    graceful_shutdown_wait_loop_s: float | None = Field(None, ge=0, le=MAX_DRAIN_S)
    # Ray accepts .inf here: a shutdown would then wait forever on a stuck request.
    graceful_shutdown_timeout_s: float | None = Field(None, ge=0, le=MAX_DRAIN_S)
    health_check_period_s: float | None = Field(None, ge=0.1, le=HOUR_S)
    health_check_timeout_s: float | None = Field(None, ge=0.1, le=HOUR_S)
    ray_actor_options: ActorOptions | None = None
    max_replicas_per_node: int | None = Field(None, ge=1, le=MAX_REPLICAS)


class Application(BaseModel):
    model_config = STRICT_CONFIG

    name: str = Field("default", min_length=1)
    route_prefix: str | None = Field("/", pattern=r"^/")
    import_path: str = Field(min_length=1)
    args: dict = Field(default_factory=dict)
    deployments: list[Deployment] = Field(default_factory=list)

    @model_validator(mode="after")
    def _unique_deployments(self):
        names = [d.name for d in self.deployments]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"deployment(s) {', '.join(twice)} listed more than once")
        return self


class ServeFile(BaseModel):
    """The top level of a Serve config file (the part of ``ServeDeploySchema`` the service
    uses)."""

    model_config = STRICT_CONFIG

    proxy_location: Literal["Disabled", "HeadOnly", "EveryNode"] = "EveryNode"
    http_options: HttpOptions = Field(default_factory=HttpOptions)
    applications: list[Application] = Field(min_length=1)

    @model_validator(mode="after")
    def _unique_applications(self):
        for what in ("name", "route_prefix"):
            values = [getattr(a, what) for a in self.applications]
            twice = sorted({str(v) for v in values if v is not None and values.count(v) > 1})
            if twice:
                raise ValueError(f"application {what} {', '.join(twice)} used more than once")
        return self


def check_serve_file(raw: dict, where: str) -> None:
    """Parse ``raw`` (a Serve config file's mapping) with ``ServeFile``. Raises ValueError
    starting with ``where`` and naming every refused field by its path in the file, e.g.
    ``applications.0.deployments.1.autoscaling_config.max_replica: Extra inputs are not
    permitted``."""
    validated(ServeFile, raw, where)
