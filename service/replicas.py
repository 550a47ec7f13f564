"""The classifiers' replicas as Serve's controller reports them: what ``/readyz`` answers
from. Never asked on a classification's path: a request to a classifier with no replica left
waits, within its deadline, for Serve's replacement (``Gateway._call``). And the classifiers'
live-config refusals as a gateway metric (``watch_classifier_configs``): classifier replicas
export no metrics, so that one scrape target has them all.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time

from ray import serve

from .metrics import GAUGE_REFRESH_S, classifier_config_refused_gauge
from .settings import DEPLOYMENTS, VARIANTS

log = logging.getLogger("ray.serve")

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


def watch_classifier_configs(handles: dict, app_name: str, period_s: float = GAUGE_REFRESH_S,
                             timeout_s: float = 5.0) -> threading.Thread:
    """Start a daemon thread that, every ``period_s`` seconds, asks one replica of each
    classifier (``handles``: variant → DeploymentHandle) for its ``info()["config_update"]``
    and sets ``mita_serve_classifier_config_refused{variant}`` from it. A variant with no
    serving replica (``min_replicas: 0``, or being replaced) is not asked — asking would start
    one — and keeps its last value; so does one that does not answer within ``timeout_s``
    (busy: its info call queues behind classify work)."""
    from ray.serve.context import _get_global_client

    gauge = classifier_config_refused_gauge()
    last = dict.fromkeys(VARIANTS, 0.0)

    def ask(variant: str) -> None:
        try:  # a thread of its own: no event loop here, so the handle's sync result()
            info = handles[variant].info.remote().result(timeout_s=timeout_s)
            last[variant] = float(info["config_update"]["state"] == "refused")
        except Exception as e:  # busy, restarting: the last value stands
            log.debug("mita-serve: %s classifier config state not read (%s)", variant,
                      type(e).__name__)

    def watch() -> None:
        while True:
            time.sleep(period_s)
            try:
                replicas = classifier_replicas(_get_global_client().get_serve_details(),
                                               app_name)
            except Exception:  # controller busy or the app being deleted: ask next time
                replicas = {}
            for variant in VARIANTS:
                if replicas.get(variant, {}).get("serving"):
                    ask(variant)
                gauge.set(last[variant], {"variant": variant})  # set again: Ray drops stale

    thread = threading.Thread(target=watch, daemon=True, name="classifier-config-watch")
    thread.start()
    return thread
