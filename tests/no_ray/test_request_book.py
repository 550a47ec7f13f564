"""The request's book (``service.request_book.RequestBook``) on its own, and the ``CheckBody``
middleware's use of it and of ``service.replica_state``, without Ray: the arrival time, the
after-response calls (in order, once, after the response), the Server-Timing value, the
recording of a classify request that was never routed, and the Retry-After while draining."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from service import replica_state
from service.http import CheckBody
from service.request_book import SCOPE_KEY, RequestBook


def test_open_stores_the_book_in_the_scope_with_the_arrival_time():
    scope = {"type": "http"}
    before = time.time()
    book = RequestBook.open(scope)
    after = time.time()
    assert scope[SCOPE_KEY] is book and RequestBook.of(scope) is book
    assert before <= book.arrived_at <= after
    assert (book.routed, book.after_response, book.forward_ms) == (False, [], None)
    # a given arrival time is kept as it is; a new book replaces the old one in the scope
    assert RequestBook.open(scope, arrived_at=12.5).arrived_at == 12.5
    assert RequestBook.of(scope) is not book
    with pytest.raises(KeyError):
        RequestBook.of({"type": "http"})


def test_after_response_calls_run_in_order_and_once():
    book = RequestBook(arrived_at=0.0)
    ran = []
    for name in ("forward", "request", "shadow"):
        book.after_response.append(lambda name=name: ran.append(name))
    book.run_after_response()
    assert ran == ["forward", "request", "shadow"]
    book.run_after_response()
    assert ran == ["forward", "request", "shadow"] and book.after_response == []


def test_server_timing_is_the_forward_ms_to_the_microsecond_or_none():
    book = RequestBook(arrived_at=0.0)
    assert book.server_timing() is None  # no forward has answered
    book.forward_ms = 12.3456
    assert book.server_timing() == "forward;dur=12.346"
    book.forward_ms = 0.0
    assert book.server_timing() == "forward;dur=0.000"


def call_check_body(app, path="/v1/classify", body=b"{}"):
    """Run one POST of ``body`` to ``path`` through ``CheckBody(app)``; returns the scope, the
    messages sent and the order of events (messages' types, after-response calls)."""
    sent, events = [], []

    async def send(message):
        sent.append(message)
        events.append(message["type"])

    async def receive():
        return {"type": "http.request", "body": body, "more_body": False}

    scope = {"type": "http", "method": "POST", "path": path, "root_path": "",
             "query_string": b"", "headers": [(b"content-type", b"application/json"),
                                              (b"content-length", str(len(body)).encode())]}

    async def main():
        await CheckBody(app)(scope, receive, send)
        await asyncio.sleep(0)  # the after-response calls run on the loop's next pass
    asyncio.run(main())
    return scope, sent, events


@pytest.fixture
def unrouted(monkeypatch):
    """The statuses ``replica_state.record_unrouted`` is called with."""
    statuses = []
    monkeypatch.setattr(replica_state, "record_unrouted", statuses.append)
    return statuses


def answer(status: int, routed: bool, forward_ms: float | None = None):
    """An ASGI app answering ``status``: a route that chose a variant (``routed``) and ran a
    forward of ``forward_ms``, noted in the request's book as ``Gateway._classify`` does."""
    async def app(scope, receive, send):
        book = RequestBook.of(scope)
        book.routed = routed
        book.forward_ms = forward_ms
        if routed:
            book.after_response.append(lambda: events_of(scope).append("recorded"))
        await send({"type": "http.response.start", "status": status, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})
    return app


def events_of(scope) -> list:
    return scope.setdefault("test.events", [])


def test_a_routed_request_is_recorded_after_its_response_and_not_as_unrouted(unrouted):
    scope, sent, events = call_check_body(answer(200, routed=True, forward_ms=3.0))
    assert events == ["http.response.start", "http.response.body"]
    assert events_of(scope) == ["recorded"]  # once, after the response was handed over
    book = RequestBook.of(scope)
    assert book.routed and book.forward_ms == 3.0 and book.after_response == []
    assert unrouted == []


def test_a_classify_request_never_routed_is_recorded_once_with_its_status(unrouted):
    scope, _, _ = call_check_body(answer(422, routed=False))
    assert unrouted == [422] and events_of(scope) == []
    # refused by the middleware itself (a body over the limit): recorded too
    call_check_body(answer(200, routed=True), body=b" " * (replica_state.max_body_bytes + 1))
    assert unrouted == [422, 413]
    # not a classify path: not a classify request, nothing recorded
    call_check_body(answer(404, routed=False), path="/v1/nothing")
    assert unrouted == [422, 413]


def test_draining_answers_503_with_the_replicas_retry_after(monkeypatch, unrouted):
    monkeypatch.setattr(replica_state, "draining", True)
    monkeypatch.setattr(replica_state, "retry_after_s", 7)
    scope, sent, _ = call_check_body(answer(200, routed=True))
    start, body = sent
    assert start["status"] == 503 and (b"retry-after", b"7") in start["headers"]
    assert json.loads(body["body"])["error"] == ("the service is shutting down; retry on "
                                                 "another instance")
    assert unrouted == [503] and not RequestBook.of(scope).routed
