"""What the gateway notes about one HTTP request on its way through: the ``RequestBook`` that
the ``CheckBody`` middleware (``service.http``) opens when the request arrives and the
``Gateway`` routes (``service.gateway``) fill in.

The two layers share nothing else per request: the book travels in the request's ASGI scope
under ``SCOPE_KEY``, so a route reaches it from its ``Request`` (``RequestBook.of``) and the
middleware, which wraps the routes, reads it once they have answered. Per-process state (the
draining flag, the limits, the recording of unrouted requests) is ``service.replica_state``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, MutableMapping
from dataclasses import dataclass, field

SCOPE_KEY = "mita_serve"  # the ASGI scope key of the request's book


@dataclass(slots=True, eq=False)
class RequestBook:
    """One request's bookkeeping between the middleware and the routes.

    ``arrived_at``: Unix seconds the request reached the gateway (the response's
    ``pre_forward_ms`` and the request latency count from it). ``routed``: a variant was
    chosen for it, so ``Gateway._classify`` records its outcome; a classify request never
    routed is recorded by the middleware instead. ``after_response``: callables (the recording
    of an answered request) the middleware runs once the response has been handed to Serve,
    so the client does not wait for them. ``forward_ms``: the served forward's ``total_ms``,
    for the response's ``Server-Timing`` header; None until a forward has answered."""

    arrived_at: float
    routed: bool = False
    after_response: list[Callable[[], object]] = field(default_factory=list)
    forward_ms: float | None = None

    @classmethod
    def open(cls, scope: MutableMapping, arrived_at: float | None = None) -> RequestBook:
        """A new book for the request of ``scope``, stored in it; ``arrived_at`` defaults to
        now."""
        book = scope[SCOPE_KEY] = cls(time.time() if arrived_at is None else arrived_at)
        return book

    @staticmethod
    def of(scope: MutableMapping) -> RequestBook:
        """The book ``open`` stored in ``scope`` (KeyError when there is none)."""
        return scope[SCOPE_KEY]

    def run_after_response(self) -> None:
        """Run the ``after_response`` callables, in the order they were added, once: the
        list is emptied first, so a second run finds nothing."""
        calls, self.after_response = self.after_response, []
        for call in calls:
            call()

    def server_timing(self) -> str | None:
        """The ``Server-Timing`` header's value, ``forward;dur=<ms>`` (W3C Server Timing),
        or None before a forward has answered."""
        return None if self.forward_ms is None else f"forward;dur={self.forward_ms:.3f}"
