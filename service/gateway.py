"""Gateway deployment: the FastAPI ingress, the A/B policy and the recording of outcomes
(input parsing and id checks: ``service.inputs``).

(No ``from __future__ import annotations`` here: FastAPI must see the real types of the
endpoint parameters of the ingress class.)

Request path: HTTP → pydantic model → validation (before any tensor exists) → A/B policy →
classifier deployment handle (``mita`` or ``dense``) → response; in shadow mode the other
variant runs too and the two answers are compared. Every outcome goes through one
``service.recorder.Recorder`` into Prometheus and the ``StatsWindow`` that ``/v1/stats``
summarises for the ``/dashboard`` page (or Prometheus does, when ``prometheus_url`` is
configured). A classify request refused before routing is counted once, by the ``check_body``
middleware, whichever layer refused it; a routed one is recorded by ``_classify``.
"""


import asyncio
import json
import math
import random
import time
from importlib.metadata import version
from importlib.resources import files
from typing import Annotated, Literal

import numpy as np
import ray
from fastapi import FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response
from ray import serve
from ray.exceptions import RayActorError
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError
from ray.serve.handle import DeploymentHandle
from starlette.exceptions import HTTPException as StarletteHTTPException

from mita.hooks import STAGE_COLORS, VARIANT_COLORS

from . import replica_state
from .inputs import ApiError, StrictJSONRoute, Vocabulary, binary_ids, to_ids
from .live_config import LiveConfig, store_key
from .policy import choose_variant, shadow_comparison
from .recorder import Recorder
from .schemas import (
    VARIANTS,
    BatchRequest,
    BatchResponse,
    ClassifyRequest,
    ClassifyResponse,
    ErrorResponse,
    GatewayConfig,
    StatsResponse,
    Variant,
)
from .stats import PrometheusError, ab_split, prometheus_summary, summarize

CLASSIFIER_DEPLOYMENTS = {"mita": "MiTAClassifier", "dense": "DenseClassifier"}  # service.app
# How often the gateway asks Serve's controller which classifiers have a running replica, and
# so how long a request waits, at most, after its classifier's last replica is gone.
REPLICA_WATCH_S = 1.0
# Replica states (Serve's ReplicaState) in which a replica takes requests.
SERVING_STATES = ("RUNNING", "UPDATING", "RECOVERING", "PENDING_MIGRATION")


def classifier_replicas(details: dict, app_name: str) -> dict[str, dict]:
    """Per variant, from Serve's controller (``get_serve_details()``, the data of
    ``serve.status()``): ``serving`` (replicas in ``SERVING_STATES``), ``stopping`` (still
    finishing requests they took) and ``scales_to_zero`` (``min_replicas: 0``: no replica is
    then normal, and a request is what starts one). Raises KeyError when the application or
    a classifier deployment is not there."""
    deployments = details["applications"][app_name]["deployments"]
    out = {}
    for variant, name in CLASSIFIER_DEPLOYMENTS.items():
        dep = deployments[name]
        # Serve's ReplicaState is a str enum: equal to its value, but str() gives its name
        states = [r["state"] for r in dep.get("replicas", [])]
        auto = (dep.get("deployment_config") or {}).get("autoscaling_config") or {}
        out[variant] = {"serving": sum(st in SERVING_STATES for st in states),
                        "stopping": states.count("STOPPING"),
                        "scales_to_zero": auto.get("min_replicas", 1) == 0}
    return out


async def fetch_classifier_replicas(timeout_s: float) -> dict[str, dict]:
    """``classifier_replicas`` of this replica's application, asked of Serve's controller
    (never of the classifiers, so the answer does not wait behind classify work). Raises
    asyncio.TimeoutError after ``timeout_s``, or the controller's error."""
    from ray.serve.context import _get_global_client

    def ask() -> dict:
        return _get_global_client().get_serve_details()
    details = await asyncio.wait_for(asyncio.to_thread(ask), timeout_s)
    return classifier_replicas(details, serve.get_replica_context().app_name)


