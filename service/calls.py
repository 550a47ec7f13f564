"""The gateway's call of a classifier deployment: the request's deadline, the resends when
the replica holding a call fails, and every failure as the ``ApiError`` its client gets."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import numpy as np
from grpc import StatusCode
from grpc.aio import AioRpcError
from ray.exceptions import ActorDiedError, RayActorError
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError

from .inputs import ApiError
from .settings import GatewayConfig

# A resent classification waits this long first, doubling up to the maximum: Serve learns of
# a dead replica from the failed call itself, and of its replacement within a health check.
RETRY_BACKOFF_S = 0.05
MAX_RETRY_BACKOFF_S = 1.0
# At most this many resends of one request: a request that itself kills its replica (a crash,
# an OOM kill) must not take down every replacement, and the requests beside it, for the
# whole deadline.
MAX_RESENDS = 3
# In Ray's throughput mode calls between deployments go over gRPC; Ray turns UNAVAILABLE into
# ActorUnavailableError, and these other codes of a call cut by a dying replica come as they are.
REPLICA_LOST_CODES = (StatusCode.UNAVAILABLE, StatusCode.UNKNOWN, StatusCode.INTERNAL,
                      StatusCode.ABORTED)


class Deadline:
    """Cancels the running task in ``delay_s`` seconds, as ``asyncio.timeout`` (Python 3.11+)
    does: a classifier call is awaited in the request's own task, with no task of its own
    and no ``asyncio.wait`` (~20 µs a request less on the loop). ``expired``: this cancelled
    the task (not the client leaving); ``uncancel`` then takes that cancel back before the
    caller answers 504. ``cancel`` when the call is over."""

    __slots__ = ("expired", "_task", "_handle")

    def __init__(self, delay_s: float):
        self.expired, self._task = False, asyncio.current_task()
        self._handle = asyncio.get_running_loop().call_later(max(0.0, delay_s), self._expire)

    def _expire(self) -> None:
        self.expired = True
        self._task.cancel()

    def uncancel(self) -> None:
        if hasattr(self._task, "uncancel"):  # 3.11+ counts cancel requests
            self._task.uncancel()

    def cancel(self) -> None:
        self._handle.cancel()


async def call_classifier(classify, variant: str, ids: np.ndarray, staged: bool,
                          config: GatewayConfig,
                          on_resend: Callable[[str], None] | None = None) -> dict:
    """The answer of ``classify`` (a classifier deployment's ``classify`` handle method) for
    ``ids``, within ``config.request_timeout_s``. Classification is idempotent, so with
    ``on_resend`` (primary calls; never shadow ones) a call whose replica failed while
    holding it (``RayActorError``: the actor died or became unreachable; in Ray's
    throughput mode also a gRPC error of the call) is sent again, at most ``MAX_RESENDS``
    times, while the deadline allows: Serve routes it to a live replica, or holds it until
    the replacement runs. ``on_resend(reason)`` is called as each resend is sent
    (``replica_died`` | ``replica_unavailable``). Raises ApiError: 503 (back-pressure:
    ``rejected``; the deployment is unavailable — failed to deploy or deleted: waiting
    cannot help; the replica failed and the resends or the time ran out), 504 (no answer
    within ``request_timeout_s``), 500 (a replica error, a gRPC error that is not a lost
    replica)."""
    timeout_s = config.request_timeout_s
    deadline = time.monotonic() + timeout_s
    backoff_s, resends = RETRY_BACKOFF_S, 0
    while True:
        response = classify.remote(ids, staged)
        expiry = Deadline(deadline - time.monotonic())
        try:
            try:
                result = await response
            finally:
                expiry.cancel()
            break
        except asyncio.CancelledError:  # the deadline, or the client went away
            response.cancel()  # the request in Serve goes too
            if not expiry.expired:
                raise
            expiry.uncancel()
            raise ApiError(504, f"the {variant} classifier did not answer within "
                                f"{timeout_s} s") from None
        except BackPressureError:
            raise ApiError(503, f"the {variant} classifier is overloaded; retry later",
                           {"Retry-After": str(config.retry_after_s)},
                           rejected=True) from None
        except DeploymentUnavailableError:  # failed to deploy, or deleted: not a wait
            raise ApiError(503, f"no {variant} classifier replica is running (its "
                                "deployment is unavailable: it failed to deploy or is "
                                "being deleted); retry later",
                           {"Retry-After": str(config.retry_after_s)}) from None
        except (RayActorError, AioRpcError) as e:
            # The replica died or became unreachable mid-request; Serve replaces it.
            if isinstance(e, AioRpcError) and e.code() not in REPLICA_LOST_CODES:
                raise ApiError(500, f"the {variant} classifier call failed: gRPC "
                                    f"{e.code().name}") from None
            reason = ("replica_died" if isinstance(e, ActorDiedError)
                      else "replica_unavailable")
            left = deadline - time.monotonic()
            if on_resend is None or resends == MAX_RESENDS or left <= backoff_s:
                why = ("" if on_resend is None else
                       f"; sent {resends + 1} times" if resends == MAX_RESENDS else
                       f"; too little of request_timeout_s ({timeout_s} s) was left to "
                       "send it again")
                raise ApiError(503, f"the {variant} classifier replica failed while "
                                    f"handling the request ({type(e).__name__}){why}; "
                                    "retry later",
                               {"Retry-After": str(config.retry_after_s)}) from None
            await asyncio.sleep(backoff_s)
            backoff_s = min(2 * backoff_s, MAX_RETRY_BACKOFF_S)
            resends += 1
            on_resend(reason)
        except ApiError:
            raise
        except Exception as e:  # a bug in the replica: say so, as JSON, and keep serving
            raise ApiError(500, f"the {variant} classifier failed: "
                                f"{type(e).__name__}") from None
    return result
