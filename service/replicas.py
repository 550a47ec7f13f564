"""The gateway's watch of its classifiers' replicas, as Serve's controller reports them: what
``/readyz`` answers from, and what lets a request whose classifier has no replica left fail
fast (503) instead of waiting out ``request_timeout_s``.
"""

from __future__ import annotations

import asyncio
import math
import time

from ray import serve

from .inputs import ApiError
from .schemas import DEPLOYMENTS, VARIANTS

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
    for variant in VARIANTS:
        dep = deployments[DEPLOYMENTS[variant]]
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


class ReplicaWatch:
    """Serve's controller's view of each classifier's replicas, asked every ``REPLICA_WATCH_S``
    by a task on the gateway replica's event loop (``start``)."""

    def __init__(self):
        # classifier_replicas as Serve's controller last reported them (_watch); empty until
        # the first answer and after a failed one, so nothing is refused on a guess.
        self.replicas: dict[str, dict] = {}
        self.replicas_at = -math.inf
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        """Start the watch unless it runs (again, if it ended); from the event loop."""
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._watch())

    async def _watch(self) -> None:
        """Keep ``replicas`` current: Serve's controller is asked every ``REPLICA_WATCH_S``
        about each classifier's replicas (``replicas_at``: when the answer was asked for).
        A request's handle call would otherwise wait, with no replica, until one is back or
        ``request_timeout_s`` passes (a lost node's replicas take as long as the node)."""
        while True:
            asked_at = time.monotonic()
            try:
                self.replicas = await fetch_classifier_replicas(10.0)
                self.replicas_at = asked_at
            except Exception:  # controller busy or restarting: no answer is not "none run"
                self.replicas = {}
            await asyncio.sleep(REPLICA_WATCH_S)

    def unserved(self, variant: str, sent_at: float) -> bool:
        """The controller, asked after a request to ``variant`` was sent at ``sent_at``, had
        no replica of it that takes requests or is still finishing some: the request is
        queued with nowhere to go. Never for a deployment that scales to zero, where a
        request is what starts a replica. (Asked after, not before: a snapshot from just
        before a replica came up would refuse requests it could serve.)"""
        r = self.replicas.get(variant)
        return (self.replicas_at > sent_at and bool(r) and not r["scales_to_zero"]
                and r["serving"] == 0 and r["stopping"] == 0)


def no_replica(variant: str, retry_after_s: int) -> ApiError:
    return ApiError(503, f"no {variant} classifier replica is running (Serve is starting "
                         "one: it failed, or its node was lost); retry later",
                    {"Retry-After": str(retry_after_s)})