class ServiceAPI(FastAPI):
    def openapi(self) -> dict:
        """FastAPI's schema without the ``"example": {}`` it writes for every query parameter
        in a Serve replica: Serve cloudpickles the app, the parameters' "unset" sentinel comes
        back as a different object, and FastAPI then takes it for a real (object) example —
        invalid for a string, boolean or number parameter, and what Swagger UI would send."""
        schema = super().openapi()
        for ops in schema.get("paths", {}).values():
            for op in ops.values():
                for param in op.get("parameters", []):
                    if param.get("example") == {}:
                        del param["example"]
        return schema


app = ServiceAPI(
    redirect_slashes=False,  # /v1/classify/ is a 404, not a redirect built from the Host header
    redoc_url=None,  # ReDoc loads its script from a CDN; /docs (Swagger UI) does too
    title="mita-serve",
    version=version("mita-serve"),
    description="Classify long sequences with MiTA (Mixture-of-Top-k Attention) or dense "
                "attention; per-stage timings in responses and as Prometheus metrics.",
)
app.router.route_class = StrictJSONRoute
BINARY_PATH = "/v1/classify/binary"
CLASSIFY_PATHS = ("/v1/classify", "/v1/classify/batch", BINARY_PATH)
ARRIVED = "mita_serve.arrived_at"  # ASGI scope key: Unix seconds the request reached the gateway
ROUTED = "mita_serve.routed"  # ASGI scope key: set once a variant is chosen; recorded by _classify
# The query parameters each endpoint takes; on these paths any other is refused (422), so a
# ?variant= sent to the JSON endpoint is not silently ignored. Other paths (the dashboard
# page reads its own ?refresh_s=) are not checked.
QUERY_PARAMS = {("POST", "/v1/classify"): (), ("POST", "/v1/classify/batch"): (),
                ("POST", BINARY_PATH): ("variant", "profile", "dtype"),
                ("GET", "/v1/stats"): ("window_s",)}
MAX_ERRORS_SHOWN = 10


def _error(status: int, message: str, detail=None, headers=None) -> JSONResponse:
    return JSONResponse(ErrorResponse(error=message, detail=detail).model_dump(exclude_none=True),
                        status_code=status, headers=headers)


def route_path(request: Request) -> str:
    """The request's path below the application's route prefix (``/m2/v1/classify`` →
    ``/v1/classify`` under ``route_prefix: /m2``), as Starlette's router matches it: Serve
    passes the prefix as the ASGI ``root_path`` and keeps it in ``path``. Every path-keyed
    rule of the gateway uses this, so none switches off under a prefix."""
    path, root = request.scope["path"], request.scope.get("root_path", "")
    if root and path.startswith(root) and path[len(root):len(root) + 1] in ("", "/"):
        return path[len(root):] or "/"
    return path


def query_refusal(request: Request, path: str) -> tuple[int, str] | None:
    """(422, why) when a checked endpoint (``QUERY_PARAMS``; ``path``: ``route_path``) gets a
    query parameter it does not take, or one parameter more than once (which copy wins is
    ambiguous: refused, as duplicate JSON keys are); else None."""
    known = QUERY_PARAMS.get((request.method, path))  # else routing: 404/405
    if known is None:
        return None
    params = request.query_params
    unknown = sorted(set(params) - set(known))
    if unknown:
        takes = (f"known: {', '.join(known)}" if known else
                 "this endpoint takes none (variant and profile go in the JSON body)")
        return 422, f"unknown query parameter(s) {unknown}; {takes}"
    repeated = sorted(k for k in set(params) if len(params.getlist(k)) > 1)
    if repeated:
        return 422, f"query parameter(s) {repeated} given more than once"
    return None


