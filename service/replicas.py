"""The classifiers' replicas as Serve's controller reports them: what ``/readyz`` answers
from. Never asked on a classification's path: a request to a classifier with no replica left
waits, within its deadline, for Serve's replacement (``Gateway._call``).
"""

from __future__ import annotations

import asyncio

from ray import serve

from .schemas import DEPLOYMENTS, VARIANTS

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
