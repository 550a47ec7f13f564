"""Per-process state shared by the gateway's FastAPI handlers and its deployment instance.

Serve freezes the ingress app (``service.http``) with cloudpickle when ``service.gateway`` is
imported, and the middleware and exception handlers come along by value, each with a private
copy of any module-level dict. A module object is pickled by reference, so attributes set
here are what the handlers see in the replica process.
"""

from __future__ import annotations

from .settings import GatewayConfig

gateway = None  # the Gateway replica of this process, set in its __init__
max_body_bytes: int = GatewayConfig().max_body_bytes  # kept in step by Gateway.reconfigure
draining: bool = False  # set by Gateway.drain(): new requests get 503 + Retry-After
inflight: int = 0  # classify requests inside the gateway now
