"""A running service, from its driver (``python -m service``): how long its drain may take,
the drain itself, and whether it was stopped from outside (Ray, Serve or an application
gone)."""

from __future__ import annotations

import logging
import socket
import threading
import time

import ray
from ray import serve
from ray.serve.schema import ServeDeploySchema

from .launch import driver_handle
from .settings import DEPLOYMENTS


def drain_time_s(config: ServeDeploySchema) -> float:
    """How long a shutdown lets in-flight requests finish: the Gateway deployment's
    ``graceful_shutdown_timeout_s`` (Serve's own graceful-shutdown setting; 20 s when unset)."""
    for app in config.applications:
        for dep in app.deployments:
            if dep.name == DEPLOYMENTS["gateway"]:
                value = dep.model_dump(exclude_unset=True).get("graceful_shutdown_timeout_s")
                if isinstance(value, int | float):
                    return float(value)
    return 20.0


def drain(config: ServeDeploySchema, timeout_s: float | None = None) -> int:
    """Stop accepting (the gateway answers new requests 503 + Retry-After) and wait until the
    classify requests inside have finished, at most ``timeout_s`` (default
    ``drain_time_s(config)``). Returns how many were still in flight (0: none lost).
    The drain state lives in each gateway replica and a handle call reaches one of them: with
    several Gateway replicas only one would drain (the shipped configs run one)."""
    timeout_s = drain_time_s(config) if timeout_s is None else timeout_s
    deadline = time.monotonic() + timeout_s
    left = 0
    for app in config.applications:
        gateway = driver_handle(DEPLOYMENTS["gateway"], app.name)
        left = gateway.drain.remote().result(timeout_s=10)
        while left > 0 and time.monotonic() < deadline:
            time.sleep(0.2)
            left = gateway.inflight.remote().result(timeout_s=10)
    return left


def gone(config: ServeDeploySchema, status_timeout_s: float = 10.0) -> str | None:
    """Why the service is no longer running under this process, or None while it is: Ray's
    GCS stopped answering (``ray stop`` on this machine, the cluster gone), Serve was shut down
    (``serve shutdown``) or one of ``config``'s applications deleted (``serve delete``) from
    outside. A Serve status that takes over ``status_timeout_s`` (a busy controller) counts as
    running. Called every few seconds by ``python -m service`` while it serves: the driver
    would otherwise wait on, serving nothing, or be aborted by Ray's core worker after 60 s
    without its GCS."""
    host, port = ray.get_runtime_context().gcs_address.rsplit(":", 1)
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=2.0).close()
    except OSError as e:
        return (f"Ray's GCS at {host}:{port} is gone ({e.strerror or type(e).__name__}): Ray "
                "was stopped from outside (ray stop?)")
    if _asking and _asking[-1].is_alive():
        return None  # the last question is still unanswered: a busy controller, not gone
    result: list = []
    _asking[:] = [threading.Thread(target=lambda: result.append(_serve_apps()), daemon=True)]
    _asking[0].start()
    _asking[0].join(status_timeout_s)
    if not result:
        return None
    apps = result[0]
    if isinstance(apps, Exception):
        return (f"Serve was shut down from outside (serve shutdown?): "
                f"{type(apps).__name__}: {str(apps).splitlines()[0] if str(apps) else ''}")
    missing = [app.name for app in config.applications if app.name not in apps]
    if missing:
        return (f"application(s) {', '.join(repr(n) for n in missing)} deleted from outside "
                "(serve delete or serve shutdown?)")
    return None


_asking: list[threading.Thread] = []  # gone()'s last question to Serve


def _serve_apps() -> dict[str, str] | Exception:
    """Serve's applications and their status, or the exception asking for them raised."""
    try:
        return {name: getattr(app.status, "value", str(app.status))
                for name, app in serve.status().applications.items()}
    except Exception as e:  # the controller killed (serve shutdown): RayActorError …
        return e


class DeadControllerPolls(logging.Filter):
    """Drops the traceback asyncio logs when a Serve handle's long poll in this driver fails
    ("Exception in callback LongPollClient._poll_next()"): it fails only when Serve's
    controller is unreachable, i.e. Ray or Serve was stopped from outside (``ray stop``: "Can't
    find actor ... It might be dead"), which ``gone`` says in one line. Any other record
    passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.exc_info and "LongPollClient._poll_next" in record.getMessage())


def quiet_dead_controller_polls() -> None:
    """Install ``DeadControllerPolls`` on the ``asyncio`` logger (where asyncio's default
    exception handler logs), once."""
    log = logging.getLogger("asyncio")
    if not any(isinstance(f, DeadControllerPolls) for f in log.filters):
        log.addFilter(DeadControllerPolls())
