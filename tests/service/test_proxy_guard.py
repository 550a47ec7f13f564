"""Slow and stalled clients (``service.proxy_guard``): a real uvicorn server in this process
with the guard's body middleware and its protocol deadlines (short ones, so the tests wait
under a second each), then the real service: stalled uploads beyond the Gateway's
``max_ongoing_requests`` leave ``/healthz`` and ``/v1/classify`` answering."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import httpx
import pytest
import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from service import proxy_guard

from ..helpers import free_port

HEADER_S, BODY_S, IDLE_S = 0.5, 1.5, 0.5
# How early by the clock a deadline may fire: uvicorn runs uvloop, whose (libuv's) timers count
# whole milliseconds from the loop's time as cached at the start of its iteration; in a loaded
# clean-clone run the 0.5 s header deadline answered after 0.49967 s by the client's clock.
TIMER_SLACK_S = 0.005


class Guarded(HttpToolsProtocol):
    """A subclass: the guard's deadlines here are the test's, not the proxy's."""


proxy_guard.guard_protocol(Guarded, header_timeout_s=HEADER_S, max_connections=20)


def _app(seen: list):
    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        seen.append(body)
        data = json.dumps({"bytes": len(body)}).encode()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": data})
    return proxy_guard.BodyDeadline(app, body_timeout_s=BODY_S, idle_s=IDLE_S, max_reading=5)


@pytest.fixture(scope="module")
def server():
    seen: list = []
    port = free_port()
    config = uvicorn.Config(_app(seen), host="127.0.0.1", port=port, http=Guarded,
                            lifespan="off", log_level="critical", access_log=False)
    srv = uvicorn.Server(config)
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    while not srv.started:
        time.sleep(0.01)
    yield port, seen
    srv.should_exit = True
    thread.join(5)


def ask(port: int, raw: bytes, wait_s: float = 5.0) -> tuple[float, int, dict]:
    """Send ``raw``, read until the server closes; (seconds from before the connection, at
    or before the server's header deadline starts, status, JSON body)."""
    start = time.perf_counter()
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.settimeout(wait_s)
        s.sendall(raw)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
    head, _, body = out.partition(b"\r\n\r\n")
    assert b"content-type: application/json" in head.lower()
    return time.perf_counter() - start, int(head.split()[1]), json.loads(body)


POST = (b"POST /v1/classify HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: 40\r\n\r\n")


def test_a_stalled_body_is_answered_408_json_and_never_reaches_the_app(server):
    port, seen = server
    before = len(seen)
    took, status, body = ask(port, POST + b'{"te')
    assert status == 408
    assert body == {"error": f"no part of the request body arrived for {IDLE_S:g} s (4 bytes "
                             "received); send the whole body at once"}
    assert IDLE_S - TIMER_SLACK_S <= took < IDLE_S + 1.0
    assert len(seen) == before


def test_a_body_trickling_past_its_deadline_is_refused_in_all(server):
    port, seen = server
    before = len(seen)
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.settimeout(5)
        start = time.perf_counter()
        s.sendall(POST)
        out = b""
        for _ in range(40):  # a byte every 0.2 s: never idle 0.5 s, 8 s in all
            try:
                s.sendall(b" ")
            except OSError:
                break
            time.sleep(0.2)
            s.setblocking(False)
            try:
                out += s.recv(65536)
            except BlockingIOError:
                pass
            s.setblocking(True)
            if out:
                break
        took = time.perf_counter() - start
    assert out.split()[1] == b"408"
    assert b"did not arrive within 1.5 s" in out
    assert BODY_S - TIMER_SLACK_S <= took < BODY_S + 1.0
    assert len(seen) == before


def test_a_whole_body_is_passed_on_unchanged(server):
    port, seen = server
    payload = json.dumps({"text": "[MAX 2 [MIN 4 7 ] 0 ]"}).encode()
    r = httpx.post(f"http://127.0.0.1:{port}/v1/classify", content=payload,
                   headers={"content-type": "application/json"})
    assert (r.status_code, r.json()) == (200, {"bytes": len(payload)})
    assert seen[-1] == payload


@pytest.mark.parametrize("raw", [
    b"POST /v1/classify HTTP/1.1\r\nHost: x\r\nContent-Type: appl",  # stalled in a header
    b"",  # connected, sent nothing
])
def test_stalled_headers_are_answered_408_json(server, raw):
    took, status, body = ask(server[0], raw)
    assert (status, body) == (408, {"error": f"the request headers did not arrive within "
                                             f"{HEADER_S:g} s"})
    assert HEADER_S - TIMER_SLACK_S <= took < HEADER_S + 1.0


