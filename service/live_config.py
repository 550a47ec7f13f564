"""A deployment's ``user_config`` as its replica applies it, live updates included.

Serve hands every ``user_config`` change to the replicas' ``reconfigure``, and a replica whose
``reconfigure`` raises is stopped: one bad ``serve deploy`` would take the running version
down. So a replica refuses a bad update instead of raising, keeps serving with the config it
has, and says so: an error in its log, ``config_update`` in its status (``/v1/models``) and,
for the gateway, ``mita_serve_config_updates_total{outcome="refused"}`` and the gauge
``mita_serve_config_refused`` (classifier replicas export no metrics: every series comes from
the gateway's node).

Serve keeps the refused config as the deployment's target, so every replica that starts
later (a crash, a scale-up, a lost node) is handed it too. The last applied config of each
deployment is therefore kept in Ray's cluster-wide key-value store (``store_key``), and such
a replica starts on it, refusing the bad one the same way. Only a replica with neither (the
first deploy of a bad config) raises, and Serve keeps it out of service.
"""

from __future__ import annotations

import logging
import threading
import time

from pydantic import BaseModel

from .metrics import GAUGE_REFRESH_S, config_refused_gauge, config_updates
from .settings import validated

log = logging.getLogger("ray.serve")


def store_key(app_name: str, deployment: str) -> bytes:
    """The key of a deployment's last applied ``user_config`` in Ray's key-value store."""
    return f"mita-serve/{app_name}/{deployment}/user_config".encode()


class LiveConfig:
    """The current ``schema`` value of one deployment's ``user_config``.

    ``where`` names the deployment in messages (e.g. ``"deployment 'Gateway' user_config"``);
    ``key``: where the last applied value is kept (``store_key``; None: not kept, e.g.
    without Ray); ``counted``: export ``mita_serve_config_updates_total`` and
    ``mita_serve_config_refused`` (the gateway's); ``check``: called with each parsed value,
    raises ValueError to refuse what the schema alone cannot see (e.g. a file it names)."""

    def __init__(self, schema: type[BaseModel], where: str, key: bytes | None = None,
                 counted: bool = True, check=None):
        self.schema, self.where, self.key, self.check = schema, where, key, check
        self.value: BaseModel | None = None
        self.applied_at: float | None = None  # Unix seconds of the last applied update
        self.refused: dict | None = None  # the last refusal since then, or None
        self._counter = config_updates() if counted else None
        if counted:
            self._gauge = config_refused_gauge()
            threading.Thread(target=self._keep_gauge, daemon=True,
                             name="config-refused-gauge").start()

    def update(self, raw: dict | None) -> bool:
        """Parse ``raw`` strictly; True when the current value changed (the caller applies
        ``value``). A refused update keeps the current value, or, in a replica that has none
        yet, takes the deployment's last applied one from the store. Raises ValueError
        (naming ``where`` and each refused field) when there is neither."""
        try:
            new = validated(self.schema, raw, self.where)
            if self.check is not None:
                try:
                    self.check(new)
                except ValueError as e:
                    raise ValueError(f"{self.where}: {e}") from None
        except ValueError as e:
            changed = False
            if self.value is None:
                self.value = self._stored()
                if self.value is None:
                    raise
                changed = True
            self.refused = {"error": str(e), "at": time.time()}
            self._count("refused")
            log.error("mita-serve: live update refused, serving the last applied config: %s",
                      e)
            return changed
        self.value, self.applied_at, self.refused = new, time.time(), None
        self._count("applied")
        self._store(new)
        return True

    def status(self) -> dict:
        """``{"state": "applied" | "refused", "applied_at": Unix s, "error": why, "at": Unix s}``
        (error and at only when the last update was refused; applied_at None when this replica
        started on the stored config)."""
        out = {"state": "refused" if self.refused else "applied", "applied_at": self.applied_at}
        return out | (self.refused or {})

    def _count(self, outcome: str) -> None:
        if self._counter is not None:
            self._counter.inc(1, {"outcome": outcome})
            self._gauge.set(float(self.refused is not None))

    def _keep_gauge(self) -> None:
        while True:
            time.sleep(GAUGE_REFRESH_S)
            self._gauge.set(float(self.refused is not None))

    def _store(self, value: BaseModel) -> None:
        # Ray (2.60) has no public cluster-wide key-value API. internal_kv is what Serve's own
        # controller checkpoints to (serve._private.storage.kv_store, through the GCS client);
        # the public alternative, a detached named actor holding the configs, would be one
        # more process per application that must outlive every replica and be deleted with
        # the application, for a few hundred bytes. The underscore functions stay, each call
        # wrapped: the store is a fallback and serving goes on without it.
        if self.key is None:
            return
        try:
            from ray.experimental import internal_kv

            internal_kv._internal_kv_put(self.key, value.model_dump_json().encode(),
                                         overwrite=True)
        except Exception as e:  # the store is a fallback; serving goes on without it
            log.warning("mita-serve: could not keep the applied config (%s: %s)",
                        type(e).__name__, e)

    def _stored(self) -> BaseModel | None:
        if self.key is None:
            return None
        try:
            from ray.experimental import internal_kv

            raw = internal_kv._internal_kv_get(self.key)
            return None if raw is None else self.schema.model_validate_json(raw)
        except Exception as e:
            log.warning("mita-serve: could not read the last applied config (%s: %s)",
                        type(e).__name__, e)
            return None
