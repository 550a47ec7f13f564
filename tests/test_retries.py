"""The gateway's resend of a classification whose replica failed (``Gateway._call``), on
scripted handle answers: Serve cannot be made to kill a replica at an exact moment, so each
failure here is the exception Serve's handle raises for it (``ActorDiedError`` when the
replica died mid-request, ``DeploymentUnavailableError`` when none could take it). The real
thing, a replica killed under load, is ``test_reliability.test_replica_killed_mid_load``."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from ray.exceptions import ActorDiedError
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError

from service.forward_stats import ForwardStats
from service.gateway import Gateway
from service.inputs import ApiError
from service.schemas import GatewayConfig

from .helpers import spied_recorder


class Call:
    """What ``handle.classify.remote(...)`` returns: awaitable, cancellable."""

    def __init__(self, outcome):
        self.outcome, self.cancelled = outcome, False

    def cancel(self):
        self.cancelled = True

    def __await__(self):
        async def answer():
            if isinstance(self.outcome, float):  # never answers in time
                await asyncio.sleep(self.outcome)
            if isinstance(self.outcome, BaseException):
                raise self.outcome
            return self.outcome
        return answer().__await__()


class Scripted:
    """A classifier handle answering from a script, one entry per call."""

    def __init__(self, *script):
        self.script, self.calls = list(script), []

    def remote(self, ids, staged):
        self.calls.append(Call(self.script.pop(0)))
        return self.calls[-1]


def answer() -> dict:
    stats = ForwardStats(device="cpu", dtype="float32", staged=True, batch_size=1, padded_n=3,
                         total_ms=1.0, stages_ms={"attention": 1.0}, layers_ms=[],
                         flops={"attention": 10}, flops_total=10, gflops_per_s={},
                         peak_memory_bytes=None, peak_memory_kind=None, started_at=0.0)
    return {"label": 1, "probabilities": [0.5, 0.5], "variant": "mita", "n": 3,
            "model_id": "m", "profile": stats, "replica": "r2"}


def gateway(handle: Scripted, timeout_s: float = 5.0):
    g = object.__new__(Gateway.func_or_class)  # no replica: only what _call reads
    g.config = GatewayConfig(request_timeout_s=timeout_s)
    g.recorder = spied_recorder()
    g._classify_calls = {"mita": handle}
    return g


def retries(g) -> list:
    return [(v, t["reason"]) for _, v, t in g.recorder.metrics.retries.calls]


def died() -> ActorDiedError:
    return ActorDiedError()


IDS = np.array([3, 4, 5])


def test_a_call_whose_replica_died_is_sent_again_and_answered():
    handle = Scripted(died(), DeploymentUnavailableError("mita"), answer())
    g = gateway(handle)
    result = asyncio.run(g._call("mita", IDS))
    assert result["label"] == 1 and result["replica"] == "r2"
    assert len(handle.calls) == 3
    assert retries(g) == [(1, "replica_died"), (1, "unavailable")]


def test_a_shadow_call_is_never_sent_again():
    handle = Scripted(died(), answer())
    g = gateway(handle)
    with pytest.raises(ApiError) as e:
        asyncio.run(g._call("mita", IDS, retry=False))
    assert e.value.status == 503 and len(handle.calls) == 1 and retries(g) == []
    assert e.value.message == ("the mita classifier replica failed while handling the "
                               "request (ActorDiedError); retry later")


def test_no_resend_once_the_deadline_is_too_close():
    # 0.3 s deadline: resends after 0.05, 0.1, 0.2 s of backoff would pass it; the call
    # gives up with a 503 once less than the next backoff is left.
    handle = Scripted(*[died()] * 20)
    g = gateway(handle, timeout_s=0.3)
    with pytest.raises(ApiError) as e:
        asyncio.run(g._call("mita", IDS))
    assert e.value.status == 503 and e.value.headers == {"Retry-After": "1"}
    assert "too little of request_timeout_s (0.3 s) was left to send it again" in e.value.message
    assert len(handle.calls) == 3 and len(retries(g)) == 2  # sent at 0, 0.05, 0.15 s


def test_back_pressure_and_timeouts_are_not_resent():
    handle = Scripted(BackPressureError(num_queued_requests=1, max_queued_requests=1))
    g = gateway(handle)
    with pytest.raises(ApiError) as e:
        asyncio.run(g._call("mita", IDS))
    assert e.value.rejected and e.value.status == 503 and len(handle.calls) == 1
    handle = Scripted(10.0)
    g = gateway(handle, timeout_s=0.1)
    with pytest.raises(ApiError) as e:
        asyncio.run(g._call("mita", IDS))
    assert e.value.status == 504 and handle.calls[0].cancelled and retries(g) == []