def test_a_keep_alive_connection_gets_the_header_deadline_again(server):
    """After one answered request, a second request that stalls in its headers."""
    port, _ = server
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.settimeout(5)
        s.sendall(POST.replace(b"40", b"2") + b"{}")
        first = s.recv(65536)
        assert first.split()[1] == b"200"
        start = time.perf_counter()
        s.sendall(b"POST /v1/classify HTTP/1.1\r\nHo")
        out = b""
        while chunk := s.recv(65536):
            out += chunk
    assert out.split()[1] == b"408"
    assert HEADER_S - TIMER_SLACK_S <= time.perf_counter() - start < HEADER_S + 1.0


@pytest.mark.parametrize("raw", [
    b"POST /v1/classify HTTP/1.1\r\nHost: x\r\nContent-Length: 1x\r\n\r\n{}",
    b"GARBAGE\r\n\r\n",
])
def test_unparsable_http_gets_the_json_400(server, raw):
    took, status, body = ask(server[0], raw)
    assert status == 400
    assert body["error"].startswith("malformed HTTP request (request line, a header or "
                                    "Content-Length)")


def test_connections_and_bodies_beyond_the_bounds_are_refused_503_at_once(server):
    port, _ = server

    async def run():
        held = []
        for _ in range(5):  # max_reading = 5 stalled bodies
            r, w = await asyncio.open_connection("127.0.0.1", port)
            w.write(POST + b"{")
            await w.drain()
            held.append(w)
        await asyncio.sleep(0.1)
        r, w = await asyncio.open_connection("127.0.0.1", port)
        w.write(POST + b'{"text": "[MAX 2 [MIN 4 7 ] 0 ]"}     ')
        sixth = await asyncio.wait_for(r.read(), 2)
        for _ in range(20):  # past max_connections = 20 open ones
            held.append((await asyncio.open_connection("127.0.0.1", port))[1])
        r, w = await asyncio.open_connection("127.0.0.1", port)
        over = await asyncio.wait_for(r.read(), 2)
        for w in held:
            w.close()
        return sixth, over

    sixth, over = asyncio.run(run())
    assert sixth.split()[1] == b"503" and b"retry-after: 1" in sixth
    assert b"5 request bodies are being received already" in sixth
    assert over.split()[1] == b"503" and b"more than 20 connections are open" in over


def test_every_refusal_is_counted_by_reason():
    counts = proxy_guard.refusals.counts
    assert set(counts) == set(proxy_guard.REASONS)
    assert all(counts[r] >= 1 for r in proxy_guard.REASONS), counts


# ------------------------------------------------------------------------ the real service

STALLED = 300  # more than the Gateway's max_ongoing_requests (256)


@pytest.mark.sharing  # mostly waits (a deadline of seconds); checks counts
def test_stalled_uploads_beyond_the_gateways_slots_leave_the_service_answering(service):
    """300 uploads that stall in their body (``benchmarks/stalled_connections.py``'s point,
    on the test service). Before the guard, each held one of the Gateway's 256 slots for
    Serve's 180 s request timeout: /healthz and /v1/classify waited behind them (every request
    of the point ran out its 5 s client timeout). Now all answered; and one stalled upload is
    answered 408 (JSON) by the proxy after its idle deadline (10 s)."""
    from benchmarks.stalled_connections import point

    port = int(service.url.rsplit(":", 1)[1])
    got = asyncio.run(point(service.url, port, "body", STALLED, requests=10))
    assert {name: (g["ok"], g["failed"]) for name, g in got.items()} == {
        "classify": (10, 0), "healthz": (10, 0)}
    assert got["healthz"]["p99"] < 5000

    async def one():
        r, w = await asyncio.open_connection("127.0.0.1", port)
        w.write(POST + b'{"te')
        start = time.perf_counter()
        answer = await asyncio.wait_for(r.read(), proxy_guard.BODY_IDLE_S + 10)
        w.close()
        return answer, time.perf_counter() - start

    first, took = asyncio.run(one())
    head, _, body = first.partition(b"\r\n\r\n")
    assert head.split()[1] == b"408"
    assert json.loads(body)["error"].startswith(
        f"no part of the request body arrived for {proxy_guard.BODY_IDLE_S:g} s")
    assert proxy_guard.BODY_IDLE_S - TIMER_SLACK_S <= took < proxy_guard.BODY_IDLE_S + 5
