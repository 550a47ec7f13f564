"""Gateway deployment: the ingress's routes, the A/B policy and the recording of outcomes
(its FastAPI app and the refusals before routing: ``service.http``; input parsing and id
checks: ``service.inputs``; the classifiers' replicas for ``/readyz``: ``service.replicas``).

(No ``from __future__ import annotations`` here: FastAPI must see the real types of the
endpoint parameters of the ingress class.)

Request path: HTTP → pydantic model → validation and the cut to the trained length (before
any tensor exists) → A/B policy → classifier deployment handle (``mita`` or ``dense``) →
response; in shadow mode the other variant runs too and the two answers are compared. Every
outcome goes through one ``service.recorder.Recorder`` into Prometheus and the
``StatsWindow`` that ``/v1/stats`` summarises for the ``/dashboard`` page (or Prometheus does,
when ``prometheus_url`` is configured). A classify request refused before routing is counted
once, by the ``CheckBody`` middleware, whichever layer refused it; a routed one is recorded by
``_classify``.
"""


import asyncio
import json
import math
import random
import time
from functools import partial
from typing import Annotated, Literal

import numpy as np
import ray
from fastapi import Query, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response
from ray import serve
from ray.serve.handle import DeploymentHandle

from mita.data.task import Task
from mita.hooks import STAGE_COLORS, VARIANT_COLORS

from . import replica_state
from .calls import call_classifier
from .http import (
    BINARY_PATH,
    CLASSIFY_RESPONSES,
    DASHBOARD_HTML,
    DASHBOARD_JS,
    ERRORS,
    STATIC_HEADERS,
    app,
)
from .inputs import ApiError, Served, served_binary, served_ids
from .live_config import LiveConfig, store_key
from .policy import choose_variant, shadow_comparison
from .recorder import Recorder
from .replicas import fetch_classifier_replicas, watch_classifier_configs
from .request_book import RequestBook
from .routing import check_warm_start
from .schemas import (
    BatchRequest,
    BatchResponse,
    ClassifyRequest,
    ClassifyResponse,
    ErrorResponse,
    RoutingResponse,
    StatsResponse,
    profile_body,
)
from .settings import DEPLOYMENTS, VARIANTS, GatewayConfig, Variant
from .stats import PrometheusError, ab_split, prometheus_summary, summarize


def response_body(result: dict, shadow: str | None, arrived_at: float | None,
                  labels: tuple[str, ...], cut: dict | None = None) -> dict:
    """A classifier's answer ``result`` as the JSON of ``ClassifyResponse`` with None left
    out (what FastAPI's response-model serialisation makes of it, without validating it
    again): ``shadow`` the variant run in shadow, or None; with ``arrived_at`` (the gateway's
    wall clock at the request's arrival, Unix seconds) the forward's ``profile``, whose
    ``pre_forward_ms`` counts from it (body parsing, validation, the hop to the classifier,
    batching wait and queueing; both clocks are this machine's). ``labels``: the task's label
    names by class index (``label_name``). ``cut``: ``original_n`` and ``truncated`` of a
    sequence cut to the task's trained length (``inputs.Served.report``), else None or
    empty."""
    out = {"label": result["label"], "label_name": labels[result["label"]]}
    out |= {k: result[k] for k in ("probabilities", "variant", "n")}
    if cut:
        out |= cut
    out["model_id"] = result["model_id"]
    if shadow is not None:
        out["shadow"] = shadow
    if arrived_at is not None:
        out["profile"] = profile_body(result["profile"], arrived_at)
    return out


def classify_response(body: dict, request: Request) -> JSONResponse:
    """The response of a single classification: ``body`` (``response_body``, already the
    response model's JSON form — FastAPI's validation would only copy it) with a
    ``Server-Timing`` header (W3C Server Timing: browsers' developer tools and load testers
    read it) giving the forward's milliseconds, ``forward;dur=…``, which is the profile's
    ``total_ms`` (the request book's ``forward_ms``) — so a client can tell the service's own
    time from the model's without asking for the whole profile."""
    timing = RequestBook.of(request.scope).server_timing()
    return JSONResponse(body, headers={"server-timing": timing} if timing else None)