@app.middleware("http")
async def check_body(request: Request, call_next):
    """Before any parsing: POST bodies to the classify endpoints must be JSON (binary ids for
    ``/v1/classify/binary``) with a Content-Length within the limit (other paths and methods
    go on to routing: 404/405). Stamps the arrival time the response's ``pre_forward_ms`` and
    the request latency count from.

    The one place a classify request refused before routing is counted
    (``requests_total{variant="none"}`` and the stats window), whichever layer refused it:
    this middleware, routing (404/405), parsing, validation or the endpoint's own checks.
    Requests that were routed were recorded with their variant where they were routed."""
    request.scope[ARRIVED] = time.time()
    path = route_path(request)
    response = await _answer(request, call_next, path)
    gateway = replica_state.gateway
    if (gateway is not None and path in CLASSIFY_PATHS
            and not request.scope.get(ROUTED)):
        gateway.recorder.request("none", response.status_code)
    return response


async def _answer(request: Request, call_next, path: str):
    if replica_state.draining and path != "/healthz":
        # shutting down: in-flight requests finish, new ones go elsewhere (liveness stays ok)
        retry = replica_state.gateway.config.retry_after_s if replica_state.gateway else 1
        return _error(503, "the service is shutting down; retry on another instance",
                      headers={"Retry-After": str(retry)})
    refusal = query_refusal(request, path)
    if refusal is not None:
        return _error(*refusal)
    if request.method == "POST" and path in CLASSIFY_PATHS:
        ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
        length = request.headers.get("content-length", "").strip()
        limit = replica_state.max_body_bytes
        want = ("application/octet-stream" if path == BINARY_PATH
                else "application/json")
        encoding = request.headers.get("content-encoding", "identity").strip().lower()
        if len(request.headers.getlist("content-type")) > 1:
            refusal = (400, "more than one Content-Type header")
        elif ctype != want:
            refusal = (415, f"Content-Type must be {want}, got {ctype[:60] or 'none'!r}")
        elif encoding != "identity":
            refusal = (415, f"Content-Encoding {encoding[:40]!r} is not accepted: send the "
                            "body uncompressed")
        elif not length:
            refusal = (411, "a Content-Length header is required (chunked uploads are not "
                            "accepted)" if "transfer-encoding" in request.headers else
                            "the request has no body: send the JSON (or binary ids) with a "
                            "Content-Length header")
        elif not length.isdigit():
            refusal = (400, "invalid Content-Length header")
        elif int(length) > limit:
            refusal = (413, f"request body of {length} bytes exceeds the limit of "
                            f"{limit} bytes")
        if refusal is not None:
            return _error(*refusal)
        replica_state.inflight += 1
        try:
            return await call_next(request)
        finally:
            replica_state.inflight -= 1
    return await call_next(request)


@app.exception_handler(StarletteHTTPException)
async def _http_error(request: Request, exc: StarletteHTTPException):
    return _error(exc.status_code, str(exc.detail), headers=getattr(exc, "headers", None))


@app.exception_handler(RequestValidationError)
async def _validation_error(request: Request, exc: RequestValidationError):
    raw = exc.errors()
    # A 4 MB body can hold ~10^6 bad items: report the first few, and how many there were.
    errors = [{"loc": list(e.get("loc", ())), "msg": e.get("msg", ""), "type": e.get("type")}
              for e in raw[:MAX_ERRORS_SHOWN]]
    more = (f" ({len(raw)} errors; the first {MAX_ERRORS_SHOWN} in detail)"
            if len(raw) > MAX_ERRORS_SHOWN else "")
    if raw and raw[0].get("type") == "json_invalid":
        why = (raw[0].get("ctx") or {}).get("error")
        status, message = 400, f"malformed JSON body: {why}" if why else "malformed JSON body"
    elif any(e["type"] == "missing" and e["loc"] == ["body"] for e in errors):
        what = "'items'" if route_path(request) == "/v1/classify/batch" else "'text' or 'ids'"
        status, message = 400, f"empty request body: send a JSON object with {what}"
        errors = None
    else:
        msg = "; ".join(f"{'.'.join(str(x) for x in e['loc'][1:]) or 'body'}: {e['msg']}"
                        for e in errors[:5])
        status, message = 422, f"invalid request: {msg}{more}"
    return _error(status, message, errors)


