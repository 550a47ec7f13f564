"""The gateway's own per-request work, piece by piece, in this process (no HTTP, no Serve).

    python benchmarks/gateway_pieces.py [--n 64 1024 16384] [--repeats 2000]

Times, per request and for N token ids (median of ``--repeats`` calls after 100 warm-ups),
each piece of work ``service.gateway`` and ``service.http`` do around the classifier call,
on a real request and a real classifier answer (the shipped checkpoint's MiTA engine):

- ``middleware``: ``CheckBody``'s checks (route path, query parameters, the body headers);
- ``parse JSON + ids`` / ``parse binary + ids``: the strict JSON parse, the pydantic request
  model and ``to_ids`` (vocabulary, length), or ``binary_ids``;
- ``A/B choice``: ``choose_variant``;
- ``recorder``: ``Recorder.forward`` and ``Recorder.request`` (Ray's metric calls, the stats
  window) — Ray is started locally so the metrics are Ray's real ones;
- ``response``: the answer's JSON body as the endpoints build it (``gateway.response_body``
  rendered by ``JSONResponse``), and beside it what they did before: the full answer
  validated against ``response_model`` with None left out, then rendered.

- ``classifier call``: one awaited call that answers on the loop's next pass, under the
  request's deadline as ``calls.call_classifier`` awaits it (``calls.Deadline``) and as it did
  before (a task of its own and ``asyncio.wait``), side by side.
- ``middleware mechanism``: one request through a FastAPI app whose middleware does nothing,
  written as Starlette's ``BaseHTTPMiddleware`` (``@app.middleware("http")``, what
  ``CheckBody`` was) and as a plain ASGI middleware (what it is), side by side.

Serve's own work (the HTTP proxy, the handle call, the replica's request handling) is not
here: ``benchmarks/serve_overhead.py`` measures it against a bare Serve app.
"""

import asyncio
import dataclasses
import json
import random
import time

import numpy as np

from mita.tools.argtypes import Parser


def median_us(fn, repeats: int) -> float:
    for _ in range(100):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter_ns()
        fn()
        times.append(time.perf_counter_ns() - t0)
    return float(np.median(times)) / 1e3


def middleware_mechanism(repeats: int) -> dict[str, float]:
    """µs per request through an app with a do-nothing middleware of each kind."""
    import httpx
    from fastapi import FastAPI

    def app_with(kind: str) -> FastAPI:
        app = FastAPI()

        @app.get("/x")
        async def x() -> dict:
            return {"ok": 1}
        if kind == "BaseHTTPMiddleware":
            @app.middleware("http")
            async def passthrough(request, call_next):
                return await call_next(request)
        else:
            class Passthrough:
                def __init__(self, inner):
                    self.inner = inner

                async def __call__(self, scope, receive, send):
                    await self.inner(scope, receive, send)
            app.add_middleware(Passthrough)
        return app

    async def per_request(app: FastAPI) -> float:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://t") as c:
            for _ in range(100):
                await c.get("/x")
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter_ns()
                await c.get("/x")
                times.append(time.perf_counter_ns() - t0)
        return float(np.median(times)) / 1e3
    kinds = ("BaseHTTPMiddleware", "plain ASGI")
    apps = {k: app_with(k) for k in kinds}
    out = {k: [] for k in kinds}
    for _ in range(3):  # interleaved rounds
        for k in kinds:
            out[k].append(asyncio.run(per_request(apps[k])))
    return {k: float(np.median(v)) for k, v in out.items()}


def call_mechanism(repeats: int) -> dict[str, float]:
    """µs per awaited classifier call under a deadline, on a stand-in for the handle's
    response that answers on the loop's next pass: awaited in the request's task under
    ``calls.Deadline`` (what ``calls.call_classifier`` does), and through a task of its own and
    ``asyncio.wait`` with a timeout (what it did before)."""
    from service.calls import Deadline

    async def response():
        answer = asyncio.get_running_loop().create_future()
        asyncio.get_running_loop().call_soon(answer.set_result, 1)
        return await answer

    async def under_deadline():
        deadline = Deadline(60.0)
        try:
            return await response()
        finally:
            deadline.cancel()

    async def task_and_wait():
        answer = asyncio.ensure_future(response())
        done, _ = await asyncio.wait({answer}, timeout=60.0)
        return answer.result()

    async def per_call(fn) -> float:
        for _ in range(100):
            await fn()
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter_ns()
            await fn()
            times.append(time.perf_counter_ns() - t0)
        return float(np.median(times)) / 1e3
    kinds = {"Deadline": under_deadline, "task + asyncio.wait (before)": task_and_wait}
    out = {k: [] for k in kinds}
    for _ in range(3):  # interleaved rounds
        for k, fn in kinds.items():
            out[k].append(asyncio.run(per_call(fn)))
    return {k: float(np.median(v)) for k, v in out.items()}