@serve.deployment
@serve.ingress(app)
class Gateway:
    """Ingress. ``user_config`` is a ``GatewayConfig`` (A/B weights or policy auto, sticky
    header, shadow, limits); it can change without a restart."""

    def __init__(self, mita: DeploymentHandle, dense: DeploymentHandle, task: Task,
                 mita_setting: str | None = None):
        self.handles = {"mita": mita, "dense": dense}
        # the served MiTA setting as advisor reports name it: policy auto's warm start reads
        # that row of a report
        self.mita_setting = mita_setting
        # handle.classify makes a new handle on every access: made once here.
        self._classify_calls = {v: h.classify for v, h in self.handles.items()}
        self.task, self.vocab = task, task.vocab
        task.tokenizer.warm()  # a pretrained model's tokenizer loads here, not in a request
        self.config = GatewayConfig()
        context = serve.get_replica_context()
        self.live = LiveConfig(GatewayConfig, f"deployment {context.deployment!r} user_config",
                               store_key(context.app_name, context.deployment),
                               check=lambda c: check_warm_start(c, mita_setting))
        self.recorder = Recorder()
        watch_classifier_configs(self.handles, context.app_name)
        # what the HTTP layer needs of this replica (service.replica_state): the recording
        # of the classify requests it answers without routing them
        replica_state.record_unrouted = partial(self.recorder.request, "none")
        self.rng = random.Random()
        # Shadow work is bounded and shed while it would compete with primary work: per
        # variant, the shadow calls in flight from this replica (at most shadow_max_inflight)
        # and the primary calls.
        self._shadow_tasks: dict[str, set[asyncio.Task]] = {v: set() for v in VARIANTS}
        self._primaries = dict.fromkeys(VARIANTS, 0)
        self._variant_info: dict = {}  # last answer of the classifiers' info(), for /v1/stats
        self._variant_info_at = -math.inf

    def reconfigure(self, config: dict) -> None:
        """Apply a ``user_config`` (``GatewayConfig``, parsed strictly). A live update that is
        refused leaves this replica serving with its last applied config (``LiveConfig``)."""
        if not self.live.update(config):
            return
        self.config = self.live.value
        replica_state.max_body_bytes = self.config.max_body_bytes
        replica_state.retry_after_s = self.config.retry_after_s
        self.recorder.window.retention_s = self.config.stats_window_s
        self.recorder.routing.configure(self.config.auto, self.mita_setting)

    async def _infos(self, timeout_s: float | None = None) -> list[dict]:
        """Both classifiers' ``info()``, in ``VARIANTS`` order. Raises asyncio.TimeoutError
        after ``timeout_s``, or the classifier's error."""
        return await asyncio.wait_for(asyncio.gather(
            *(asyncio.ensure_future(self.handles[v].info.remote()) for v in VARIANTS)),
            timeout_s)

    async def _call(self, variant: str, ids: np.ndarray, staged: bool = False,
                    retry: bool = True, after: list | None = None) -> dict:
        """One classification by ``variant``'s classifier (``calls.call_classifier``: the
        deadline ``request_timeout_s``, with ``retry`` — primary calls, never shadow ones — the
        resends when its replica fails, each counted in ``retries_total``); its forward is
        recorded whenever an answer comes back. Raises ApiError as ``call_classifier``, and
        500 for an answer with an error (non-finite logits). ``after``: the forward's
        recording of an answer without error is appended here instead of run at once
        (the request book's ``after_response``: ``service.request_book``)."""
        result = await call_classifier(
            self._classify_calls[variant], variant, ids, staged, self.config,
            partial(self.recorder.retry, variant) if retry else None)
        record = partial(self.recorder.forward, variant, len(ids), result["profile"],
                         result["replica"])
        if "error" in result:  # e.g. non-finite logits: never a 200 with NaN probabilities
            record()
            raise ApiError(500, f"the {variant} classifier failed: {result['error']}")
        if after is None:
            record()
        else:
            after.append(record)
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
            other = await self._call(shadow, ids, retry=False)
        except ApiError as e:  # the shadow is best effort; the primary already answered
            if e.rejected:
                self.recorder.rejection(shadow, "shadow")
            else:
                self.recorder.shadow_dropped(shadow, "failed")
            return
        self.recorder.shadow(primary, *shadow_comparison(primary, served, other), len(ids))

    async def _classify(self, ids: np.ndarray, variant: str | None, profile: bool | str,
                        request: Request, cut: dict | None = None) -> dict:
        """Route validated ``ids`` (``inputs.checked``) to ``variant``, or by the A/B policy
        (weights, sticky header, or ``policy: auto``'s decision for its N bucket:
        ``service.routing``), record the outcome and answer; ``profile``: False, True or
        ``"staged"`` (the forward times every stage apart); ``cut``: the answer's fields about
        the cut to the trained length (``Served.report``). Raises ApiError as ``_call``."""
        book = RequestBook.of(request.scope)
        arrived_at = book.arrived_at
        client_key = request.headers.get(self.config.sticky_header)
        primary, shadow = choose_variant(self.config, variant, client_key, self.rng)
        if self.config.policy == "auto" and variant is None and not client_key:
            # an explicit variant and the sticky header win; else the bucket's decision, and
            # a share of the requests shadowed to the other variant to keep its evidence
            primary, reason, explore = self.recorder.routing.decide(len(ids))
            if self.config.shadow or self.rng.random() < explore:
                shadow = next(v for v in VARIANTS if v != primary)
            else:
                shadow = None
            self.recorder.routed(len(ids), primary, reason)
        book.routed = True
        self._primaries[primary] += 1
        # the answer's recording runs once the response is out (CheckBody)
        after = book.after_response
        try:
            result = await self._call(primary, ids, profile == "staged", after=after)
        except ApiError as e:
            if e.rejected:  # overload refusal: not an error, not in requests_total
                self.recorder.rejection(primary, "primary")
            else:
                self.recorder.request(primary, e.status, override=variant is not None)
            raise
        finally:
            self._primaries[primary] -= 1
        book.forward_ms = result["profile"].total_ms
        after.append(partial(self.recorder.request, primary, 200, len(ids),
                             time.time() - arrived_at, override=variant is not None))
        if shadow is not None and not self._start_shadow(primary, shadow, ids, result):
            shadow = None
        return response_body(result, shadow, arrived_at if profile else None, self.task.labels,
                             cut)

    def _fits(self, served: Served) -> Served:
        """``served``, or ApiError(422) when the model cannot take its length once cut (a grid
        model: exactly H·W tokens, as training checked them after its cut)."""
        why = self.task.length_refusal(len(served.ids))
        if why is not None:
            raise ApiError(422, why)
        return served

    @app.post("/v1/classify", response_model=ClassifyResponse, responses=CLASSIFY_RESPONSES,
              response_model_exclude_none=True)
    async def classify(self, body: ClassifyRequest, request: Request) -> JSONResponse:
        """Classify one sequence (``text``, tokenized as the checkpoint says, or ``ids``) with MiTA
        or dense attention."""
        served = self._fits(served_ids(body, self.config.max_n, self.vocab,
                                       self.task.tokenizer, self.task))
        out = await self._classify(served.ids, body.variant, body.profile, request,
                                   served.report())
        return classify_response(out, request)

    @app.post(BINARY_PATH, response_model=ClassifyResponse, responses=CLASSIFY_RESPONSES,
              response_model_exclude_none=True, openapi_extra={"requestBody": {
                  "required": True, "description": "token ids as raw little-endian integers "
                  "(dtype uint8: one byte per token; int32: four); 1 … max_n of them once cut "
                  "to the model's trained length (/v1/models: task.max_length)",
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
    ) -> JSONResponse:
        """Classify one sequence sent as binary token ids (``application/octet-stream``): the
        same answer as ``/v1/classify`` without JSON parsing — 1M ids are 1 MiB as uint8
        instead of ~3.6 MB of JSON."""
        served = self._fits(served_binary(await request.body(), dtype, self.config.max_n,
                                          self.vocab, self.task))
        mode = {"true": True, "false": False, "staged": "staged"}[profile]
        return classify_response(await self._classify(served.ids, variant, mode, request,
                                                      served.report()), request)

    @app.post("/v1/classify/batch", response_model=BatchResponse, responses=ERRORS,
              response_model_exclude_none=True)
    async def classify_batch(self, body: BatchRequest, request: Request) -> dict:
        """Classify many sequences; all items are validated before any is run, and an error
        in one item fails the whole batch (its index is named)."""
        if len(body.items) > self.config.max_batch_items:
            raise ApiError(422, f"{len(body.items)} items exceed max_batch_items = "
                                f"{self.config.max_batch_items}")
        served = []
        for i, item in enumerate(body.items):
            try:
                served.append(self._fits(served_ids(item, self.config.max_n, self.vocab,
                                                    self.task.tokenizer, self.task)))
            except ApiError as e:
                raise ApiError(e.status, f"items[{i}]: {e.message}") from None
        # One call per item: @serve.batch packs them with whatever else the classifier has
        # queued, and each item is recorded as a request of its own.
        results = await asyncio.gather(
            *(self._classify(x.ids, item.variant, item.profile, request, x.report())
              for item, x in zip(body.items, served, strict=True)),
            return_exceptions=True)
        for i, r in enumerate(results):
            if isinstance(r, ApiError):
                raise ApiError(r.status, f"items[{i}]: {r.message}", r.headers,
                               rejected=r.rejected)
            if isinstance(r, BaseException):
                raise r
        return {"results": results}

    @app.get("/v1/routing", response_model=RoutingResponse)
    async def routing(self) -> dict:
        """Policy ``auto``'s decisions per N bucket, with the evidence behind each: both
        variants' median forward times and counts, MiTA's label agreement with dense (its
        Wilson lower bound and the number of shadow comparisons), the mean KL, the reason, and
        whether a warm start's prior still stands in. Shown under either policy (``policy``
        says which routes requests); this gateway replica's own evidence."""
        return self.recorder.routing.report(self.config.policy)

    @app.get("/v1/models", responses={503: {"model": ErrorResponse}})
    async def models(self) -> dict:
        """The task (name, label names, tokenizer, trained length), the variants served, their
        m/k/s and the checkpoint's metadata, the A/B policy in
        force, and whether the gateway's last live update was applied or refused
        (``config_update``; each variant has its own). 503 + Retry-After when a classifier
        does not answer within 10 s."""
        try:
            infos = await self._infos(10.0)
        except Exception as e:  # a classifier restarting, failed or busy: unavailable
            raise ApiError(503, f"a classifier did not answer ({type(e).__name__}); retry "
                                "later", {"Retry-After": str(self.config.retry_after_s)}
                           ) from None
        return {"task": self.task.info(), "variants": dict(zip(VARIANTS, infos, strict=True)),
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
        idle = [DEPLOYMENTS[v] for v, r in replicas.items() if not r["serving"]]
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
                              cfg.sticky_header, cfg.policy)
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
