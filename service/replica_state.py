"""Per-process state shared by the gateway's FastAPI handlers and its deployment instance.

Serve freezes the ingress app (``service.http``) with cloudpickle when ``service.gateway`` is
imported, and the middleware and exception handlers come along by value, each with a private
copy of any module-level dict. A module object is pickled by reference, so attributes set
here are what the handlers see in the replica process.

The ``Gateway`` replica of this process (``__init__``, ``reconfigure``, ``drain``) puts here
exactly what the handlers need of it, never the replica itself; ``CheckBody`` counts
``inflight``. What the two layers note about one request travels with it instead, in its ASGI
scope (``service.request_book``).
"""

from __future__ import annotations

from collections.abc import Callable

from .settings import GatewayConfig


def _record_nothing(status: int) -> None:
    """``record_unrouted`` of a process with no Gateway replica: nothing to record into."""


# A classify request answered ``status`` without being routed to a variant: counted as
# variant "none"; set by Gateway.__init__ to its recorder's.
record_unrouted: Callable[[int], None] = _record_nothing
max_body_bytes: int = GatewayConfig().max_body_bytes  # kept in step by Gateway.reconfigure
retry_after_s: int = GatewayConfig().retry_after_s  # Retry-After while draining; likewise
draining: bool = False  # set by Gateway.drain(): new requests get 503 + Retry-After
inflight: int = 0  # classify requests inside the gateway now