def main() -> None:
    p = Parser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, nargs="+", default=[64, 1024, 16384])
    p.add_argument("--repeats", type=int, default=2000)
    a = p.parse_args()

    import ray
    import torch
    from fastapi.responses import JSONResponse
    from starlette.requests import Request

    from mita.config import checkpoint_metadata
    from mita.data.task import checkpoint_task
    from mita.data.vocab import Vocabulary
    from service.engine import ClassifierEngine
    from service.gateway import response_body
    from service.http import refusal_of, route_path
    from service.inputs import StrictJSONRequest, binary_ids, to_ids
    from service.policy import choose_variant
    from service.recorder import Recorder
    from service.schemas import ClassifyRequest, ClassifyResponse
    from service.settings import GatewayConfig

    ray.init(num_cpus=1, include_dashboard=False, logging_level="error")
    engine = ClassifierEngine("checkpoints/listops-default", "mita", "cpu")
    meta = checkpoint_metadata("checkpoints/listops-default")
    task = checkpoint_task(meta, engine.model.config, "checkpoints/listops-default")
    cfg = engine.model.config
    vocab = Vocabulary(cfg.vocab_size, cfg.pad_id)
    gateway = GatewayConfig()
    recorder = Recorder()
    rng = random.Random(0)
    rows = []
    def measure(n: int) -> dict[str, float]:
        ids = np.random.default_rng(n).integers(1, 16, n).astype(np.uint8)
        body = json.dumps({"ids": ids.tolist(), "variant": "mita", "profile": True}).encode()
        headers = [(b"content-type", b"application/json"),
                   (b"content-length", str(len(body)).encode())]
        scope = {"type": "http", "method": "POST", "path": "/v1/classify", "root_path": "",
                 "query_string": b"", "headers": headers}

        def middleware():
            request = Request(scope)
            refusal_of(request, route_path(request))

        loop = asyncio.new_event_loop()

        def parse_json_ids():
            async def receive():
                return {"type": "http.request", "body": body, "more_body": False}

            async def go():
                req = ClassifyRequest.model_validate(await StrictJSONRequest(scope,
                                                                              receive).json())
                return to_ids(req, gateway.max_n, vocab)
            loop.run_until_complete(go())

        raw = ids.tobytes()
        answer = engine.run([to_ids(ClassifyRequest(ids=ids.tolist()), gateway.max_n,
                                    vocab)])[0]
        arrived = time.time()

        def response():
            return JSONResponse(response_body(answer, None, arrived, task.labels)).body

        def response_model():
            # what the endpoints did before: the full answer through FastAPI's
            # response_model=ClassifyResponse, response_model_exclude_none=True
            stats = answer["profile"]
            out = {k: answer[k] for k in ("label", "probabilities", "variant", "n",
                                          "model_id")}
            out["shadow"] = None
            out["label_name"] = task.labels[answer["label"]]
            out["profile"] = {f.name: getattr(stats, f.name)
                              for f in dataclasses.fields(stats)}
            out["profile"] |= {name: getattr(stats, name) for name in (
                "flops_total", "stages_ms", "layers_ms", "gflops_per_s")}
            out["profile"]["pre_forward_ms"] = (stats.started_at - arrived) * 1e3
            return JSONResponse(ClassifyResponse.model_validate(out).model_dump(
                mode="json", exclude_none=True)).body

        pieces = {
            "middleware": middleware,
            "parse JSON + ids": parse_json_ids,
            "parse binary + ids": lambda: binary_ids(raw, "uint8", gateway.max_n, vocab),
            "A/B choice": lambda: choose_variant(gateway, None, None, rng),
            "recorder": lambda: (recorder.forward("mita", n, answer["profile"], "r"),
                                 recorder.request("mita", 200, n, 0.01)),
            "response": response,
            "response via response_model (before)": response_model,
        }
        return {name: median_us(fn, a.repeats) for name, fn in pieces.items()}

    for n in a.n:
        rows.append((n, measure(n)))
        print(n, rows[-1][1], flush=True)
    ray.shutdown()
    mech = middleware_mechanism(a.repeats // 2)
    print("\nmiddleware mechanism, µs per request through a one-route FastAPI app (median "
          "of 3 interleaved rounds): " + ", ".join(f"{k} {v:.0f}" for k, v in mech.items())
          + f"; difference {mech['BaseHTTPMiddleware'] - mech['plain ASGI']:.0f}")
    call = call_mechanism(a.repeats)
    print("classifier call under the request's deadline, µs per awaited call (median of 3 "
          "interleaved rounds): " + ", ".join(f"{k} {v:.1f}" for k, v in call.items()))
    print(f"\nper request, µs (median of {a.repeats}); MiTA answer with profile; torch "
          f"{torch.__version__}, cpu\n")
    names = list(rows[0][1])
    print("| N | " + " | ".join(names) + " | sum (JSON) |")
    print("|---|" + "---|" * (len(names) + 1))
    for n, t in rows:
        total = sum(v for k, v in t.items()
                    if k not in ("parse binary + ids", "response via response_model (before)"))
        print(f"| {n} | " + " | ".join(f"{t[k]:.0f}" for k in names) + f" | {total:.0f} |")


if __name__ == "__main__":
    main()
