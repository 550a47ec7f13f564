"""A deployment's ``user_config`` as its replica applies it, live updates included.

Serve hands every ``user_config`` change to the replicas' ``reconfigure``, and a replica whose
``reconfigure`` raises is stopped: one bad ``serve deploy`` would take the running version
down. So a replica refuses a bad update instead of raising, keeps serving with the config it
has, and says so: an error in its log, ``config_update`` in its status (``/v1/models``) and,
for the gateway, ``mita_serve_config_updates_total{outcome="refused"}`` (classifier replicas
export no metrics: every series comes from the gateway's node). Only a replica with no config
yet (a new one) raises: it has nothing to keep serving with, and Serve keeps it out of
service.
"""

from __future__ import annotations

import logging
import time

from pydantic import BaseModel

from .metrics import config_updates
from .schemas import validated

log = logging.getLogger("ray.serve")


class LiveConfig:
    """The current ``schema`` value of one deployment's ``user_config``; ``where`` names the
    deployment in messages (e.g. ``"deployment 'Gateway' user_config"``); ``counted``: record
    each update in ``mita_serve_config_updates_total``."""

    def __init__(self, schema: type[BaseModel], where: str, counted: bool = True):
        self.schema, self.where = schema, where
        self.value: BaseModel | None = None
        self.applied_at: float | None = None  # Unix seconds of the last applied update
        self.refused: dict | None = None  # the last refusal since then, or None
        self._counter = config_updates() if counted else None

    def update(self, raw: dict | None) -> bool:
        """Parse ``raw`` strictly and make it the current value; True when applied. A refused
        update of a replica that already has a config returns False and keeps the old one.
        Raises ValueError (naming ``where`` and each refused field) when the replica has no
        config yet."""
        try:
            new = validated(self.schema, raw, self.where)
        except ValueError as e:
            if self.value is None:
                raise
            self.refused = {"error": str(e), "at": time.time()}
            if self._counter is not None:
                self._counter.inc(1, {"outcome": "refused"})
            log.error("mita-serve: live update refused, still serving the previous config: %s",
                      e)
            return False
        self.value, self.applied_at, self.refused = new, time.time(), None
        if self._counter is not None:
            self._counter.inc(1, {"outcome": "applied"})
        return True

    def status(self) -> dict:
        """``{"state": "applied" | "refused", "applied_at": Unix s, "error": why, "at": Unix s}``
        (error and at only when the last update was refused)."""
        out = {"state": "refused" if self.refused else "applied", "applied_at": self.applied_at}
        return out | (self.refused or {})
