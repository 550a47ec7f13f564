"""The gateway's resend of a classification whose replica failed (``Gateway._call``), on
scripted handle answers: Serve cannot be made to kill a replica at an exact moment, so each
failure here is the exception Serve's handle raises for it (``ActorDiedError`` when the
replica died mid-request, ``ActorUnavailableError`` when it became unreachable,
``DeploymentUnavailableError`` when the deployment failed or is deleted). The real thing, a
replica killed under load, is ``test_reliability.test_replica_killed_mid_load`` and, in Ray's
throughput mode, ``test_readme.test_readme_walkthrough`` (``make serve``'s mode)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from ray.exceptions import ActorDiedError, ActorUnavailableError
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError

from service import calls
from service.gateway import Gateway
from service.inputs import ApiError
from service.settings import GatewayConfig

from ..fakes import Scripted, answer, spied_recorder


def gateway(handle: Scripted, timeout_s: float = 5.0):
    g = object.__new__(Gateway.func_or_class)  # no replica: only what _call reads
    g.config = GatewayConfig(request_timeout_s=timeout_s)
    g.recorder = spied_recorder()
    g._classify_calls = {"mita": handle}
    return g


def retries(g) -> list:
    """(variant, reason) of each retries_total increment, each by 1."""
    made = g.recorder.metrics.retries.calls
    assert all(value == 1 for _, value, _ in made)
    return [(t["variant"], t["reason"]) for _, _, t in made]


def died() -> ActorDiedError:
    return ActorDiedError()


IDS = np.array([3, 4, 5])


def unavailable() -> ActorUnavailableError:
    return ActorUnavailableError("the replica's node is gone", None)




@pytest.fixture
def slow_backoff(monkeypatch):
    """Backoff 0.5 s doubling to 2 s: the deadline tests' arithmetic survives a sleep that
    overshoots by a few hundred ms on a loaded machine."""
    monkeypatch.setattr(calls, "RETRY_BACKOFF_S", 0.5)
    monkeypatch.setattr(calls, "MAX_RETRY_BACKOFF_S", 2.0)


def test_a_call_whose_replica_died_is_sent_again_and_answered():
    handle = Scripted(died(), unavailable(), answer())
    g = gateway(handle)
    result = asyncio.run(g._call("mita", IDS))
    assert result["label"] == 1 and result["replica"] == "r2"
    assert len(handle.calls) == 3
    assert retries(g) == [("mita", "replica_died"), ("mita", "replica_unavailable")]


def test_resends_stop_after_max_resends():
    # a request that kills every replica it reaches: sent 1 + MAX_RESENDS = 4 times, not for
    # the whole deadline
    handle = Scripted(*[died()] * 10)
    g = gateway(handle, timeout_s=60)
    with pytest.raises(ApiError) as e:
        asyncio.run(g._call("mita", IDS))
    assert calls.MAX_RESENDS == 3 and len(handle.calls) == 4
    assert retries(g) == [("mita", "replica_died")] * 3
    assert e.value.status == 503 and e.value.message == (
        "the mita classifier replica failed while handling the request (ActorDiedError); "
        "sent 4 times; retry later")


def test_an_unavailable_deployment_is_answered_at_once():
    # failed to deploy or deleted: Serve raises at once, and waiting cannot help
    handle = Scripted(DeploymentUnavailableError("mita"), answer())
    g = gateway(handle)
    with pytest.raises(ApiError) as e:
        asyncio.run(g._call("mita", IDS))
    assert e.value.status == 503 and len(handle.calls) == 1 and retries(g) == []
    assert e.value.headers == {"Retry-After": "1"}
    assert e.value.message.startswith("no mita classifier replica is running")


def test_a_shadow_call_is_never_sent_again():
    handle = Scripted(died(), answer())
    g = gateway(handle)
    with pytest.raises(ApiError) as e:
        asyncio.run(g._call("mita", IDS, retry=False))
    assert e.value.status == 503 and len(handle.calls) == 1 and retries(g) == []
    assert e.value.message == ("the mita classifier replica failed while handling the "
                               "request (ActorDiedError); retry later")


def test_no_resend_once_the_deadline_is_too_close(slow_backoff):
    # 3 s deadline, backoff 0.5 then 1 s: sent at 0, 0.5, 1.5 s; the third failure leaves
    # 1.5 s, less than the next backoff (2 s): a 503, not a resend that could not finish
    handle = Scripted(*[died()] * 10)
    g = gateway(handle, timeout_s=3.0)
    with pytest.raises(ApiError) as e:
        asyncio.run(g._call("mita", IDS))
    assert e.value.status == 503 and e.value.headers == {"Retry-After": "1"}
    assert "too little of request_timeout_s (3.0 s) was left to send it again" in e.value.message
    assert len(handle.calls) == 3 and len(retries(g)) == 2


def test_a_client_that_leaves_during_the_backoff_sends_nothing_more(slow_backoff):
    handle = Scripted(died(), answer())
    g = gateway(handle)

    async def leave_during_backoff():
        call = asyncio.ensure_future(g._call("mita", IDS))
        await asyncio.sleep(0.2)  # the first call failed; the 0.5 s backoff runs
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
    asyncio.run(leave_during_backoff())
    assert len(handle.calls) == 1 and retries(g) == []  # counted only when sent


def test_a_client_that_leaves_during_a_resend_cancels_it():
    handle = Scripted(died(), 10.0)
    g = gateway(handle)

    async def leave():
        call = asyncio.ensure_future(g._call("mita", IDS))
        await asyncio.sleep(0.3)  # resent after 0.05 s; the resend hangs
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
    asyncio.run(leave())
    assert len(handle.calls) == 2 and handle.calls[1].cancelled
    assert retries(g) == [("mita", "replica_died")]


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
