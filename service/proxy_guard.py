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

It also resends what a dying Gateway replica took with it (``ResendLost``): a request the
proxy got no answer for at all — Serve's proxy then ends the exchange without a response, and
uvicorn answered a plain-text ``500 Internal Server Error`` that no metric counted — is sent
again when it is idempotent (every GET, and the classify POSTs: an answer depends only on the
input), after ``RESEND_BACKOFF_S``, at most ``MAX_RESENDS`` times within ``RESEND_WITHIN_S``
(a request that itself kills gateways must not take every replacement down). Serve holds a
resend until a live Gateway replica runs — at once with two replicas, after the replacement
starts with one. What gets no answer then is a JSON ``503`` with ``Retry-After``. Each lost
request is counted in ``mita_serve_proxy_resends_total{outcome}``: ``answered`` (a resend was
answered) or ``gave_up`` (the 503), which the high-error-rate alert adds to the gateway's 5xx.

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
# Resends of a request lost with its Gateway replica. Serve replaces a dead replica after its
# health check (health_check_period_s, 2 s in the shipped configs) and the replica's start
# (~3-10 s on 2 cores); a resend that reaches the dead replica before Serve's router has
# dropped it fails at once, so the waits grow: 0.5 + 2 + 4 s before the third resend, and
# none is sent later than RESEND_WITHIN_S after the first loss.
RESEND_BACKOFF_S = (0.5, 2.0, 4.0)
MAX_RESENDS = len(RESEND_BACKOFF_S)
RESEND_WITHIN_S = 30.0
RESEND_OUTCOMES = ("answered", "gave_up")
# The service's POST routes (service.http.CLASSIFY_PATHS, after any route prefix) are
# idempotent; another application's POST on a shared cluster proxy may not be: never resent.
RESENT_POSTS = ("/v1/classify", "/v1/classify/batch", "/v1/classify/binary")


def error_response(status: int, message: str, headers: dict[str, str] | None = None) -> bytes:
    """A whole HTTP/1.1 response, ``{"error": message}`` (the service's ``ErrorResponse``),
    that closes the connection."""
    body = json.dumps({"error": message}).encode()
    reason = {400: "Bad Request", 408: "Request Timeout", 503: "Service Unavailable"}[status]
    lines = [f"HTTP/1.1 {status} {reason}", "content-type: application/json",
             f"content-length: {len(body)}", "connection: close",
             *(f"{k}: {v}" for k, v in (headers or {}).items())]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


class _Counted:
    """A counter of the proxy process by one label: Ray's ``Counter`` once Ray is there (the
    proxy); counts kept here too (``counts``), so the guard also runs, and is tested, without
    Ray."""

    def __init__(self, name: str, description: str, label: str, values: tuple[str, ...]):
        self.counts = dict.fromkeys(values, 0)
        self.label, self.counter = label, None
        try:
            from ray.util.metrics import Counter
        except ImportError:
            return
        self.counter = Counter(name, description=description, tag_keys=(label,))
        for value in values:  # every series from start-up, at 0 (as service.metrics)
            self.counter._record(0, tags={label: value})

    def add(self, value: str) -> None:
        self.counts[value] += 1
        if self.counter is not None:
            self.counter.inc(tags={self.label: value})


def _Refusals() -> _Counted:
    return _Counted("mita_serve_proxy_refusals_total",
                    "connections and requests refused by the HTTP proxy before any replica: "
                    "stalled headers or body, too many at once, unparsable HTTP",
                    "reason", REASONS)


def _Resends() -> _Counted:
    return _Counted("mita_serve_proxy_resends_total",
                    "requests the HTTP proxy got no answer for (their Gateway replica died "
                    "holding them): answered by a resend, or gave_up (answered 503)",
                    "outcome", RESEND_OUTCOMES)


refusals: _Counted | None = None
resends: _Counted | None = None


def _refused(reason: str) -> None:
    global refusals
    if refusals is None:
        refusals = _Refusals()
    refusals.add(reason)


def _resent(outcome: str) -> None:
    global resends
    if resends is None:
        resends = _Resends()
    resends.add(outcome)


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


class ResendLost:
    """ASGI middleware: a request the app ends without any response — Serve's proxy does so
    when the replica holding the request died (it would be uvicorn's plain-text 500) — is sent
    again if idempotent (``_resendable``) and its client is still there, ``MAX_RESENDS``
    times at most, after ``backoff_s``, within ``within_s`` of the first loss; then a JSON
    503 with ``Retry-After``. The request's messages are kept to be replayed to each resend.
    Counted in ``mita_serve_proxy_resends_total{outcome}``."""

    def __init__(self, app, backoff_s: tuple[float, ...] = RESEND_BACKOFF_S,
                 within_s: float = RESEND_WITHIN_S):
        self.app, self.backoff_s, self.within_s = app, backoff_s, within_s

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not _resendable(scope):
            return await self.app(scope, receive, send)
        kept: list[dict] = []  # the request's messages, as the first try read them
        state = {"started": False, "left": False}

        async def answer(message):
            if message["type"] == "http.response.start":
                state["started"] = True
            await send(message)

        async def first_receive():
            message = await receive()
            if message["type"] == "http.request":
                kept.append(message)
            elif message["type"] == "http.disconnect":
                state["left"] = True
            return message

        await self.app(dict(scope), first_receive, answer)
        if state["started"] or state["left"]:
            return None
        loop = asyncio.get_running_loop()
        lost_at, sent = loop.time(), 0
        for wait in self.backoff_s:
            if loop.time() + wait - lost_at > self.within_s:
                break
            await asyncio.sleep(wait)
            sent += 1
            replay = list(kept)

            async def again(replay=replay):
                if replay:
                    return replay.pop(0)
                message = await receive()
                if message["type"] == "http.disconnect":
                    state["left"] = True
                return message
            await self.app(dict(scope), again, answer)
            if state["started"]:
                _resent("answered")
                return None
            if state["left"]:
                return None
        _resent("gave_up")
        took = loop.time() - lost_at
        await _send_error(send, 503, f"the gateway replica handling this request was lost "
                          f"and {sent} resend{'s' * (sent != 1)} within {took:.0f} s got no "
                          "answer; retry later", {"retry-after": str(RETRY_AFTER_S)})
        return None


def _resendable(scope) -> bool:
    """Idempotent: a GET or HEAD, or a POST to one of the service's classify routes."""
    method = scope.get("method", "GET")
    return method in ("GET", "HEAD") or (
        method == "POST" and scope.get("path", "").rstrip("/").endswith(RESENT_POSTS))


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
    global refusals, resends
    refusals, resends = _Refusals(), _Resends()
    # BodyDeadline outside: the whole body is read once, then replayed to every resend.
    return [Middleware(BodyDeadline), Middleware(ResendLost)]
