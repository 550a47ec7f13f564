"""Slow and stalled clients cost their own connection only: deadlines in Ray Serve's HTTP proxy.

Without them, a client that sent its headers and then stalled in its body held one of the
Gateway replica's ``max_ongoing_requests`` (256) until Serve's ``request_timeout_s`` (180 s),
answered then with a plain-text 408: 256 such connections froze ``/healthz``, ``/readyz`` and
``/v1/classify`` for every other client. The proxy now

- reads a request's whole body before the request goes on to a replica, within
  ``BODY_TIMEOUT_S`` in all and ``BODY_IDLE_S`` between two pieces; a body later than that is
  answered ``408`` (JSON) and the connection closed, no replica ever sees it. At most
  ``MAX_BODIES_READING`` bodies are read at once (more: ``503`` JSON with ``Retry-After``);
- closes a connection whose request headers are not complete within ``HEADER_TIMEOUT_S`` of
  its first byte, or of the connection, with a JSON ``408`` (uvicorn has no such deadline);
- answers a new connection beyond ``MAX_CONNECTIONS`` open ones with ``503`` (JSON) at once;
- answers a request uvicorn cannot parse (e.g. a broken ``Content-Length``) with the
  documented JSON ``400`` instead of uvicorn's plain text.

Each refusal is counted in ``mita_serve_proxy_refusals_total{reason}`` (Prometheus: ``ray_``
prefix), ``reason`` ∈ ``REASONS``.

Installed through Ray Serve's proxy hook: ``RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH=
service.proxy_guard:middlewares`` in the environment of the Ray nodes (``service.launch``
sets it for the Ray it starts; a cluster's nodes need it set when started). The callback runs
in the proxy process, before its HTTP server starts: it adds the body middleware and sets the
header deadline and the connection bound on uvicorn's httptools protocol.
"""

from __future__ import annotations

import asyncio
import json

CALLBACK = "service.proxy_guard:middlewares"
CALLBACK_VARIABLE = "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"
HEADER_TIMEOUT_S = 10.0
BODY_TIMEOUT_S = 30.0
BODY_IDLE_S = 10.0
MAX_BODIES_READING = 4096
MAX_CONNECTIONS = 8192
# A declared body above the gateway's largest max_body_bytes (service.schemas) is not read:
# the gateway refuses it (413) from its headers.
MAX_BUFFERED_BODY_BYTES = 256 * 1024 * 1024
REASONS = ("header_timeout", "body_timeout", "too_many_bodies", "too_many_connections",
           "bad_request")
RETRY_AFTER_S = 1


def error_response(status: int, message: str, headers: dict[str, str] | None = None) -> bytes:
    """A whole HTTP/1.1 response, ``{"error": message}`` (the service's ``ErrorResponse``),
    that closes the connection."""
    body = json.dumps({"error": message}).encode()
    reason = {400: "Bad Request", 408: "Request Timeout", 503: "Service Unavailable"}[status]
    lines = [f"HTTP/1.1 {status} {reason}", "content-type: application/json",
             f"content-length: {len(body)}", "connection: close",
             *(f"{k}: {v}" for k, v in (headers or {}).items())]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


class _Refusals:
    """``mita_serve_proxy_refusals_total`` once Ray is there (the proxy); counts kept here
    too (``counts``), so the guard also runs, and is tested, without Ray."""

    def __init__(self):
        self.counts = dict.fromkeys(REASONS, 0)
        self.counter = None
        try:
            from ray.util.metrics import Counter
        except ImportError:
            return
        self.counter = Counter("mita_serve_proxy_refusals_total",
                               description="connections and requests refused by the HTTP "
                                           "proxy before any replica: stalled headers or "
                                           "body, too many at once, unparsable HTTP",
                               tag_keys=("reason",))
        for reason in REASONS:  # every series from start-up, at 0 (as service.metrics)
            self.counter._record(0, tags={"reason": reason})

    def add(self, reason: str) -> None:
        self.counts[reason] += 1
        if self.counter is not None:
            self.counter.inc(tags={"reason": reason})


refusals: _Refusals | None = None


def _refused(reason: str) -> None:
    global refusals
    if refusals is None:
        refusals = _Refusals()
    refusals.add(reason)