@app.exception_handler(ApiError)
async def _api_error(request: Request, exc: ApiError):
    return _error(exc.status, exc.message, headers=exc.headers)


# The dashboard: one page and its script, shipped inside the package (no CDN), read once.
STATIC = files("service") / "static"
DASHBOARD_HTML = (STATIC / "dashboard.html").read_text(encoding="utf-8")
DASHBOARD_JS = (STATIC / "dashboard.js").read_text(encoding="utf-8")
STATIC_HEADERS = {
    "Cache-Control": "no-cache",
    "X-Content-Type-Options": "nosniff",
    "Content-Security-Policy": "default-src 'self'; style-src 'self' 'unsafe-inline'; "
                               "img-src 'self' data:; base-uri 'none'; frame-ancestors 'none'",
}

ERRORS = {code: {"model": ErrorResponse} for code in (400, 411, 413, 415, 422, 500, 503, 504)}


def drop(response, answer: asyncio.Future) -> None:
    """Cancel a classifier call nobody will wait for: the request in Serve (``response``) and
    the task awaiting it (``answer``), whose error would otherwise be logged as never
    retrieved."""
    response.cancel()
    answer.cancel()
    answer.add_done_callback(lambda f: f.cancelled() or f.exception())


@serve.deployment
@serve.ingress(app)
class Gateway:
    """Ingress. ``user_config`` is a ``GatewayConfig`` (A/B weights, sticky header, shadow,
    limits); it can change without a restart."""

    def __init__(self, mita: DeploymentHandle, dense: DeploymentHandle, vocab: Vocabulary):
        self.handles = {"mita": mita, "dense": dense}
        self.vocab = vocab
        self.config = GatewayConfig()
        context = serve.get_replica_context()
        self.live = LiveConfig(GatewayConfig, "deployment 'Gateway' user_config",
                               store_key(context.app_name, context.deployment))
        self.recorder = Recorder()
        replica_state.gateway = self
        self.rng = random.Random()
        # Shadow work is bounded and shed while it would compete with primary work: per
        # variant, the shadow calls in flight from this replica (at most shadow_max_inflight)
        # and the primary calls.
        self._shadow_tasks: dict[str, set[asyncio.Task]] = {v: set() for v in VARIANTS}
        self._primaries = dict.fromkeys(VARIANTS, 0)
        self._variant_info: dict = {}  # last answer of the classifiers' info(), for /v1/stats
        self._variant_info_at = -math.inf
        # classifier_replicas as Serve's controller last reported them (_watch); empty until
        # the first answer and after a failed one, so nothing is refused on a guess.
        self._replicas: dict[str, dict] = {}
        self._replicas_at = -math.inf
        self._watch_task: asyncio.Task | None = None

    def reconfigure(self, config: dict) -> None:
        """Apply a ``user_config`` (``GatewayConfig``, parsed strictly). A live update that is
        refused leaves this replica serving with its last applied config (``LiveConfig``)."""
        if not self.live.update(config):
            return
        self.config = self.live.value
        replica_state.max_body_bytes = self.config.max_body_bytes
        self.recorder.window.retention_s = self.config.stats_window_s

    async def _infos(self, timeout_s: float | None = None) -> list[dict]:
        """Both classifiers' ``info()``, in ``VARIANTS`` order. Raises asyncio.TimeoutError
        after ``timeout_s``, or the classifier's error."""
        return await asyncio.wait_for(asyncio.gather(
            *(asyncio.ensure_future(self.handles[v].info.remote()) for v in VARIANTS)),
            timeout_s)

    async def _watch(self) -> None:
        """Keep ``_replicas`` current: Serve's controller is asked every ``REPLICA_WATCH_S``
        about each classifier's replicas (``_replicas_at``: when the answer was asked for).
        A request's handle call would otherwise wait, with no replica, until one is back or
        ``request_timeout_s`` passes (a lost node's replicas take as long as the node)."""
        while True:
            asked_at = time.monotonic()
            try:
                self._replicas = await fetch_classifier_replicas(10.0)
                self._replicas_at = asked_at
            except Exception:  # controller busy or restarting: no answer is not "none run"
                self._replicas = {}
            await asyncio.sleep(REPLICA_WATCH_S)

    def _unserved(self, variant: str, sent_at: float) -> bool:
        """The controller, asked after a request to ``variant`` was sent at ``sent_at``, had
        no replica of it that takes requests or is still finishing some: the request is
        queued with nowhere to go. Never for a deployment that scales to zero, where a
        request is what starts a replica. (Asked after, not before: a snapshot from just
        before a replica came up would refuse requests it could serve.)"""
        r = self._replicas.get(variant)
        return (self._replicas_at > sent_at and bool(r) and not r["scales_to_zero"]
                and r["serving"] == 0 and r["stopping"] == 0)

    def _no_replica(self, variant: str) -> ApiError:
        return ApiError(503, f"no {variant} classifier replica is running (Serve is starting "
                             "one: it failed, or its node was lost); retry later",
                        {"Retry-After": str(self.config.retry_after_s)})

    async def _call(self, variant: str, ids: np.ndarray, staged: bool = False) -> dict:
        """One call to ``variant``'s classifier; its forward is recorded whenever an answer
        comes back. Raises ApiError: 503 (back-pressure: ``rejected``; the replica died; no
        replica of ``variant`` runs while the request waits: ``_unserved``, within about
        ``REPLICA_WATCH_S`` plus one controller answer), 504 (no answer within
        ``request_timeout_s``), 500 (a replica error, non-finite logits)."""
        if self._watch_task is None or self._watch_task.done():
            self._watch_task = asyncio.create_task(self._watch())
        sent_at = time.monotonic()
        response = self.handles[variant].classify.remote(ids, staged)
        answer = asyncio.ensure_future(response)
        deadline = time.monotonic() + self.config.request_timeout_s
        try:
            while not answer.done():
                left = deadline - time.monotonic()
                if left <= 0:
                    drop(response, answer)
                    raise ApiError(504, f"the {variant} classifier did not answer within "
                                        f"{self.config.request_timeout_s} s")
                await asyncio.wait({answer}, timeout=min(left, REPLICA_WATCH_S))
                if not answer.done() and self._unserved(variant, sent_at):
                    drop(response, answer)
                    raise self._no_replica(variant)
            result = answer.result()
        except asyncio.CancelledError:  # the client went away: so does the request
            drop(response, answer)
            raise
        except BackPressureError:
            raise ApiError(503, f"the {variant} classifier is overloaded; retry later",
                           {"Retry-After": str(self.config.retry_after_s)},
                           rejected=True) from None
        except RayActorError as e:  # the replica died mid-request; Serve replaces it
            raise ApiError(503, f"the {variant} classifier replica failed while handling "
                                f"the request ({type(e).__name__}); retry later",
                           {"Retry-After": str(self.config.retry_after_s)}) from None
        except DeploymentUnavailableError:  # e.g. it failed to deploy: not a bug, a wait
            raise self._no_replica(variant) from None
        except ApiError:
            raise
        except Exception as e:  # a bug in the replica: say so, as JSON, and keep serving
            raise ApiError(500, f"the {variant} classifier failed: "
                                f"{type(e).__name__}") from None
        self.recorder.forward(variant, len(ids), result["profile"], result["replica"])
        if "error" in result:  # e.g. non-finite logits: never a 200 with NaN probabilities
            raise ApiError(500, f"the {variant} classifier failed: {result['error']}")
        return result

    def _start_shadow(self, primary: str, shadow: str, ids: np.ndarray, served: dict) -> bool:
        """Run ``shadow`` on ``ids`` in the background and compare it with the primary's
        answer ``served``, unless ``shadow`` already has ``shadow_max_inflight`` shadow calls
        in flight or primary calls of its own: shed, counted as
        ``shadow_dropped_total{reason="busy"}``. Returns whether it was started."""
        running = self._shadow_tasks[shadow]
        if len(running) >= self.config.shadow_max_inflight or self._primaries[shadow] > 0:
            self.recorder.shadow_dropped(shadow, "busy")
            return False
        task = asyncio.create_task(self._shadow(primary, shadow, ids, served))
        running.add(task)  # counted at once: several primaries can finish in one loop pass
        task.add_done_callback(running.discard)
        return True

    async def _shadow(self, primary: str, shadow: str, ids: np.ndarray, served: dict) -> None:
        try:
            other = await self._call(shadow, ids)
        except ApiError as e:  # the shadow is best effort; the primary already answered
            if e.rejected:
                self.recorder.rejection(shadow, "shadow")
            else:
                self.recorder.shadow_dropped(shadow, "failed")
            return
        self.recorder.shadow(primary, *shadow_comparison(primary, served, other))

    async def _classify(self, ids: np.ndarray, variant: str | None, profile: bool | str,
                        request: Request) -> dict:
        """Route validated ``ids`` (``check_ids``) to ``variant`` or by the A/B policy, record
        the outcome and answer; ``profile``: False, True or ``"staged"`` (the forward times
        every stage apart). Raises ApiError as ``_call``."""
        arrived_at = request.scope[ARRIVED]
        primary, shadow = choose_variant(self.config, variant,
                                         request.headers.get(self.config.sticky_header),
                                         self.rng)
        request.scope[ROUTED] = True
        self._primaries[primary] += 1
        try:
            result = await self._call(primary, ids, profile == "staged")
        except ApiError as e:
            if e.rejected:  # overload refusal: not an error, not in requests_total
                self.recorder.rejection(primary, "primary")
            else:
                self.recorder.request(primary, e.status, override=variant is not None)
            raise
        finally:
            self._primaries[primary] -= 1
        self.recorder.request(primary, 200, len(ids), time.time() - arrived_at,
                              override=variant is not None)
        if shadow is not None and not self._start_shadow(primary, shadow, ids, result):
            shadow = None
        out = {k: result[k] for k in ("label", "probabilities", "variant", "n", "model_id")}
        out["shadow"] = shadow
        if profile:
            # Arrival → forward start: body parsing, validation, the hop to the classifier,
            # batching wait and queueing (both clocks are this machine's wall clock).
            out["profile"] = result["profile"] | {
                "pre_forward_ms": (result["profile"]["started_at"] - arrived_at) * 1e3}
        return out

    @app.post("/v1/classify", response_model=ClassifyResponse, responses=ERRORS,
              response_model_exclude_none=True)
    async def classify(self, body: ClassifyRequest, request: Request) -> dict:
        """Classify one ListOps sequence (``text`` or ``ids``) with MiTA or dense attention."""
        ids = to_ids(body, self.config.max_n, self.vocab)
        return await self._classify(ids, body.variant, body.profile, request)

    @app.post(BINARY_PATH, response_model=ClassifyResponse, responses=ERRORS,
              response_model_exclude_none=True, openapi_extra={"requestBody": {
                  "required": True, "description": "token ids as raw little-endian integers "
                  "(dtype uint8: one byte per token; int32: four), 1 … max_n of them",
                  "content": {"application/octet-stream": {
                      "schema": {"type": "string", "format": "binary"}}}}})
    async def classify_binary(
            self, request: Request,
            variant: Annotated[Variant | None, Query(
                description="force a variant; default: the A/B policy")] = None,
            profile: Annotated[Literal["true", "false", "staged"], Query(
                description="true: return per-stage timings and FLOPs; staged: also time "
                            "every MiTA stage apart in this forward")] = "false",
            dtype: Annotated[Literal["uint8", "int32"], Query(
                description="id width: uint8 (1 byte per token) or int32 (4 bytes)")] = "uint8",
    ) -> dict:
        """Classify one sequence sent as binary token ids (``application/octet-stream``): the
        same answer as ``/v1/classify`` without JSON parsing — 1M ids are 1 MiB as uint8
        instead of ~3.6 MB of JSON."""
        ids = binary_ids(await request.body(), dtype, self.config.max_n, self.vocab)
        mode = {"true": True, "false": False, "staged": "staged"}[profile]
        return await self._classify(ids, variant, mode, request)

    @app.post("/v1/classify/batch", response_model=BatchResponse, responses=ERRORS,
              response_model_exclude_none=True)
    async def classify_batch(self, body: BatchRequest, request: Request) -> dict:
        """Classify many sequences; all items are validated before any is run, and an error
        in one item fails the whole batch (its index is named)."""
        if len(body.items) > self.config.max_batch_items:
            raise ApiError(422, f"{len(body.items)} items exceed max_batch_items = "
                                f"{self.config.max_batch_items}")
        ids = []
        for i, item in enumerate(body.items):
            try:
                ids.append(to_ids(item, self.config.max_n, self.vocab))
            except ApiError as e:
                raise ApiError(e.status, f"items[{i}]: {e.message}") from None
        # One call per item: @serve.batch packs them with whatever else the classifier has
        # queued, and each item is recorded as a request of its own.
        results = await asyncio.gather(
            *(self._classify(x, item.variant, item.profile, request)
              for item, x in zip(body.items, ids, strict=True)),
            return_exceptions=True)
        for i, r in enumerate(results):
            if isinstance(r, ApiError):
                raise ApiError(r.status, f"items[{i}]: {r.message}", r.headers,
                               rejected=r.rejected)
            if isinstance(r, BaseException):
                raise r
        return {"results": results}

    @app.get("/v1/models", responses={503: {"model": ErrorResponse}})
    async def models(self) -> dict:
        """The variants served, their m/k/s and the checkpoint's metadata, the A/B policy in
        force, and whether the gateway's last live update was applied or refused
        (``config_update``; each variant has its own). 503 + Retry-After when a classifier
        does not answer within 10 s."""
        try:
            infos = await self._infos(10.0)
        except Exception as e:  # a classifier restarting, failed or busy: unavailable
            raise ApiError(503, f"a classifier did not answer ({type(e).__name__}); retry "
                                "later", {"Retry-After": str(self.config.retry_after_s)}
                           ) from None
        return {"variants": dict(zip(VARIANTS, infos, strict=True)),
                "ab_policy": json.loads(self.config.model_dump_json()),
                "config_update": self.live.status()}

    def drain(self) -> int:
        """Stop accepting: every new request (but ``/healthz``) gets 503 + Retry-After, and
        ``/readyz`` says not ready, while the classify requests already inside finish.
        Returns how many are in flight (``python -m service`` polls ``inflight`` until 0 or
        its drain time passes, then shuts down)."""
        replica_state.draining = True
        return replica_state.inflight

    def inflight(self) -> int:
        """Classify requests inside this gateway replica now."""
        return replica_state.inflight

    def node_id(self) -> str:
        """The Ray node this gateway replica runs on (hex id): its metrics exporter has the
        service's metrics (``launch.gateway_exporter``)."""
        return ray.get_runtime_context().get_node_id()

    @app.head("/healthz", include_in_schema=False)  # load balancers probe with HEAD
    @app.get("/healthz")
    async def healthz(self) -> dict:
        """Liveness of the gateway."""
        return {"status": "ok"}

    @app.head("/readyz", include_in_schema=False)
    @app.get("/readyz", responses={503: {"model": ErrorResponse}})
    async def readyz(self) -> dict:
        """Ready when each classifier deployment has a replica that takes requests, as Serve's
        controller sees it (``fetch_classifier_replicas``: not a call to the classifiers, so
        the answer never waits behind classify work in their queues). Not ready while
        draining."""
        try:
            replicas = await fetch_classifier_replicas(5.0)
        except Exception as e:  # any failure means not ready; say which
            why = str(e) or ("no answer within 5 s" if isinstance(e, asyncio.TimeoutError)
                             else "")
            raise ApiError(503, f"not ready: {type(e).__name__}: {why}"[:300]) from None
        idle = [CLASSIFIER_DEPLOYMENTS[v] for v, r in replicas.items() if not r["serving"]]
        if idle:
            raise ApiError(503, f"not ready: no running replica of {', '.join(idle)}")
        return {"status": "ready", "variants": list(VARIANTS)}

    async def _variants(self) -> dict:
        """Each variant's model id, device and m/k/s; asked of the classifiers at most once a
        minute (the answer changes only with a redeploy), the last answer kept if they are
        busy."""
        if time.monotonic() - self._variant_info_at > 60:
            try:
                infos = await self._infos(2.0)
            except Exception:  # busy or restarting: keep the last answer, ask again next time
                return self._variant_info
            self._variant_info_at = time.monotonic()
            self._variant_info = {}
            for v, info in zip(VARIANTS, infos, strict=True):
                cfg, mita = info["config"], info["config"]["attention"] == "mita"
                self._variant_info[v] = {
                    "model_id": info["model_id"], "attention": cfg["attention"],
                    "device": info["device"], "dtype": info["dtype"],
                    "m": cfg["num_landmarks"] if mita else None,
                    "k": cfg["topk"] if mita else None, "s": cfg["route_topk"] if mita else None}
        return self._variant_info

    @app.get("/v1/stats", response_model=StatsResponse,
             responses={422: {"model": ErrorResponse}, 502: {"model": ErrorResponse}})
    async def stats(self, window_s: float | None = Query(
            None, gt=0, le=86400, allow_inf_nan=False, description="seconds to summarise, up "
            "to now; default and upper bound in local mode: the gateway's stats_window_s")
    ) -> dict:
        """Per-stage latency (p50/p95) per variant and N bucket, request latency and
        throughput over time, the MiTA/dense latency ratio, shadow agreement, the A/B split and
        the models in use — what ``/dashboard`` shows. From Prometheus when ``prometheus_url``
        is configured (fixed read-only queries; 502 if it does not answer), otherwise from
        this gateway replica's own records."""
        cfg = self.config
        if cfg.prometheus_url is None:  # copy on the event loop, summarise off it
            body = await asyncio.to_thread(summarize, self.recorder.window.snapshot(window_s))
        else:
            try:
                body = await asyncio.to_thread(prometheus_summary, str(cfg.prometheus_url),
                                               window_s or cfg.stats_window_s)
            except PrometheusError as e:
                raise ApiError(502, str(e)[:500]) from None
        # observed: the policy-routed split; requests that named their variant apart
        body["ab"] = ab_split(body.pop("answered"), cfg.weights, cfg.shadow,
                              cfg.sticky_header)
        body["models"] = await self._variants()
        body["stage_colors"] = STAGE_COLORS
        body["variant_colors"] = VARIANT_COLORS
        return body

    @app.get("/dashboard", response_class=HTMLResponse,
             responses={200: {"description": "The live dashboard page (HTML; its script is "
                                             "/dashboard/dashboard.js, its data /v1/stats)."}})
    async def dashboard(self) -> HTMLResponse:
        """Live dashboard: per-stage latency of both variants per N bucket, request latency
        and throughput over time, MiTA/dense ratio, shadow agreement, A/B split, models."""
        return HTMLResponse(DASHBOARD_HTML, headers=STATIC_HEADERS)

    @app.get("/dashboard/dashboard.js", response_class=Response,
             responses={200: {"content": {"text/javascript": {"schema": {"type": "string"}}},
                              "description": "The dashboard's script (plain JS, inline SVG)."}})
    async def dashboard_js(self) -> Response:
        """The dashboard page's script."""
        return Response(DASHBOARD_JS, media_type="text/javascript; charset=utf-8",
                        headers=STATIC_HEADERS)
