"""What the request path does around a forward, on CPU without Ray: the response body the
gateway builds without FastAPI's response-model pass, the recording of an answer after the
response is handed over, and where a classifier replica runs a forward (on its event loop or
its forward thread). The speed these buy is measured in ``benchmarks/serve_overhead.py``."""

from __future__ import annotations

import asyncio
import dataclasses
import pickle
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from fastapi.responses import JSONResponse

from mita.records import ForwardProfile, StageRecord
from service.classifier import INLINE_MAX_N, Classifier
from service.engine import ClassifierEngine
from service.gateway import response_body
from service.http import CheckBody
from service.request_book import RequestBook
from service.schemas import ClassifyResponse, profile_body

from ..helpers import CHECKPOINT


@pytest.fixture(scope="module")
def engine():
    return ClassifierEngine(CHECKPOINT, "mita", "cpu", cuda_graphs=False)


# label names by class index, as a user's checkpoint holds them (mita.data.task)
NAMES = ("zero", "one", "two", "class three", "four", "five", "six", "seven", "eight", "nine")


def ids_of(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(1, 16, n).astype(np.uint8)


def model_json(result: dict, shadow: str | None, arrived_at: float | None) -> bytes:
    """What FastAPI makes through ``response_model=ClassifyResponse,
    response_model_exclude_none=True`` of the answer in full: every field, None included,
    and every field of the forward's profile, with the sums computed from its records."""
    full = {k: result[k] for k in ("label", "probabilities", "variant", "n", "model_id")}
    full["label_name"] = NAMES[result["label"]]
    full["shadow"] = shadow
    if arrived_at is not None:
        prof = result["profile"]
        full["profile"] = {f.name: getattr(prof, f.name) for f in dataclasses.fields(prof)}
        full["profile"] |= {name: getattr(prof, name) for name in (
            "flops_total", "stages_ms", "layers_ms", "gflops_per_s")}
        full["profile"]["pre_forward_ms"] = (prof.started_at - arrived_at) * 1e3
    return JSONResponse(ClassifyResponse.model_validate(full)
                        .model_dump(mode="json", exclude_none=True)).body


def test_response_body_is_the_response_models_json(engine):
    result = engine.run([ids_of(64)])[0] | {"replica": "r1"}
    prof = result["profile"]
    arrived_at = prof.started_at - 0.0125
    for shadow in (None, "dense"):
        for at in (None, arrived_at):
            body = response_body(result, shadow, at, NAMES)
            assert JSONResponse(body).body == model_json(result, shadow, at)  # keys, order, floats
            assert ("shadow" in body) == (shadow is not None)
            assert ("profile" in body) == (at is not None)
    profile = response_body(result, None, arrived_at, NAMES)["profile"]
    # Unix seconds near 1.8e9 are float64 to ~2.4e-7 s: 1e-3 ms covers the two roundings
    assert profile["pre_forward_ms"] == pytest.approx(12.5, abs=1e-3)
    # internal fields stay out; None (no Triton top-k here) is left out, as the model did
    assert not {"started_at", "cuda_graph", "topk_path"} & set(profile)
    assert profile["total_ms"] == prof.total_ms and profile["peak_memory_bytes"] > 0


def test_response_body_of_a_profile_with_none_and_a_topk_path():
    prof = ForwardProfile(device="cuda:0", dtype="bfloat16", staged=False, batch_size=2,
                          padded_n=4096, total_ms=0.75,
                          records=[StageRecord("attention", 0, 0.25),
                                   StageRecord("attention", 1, 0.25)],
                          flops={"attention": 12}, started_at=100.0, cuda_graph=True,
                          topk_path="select")
    result = {"label": 3, "probabilities": [0.25, 0.75], "variant": "mita", "n": 4000,
              "model_id": "m@1", "profile": prof, "replica": "r"}
    body = response_body(result, "dense", 99.5, NAMES)
    assert (body["label"], body["label_name"]) == (3, "class three")
    assert JSONResponse(body).body == model_json(result, "dense", 99.5)
    assert body["profile"]["topk_path"] == "select" and body["profile"]["pre_forward_ms"] == 500
    assert "peak_memory_bytes" not in body["profile"]


def test_the_shipped_profile_reads_as_the_timers_after_the_trip_to_the_gateway():
    """The classifier ships the stage records, not the per-stage and per-layer tables: those
    are computed when the gateway first reads them, and equal what the timer's profile says.
    The records travel as plain tuples (a named tuple is pickled by reference to its class,
    ~4× slower on the answer's path)."""
    prof = ForwardProfile(
        records=[StageRecord("embed", None, 0.5), StageRecord("qkv_proj", 0, 1.25),
                 StageRecord("attention", 0, 2.0), StageRecord("qkv_proj", 1, 0.75)],
        total_ms=5.0, device="cpu", flops={"embed": 1000, "qkv_proj": 4_000_000, "attention": 0})
    shipped = prof.shipped(dtype="float32", staged=True, batch_size=1, padded_n=64,
                           started_at=1.0)
    back = pickle.loads(pickle.dumps(shipped))
    for s in (shipped, back):
        assert s.stages_ms == {"embed": 0.5, "qkv_proj": 2.0, "attention": 2.0}
        assert s.layers_ms == [{"qkv_proj": 1.25, "attention": 2.0}, {"qkv_proj": 0.75}]
        # 1000 FLOPs in 0.5 ms = 0.002 GFLOP/s; 4e6 in 2 ms = 2; no FLOPs: left out
        assert s.gflops_per_s == {"embed": 0.002, "qkv_proj": 2.0}
        assert s.flops_total == 4_001_000 and s.total_ms == 5.0
    assert [type(r) for r in back.records] == [tuple] * 4
    assert profile_body(back, 0.5)["stages_ms"] == prof.stages_ms


def test_check_body_records_after_the_response_is_handed_over():
    order = []

    async def app(scope, receive, send):
        RequestBook.of(scope).after_response.append(lambda: order.append("recorded"))
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    async def send(message):
        order.append(message["type"])

    async def receive():
        return {"type": "http.request", "body": b"{}", "more_body": False}

    scope = {"type": "http", "method": "POST", "path": "/v1/classify", "root_path": "",
             "query_string": b"", "headers": [(b"content-type", b"application/json"),
                                              (b"content-length", b"2")]}

    async def main():
        await CheckBody(app)(scope, receive, send)
        assert order == ["http.response.start", "http.response.body"]  # not yet
        await asyncio.sleep(0)
        assert order == ["http.response.start", "http.response.body", "recorded"]
    asyncio.run(main())


def replica(engine) -> tuple[Classifier, list[str]]:
    """A classifier replica's request handling on a real engine (no Serve: only what
    ``classify`` reads) and the name of the thread each of its forwards ran on."""
    c = object.__new__(Classifier.func_or_class)
    c.engine, c.deterministic = engine, True
    c._forward_thread = ThreadPoolExecutor(1, thread_name_prefix="forward")
    c._inside, c._pending, c._ran = 0, 0, set()
    c.info_dict = {"replica": "r1"}
    threads = []
    run = engine.run

    class Spied:  # the real engine, noting where each forward runs
        def __getattr__(self, name):
            return getattr(engine, name)

        def run(self, *args, **kwargs):
            threads.append(threading.current_thread().name)
            return run(*args, **kwargs)
    c.engine = Spied()
    return c, threads


def test_a_lone_short_request_runs_on_the_loop_once_its_length_ran(engine):
    c, threads = replica(engine)
    loop_thread = threading.current_thread().name  # asyncio.run runs the loop here
    x, long = ids_of(64), ids_of(INLINE_MAX_N + 1)

    async def main():
        return [await c.classify(x), await c.classify(x), await c.classify(long),
                await c.classify(long)]
    got = asyncio.run(main())
    # a first length goes to the thread (a first forward may compile or capture); longer
    # than INLINE_MAX_N always does
    assert threads == ["forward_0", loop_thread, "forward_0", "forward_0"]
    want = engine.run([x, long])
    assert [r["probabilities"] for r in got] == [want[0]["probabilities"]] * 2 + [
        want[1]["probabilities"]] * 2  # bit-identical wherever it ran
    assert c._pending == 0 and c._inside == 0 and got[1]["replica"] == "r1"


def test_with_padded_batching_every_forward_keeps_the_thread(engine):
    # a forward holding the loop would keep requests from gathering into a batch
    c, threads = replica(engine)
    c.deterministic = False
    x = ids_of(64)

    async def main():
        return [await c.classify(x) for _ in range(3)]
    got = asyncio.run(main())
    assert threads == ["forward_0"] * 3 and c._ran == {64}
    assert got[2]["probabilities"] == engine.run([x])[0]["probabilities"]


def test_a_request_beside_another_or_a_running_job_goes_to_the_thread(engine):
    c, threads = replica(engine)
    x, long = ids_of(64), ids_of(8192)

    async def main():
        await c.classify(x)  # its length has run: alone, the next one of it would go inline
        first = asyncio.create_task(c.classify(long))
        while len(threads) < 2:  # the long forward has started in the thread
            await asyncio.sleep(0.001)
        beside = await c.classify(x)  # another request inside: to the thread, after it
        await first
        gone = asyncio.create_task(c.classify(long))
        while len(threads) < 4:
            await asyncio.sleep(0.001)
        gone.cancel()  # its caller leaves; its forward goes on in the thread
        with pytest.raises(asyncio.CancelledError):
            await gone
        assert c._inside == 0 and c._pending == 1
        after = await c.classify(x)  # alone, but the thread is still busy: queued behind
        while c._pending:
            await asyncio.sleep(0.001)
        return beside, after
    beside, after = asyncio.run(main())
    assert threads == ["forward_0"] * 5
    assert beside["probabilities"] == after["probabilities"] == engine.run([x])[0][
        "probabilities"]