class BodyDeadline:
    """ASGI middleware: the request's body read whole, within ``body_timeout_s`` (and
    ``idle_s`` between pieces), before the app sees the request; then replayed to it."""

    def __init__(self, app, body_timeout_s: float = BODY_TIMEOUT_S, idle_s: float = BODY_IDLE_S,
                 max_reading: int = MAX_BODIES_READING):
        self.app, self.body_timeout_s, self.idle_s = app, body_timeout_s, idle_s
        self.max_reading, self.reading = max_reading, 0

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not _declares_body(scope):
            return await self.app(scope, receive, send)
        if self.reading >= self.max_reading:
            _refused("too_many_bodies")
            return await _send_error(send, 503, f"{self.reading} request bodies are being "
                                     "received already; retry later",
                                     {"retry-after": str(RETRY_AFTER_S)})
        self.reading += 1
        try:
            messages = await self._read(receive)
        except TimeoutError as e:
            _refused("body_timeout")
            return await _send_error(send, 408, str(e))
        finally:
            self.reading -= 1
        if messages is None:  # the client left: nothing to answer
            return None

        async def replay():
            return messages.pop(0) if messages else await receive()
        return await self.app(scope, replay, send)

    async def _read(self, receive) -> list[dict] | None:
        loop = asyncio.get_running_loop()
        end = loop.time() + self.body_timeout_s
        messages, size = [], 0
        while True:
            left = end - loop.time()
            wait = min(left, self.idle_s)
            try:
                message = await asyncio.wait_for(receive(), max(wait, 0.0))
            except TimeoutError:
                why = (f"the request body did not arrive within {self.body_timeout_s:g} s"
                       if wait == left else
                       f"no part of the request body arrived for {self.idle_s:g} s")
                raise TimeoutError(f"{why} ({size} bytes received); send the whole body at "
                                   "once") from None
            if message["type"] == "http.disconnect":
                return None
            messages.append(message)
            size += len(message.get("body", b""))
            if not message.get("more_body", False):
                return messages


def _declares_body(scope) -> bool:
    """A Content-Length of 1 byte up to ``MAX_BUFFERED_BODY_BYTES`` (larger or chunked:
    refused by the gateway from its headers, never read)."""
    for name, value in scope["headers"]:
        if name == b"content-length":
            return value.strip().isdigit() and 0 < int(value) <= MAX_BUFFERED_BODY_BYTES
    return False


async def _send_error(send, status: int, message: str, headers: dict | None = None) -> None:
    body = json.dumps({"error": message}).encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
           (b"connection", b"close")]
    raw += [(k.encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})


def guard_protocol(protocol_class, header_timeout_s: float = HEADER_TIMEOUT_S,
                   max_connections: int = MAX_CONNECTIONS) -> None:
    """Give uvicorn's httptools protocol class a header deadline (from the connection, or
    from a keep-alive request's first byte, to its headers' end), a bound on open
    connections, and JSON for its own 400. Idempotent."""
    if vars(protocol_class).get("_mita_guarded", False):
        return
    made, lost = protocol_class.connection_made, protocol_class.connection_lost
    begin, complete = protocol_class.on_message_begin, protocol_class.on_headers_complete

    def late(self) -> None:
        self._mita_deadline = None
        if not self.transport.is_closing():
            _refused("header_timeout")
            self.transport.write(error_response(
                408, f"the request headers did not arrive within {header_timeout_s:g} s"))
            self.transport.close()

    def arm(self) -> None:
        if getattr(self, "_mita_deadline", None) is None:
            self._mita_deadline = self.loop.call_later(header_timeout_s, late, self)

    def disarm(self) -> None:
        deadline = getattr(self, "_mita_deadline", None)
        if deadline is not None:
            deadline.cancel()
            self._mita_deadline = None

    def connection_made(self, transport) -> None:
        made(self, transport)
        if len(self.connections) > max_connections:
            _refused("too_many_connections")
            transport.write(error_response(
                503, f"more than {max_connections} connections are open; retry later",
                {"retry-after": str(RETRY_AFTER_S)}))
            transport.close()
            return
        arm(self)

    def connection_lost(self, exc) -> None:
        disarm(self)
        lost(self, exc)

    def on_message_begin(self) -> None:
        begin(self)
        arm(self)

    def on_headers_complete(self) -> None:
        disarm(self)
        complete(self)

    def send_400_response(self, msg: str) -> None:
        disarm(self)
        _refused("bad_request")
        self.transport.write(error_response(
            400, f"malformed HTTP request (request line, a header or Content-Length): {msg}"))
        self.transport.close()

    for name, fn in (("connection_made", connection_made), ("connection_lost", connection_lost),
                     ("on_message_begin", on_message_begin),
                     ("on_headers_complete", on_headers_complete),
                     ("send_400_response", send_400_response)):
        setattr(protocol_class, name, fn)
    protocol_class._mita_guarded = True


def middlewares() -> list:
    """Ray Serve's proxy callback (``CALLBACK``): guards uvicorn's protocol in this process
    and returns the body middleware, as a list of Starlette ``Middleware``."""
    from starlette.middleware import Middleware
    from uvicorn.protocols.http.auto import AutoHTTPProtocol
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    if AutoHTTPProtocol is HttpToolsProtocol:
        guard_protocol(HttpToolsProtocol)
    else:  # h11 only: no header deadline (ray[serve] installs httptools)
        print("mita-serve: warning: uvicorn runs without httptools: no header deadline in "
              "the HTTP proxy", flush=True)
    global refusals
    refusals = _Refusals()
    return [Middleware(BodyDeadline)]
