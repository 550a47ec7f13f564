"""Requests lost with their Gateway replica (``service.proxy_guard.ResendLost``), without Ray:
an ASGI app that ends some exchanges without any response, as Serve's HTTP proxy does when the
replica holding the request died (uvicorn then answered a plain-text 500 no metric counted)."""

from __future__ import annotations

import asyncio
import json

import pytest

from service import proxy_guard

# Backoffs short enough for a unit test; the shipped ones are RESEND_BACKOFF_S.
FAST = (0.01, 0.02, 0.04)


class Flaky:
    """An ASGI app that reads the whole body, then ends the first ``lose`` exchanges without a
    response and answers the next ones 200 with the body it read and the try's number."""

    def __init__(self, lose: int, status: int = 200):
        self.lose, self.status, self.tries, self.bodies = lose, status, 0, []

    async def __call__(self, scope, receive, send):
        self.tries += 1
        body = b""
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        self.bodies.append(body)
        if self.tries <= self.lose:
            return  # the replica died: no response at all
        data = json.dumps({"try": self.tries, "bytes": len(body)}).encode()
        await send({"type": "http.response.start", "status": self.status,
                    "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": data})


def exchange(app, method="POST", path="/v1/classify", chunks=(b'{"ids": ', b"[1, 2]}"),
             leave=False, backoff_s=FAST, within_s=5.0):
    """Run one request through ``ResendLost`` around ``app``: (messages sent to the client,
    seconds it took). ``leave``: the client disconnects once the body is read."""
    messages = [{"type": "http.request", "body": c, "more_body": i < len(chunks) - 1}
                for i, c in enumerate(chunks)]
    sent: list[dict] = []

    async def receive():
        if messages:
            return messages.pop(0)
        if leave:
            return {"type": "http.disconnect"}
        await asyncio.sleep(3600)  # a client that waits for its answer

    async def send(message):
        sent.append(message)

    async def run():
        loop = asyncio.get_running_loop()
        start = loop.time()
        mw = proxy_guard.ResendLost(app, backoff_s=backoff_s, within_s=within_s)
        await mw({"type": "http", "method": method, "path": path, "headers": []},
                 receive, send)
        return loop.time() - start
    took = asyncio.run(run())
    return sent, took


def status_and_body(sent):
    start = next(m for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return start["status"], dict(start["headers"]), json.loads(body)


@pytest.fixture
def counts(monkeypatch):
    resends = proxy_guard._Resends()
    monkeypatch.setattr(proxy_guard, "resends", resends)
    return resends.counts


@pytest.mark.parametrize("lose", [1, 2, 3])
def test_a_lost_classify_is_resent_with_its_whole_body(counts, lose):
    app = Flaky(lose=lose)
    sent, took = exchange(app)
    assert status_and_body(sent)[0] == 200
    assert status_and_body(sent)[2] == {"try": lose + 1, "bytes": 15}
    assert app.bodies == [b'{"ids": [1, 2]}'] * (lose + 1)  # every try got the same body
    assert counts == {"answered": 1, "gave_up": 0}
    assert took >= sum(FAST[:lose])  # each resend waited its backoff


def test_lost_four_times_is_a_json_503_with_retry_after(counts):
    app = Flaky(lose=100)
    sent, _ = exchange(app)
    status, headers, body = status_and_body(sent)
    assert (status, headers[b"retry-after"], headers[b"content-type"]) == (
        503, str(proxy_guard.RETRY_AFTER_S).encode(), b"application/json")
    assert body == {"error": "the gateway replica handling this request was lost and 3 "
                             "resends within 0 s got no answer; retry later"}
    assert app.tries == 1 + 3
    assert counts == {"answered": 0, "gave_up": 1}


def test_no_resend_later_than_the_budget(counts):
    # the second wait (0.3 s) would pass the 0.2 s budget: one resend only
    app = Flaky(lose=100)
    sent, _ = exchange(app, backoff_s=(0.05, 0.3, 0.3), within_s=0.2)
    assert status_and_body(sent)[0] == 503
    assert "and 1 resend within" in status_and_body(sent)[2]["error"]
    assert app.tries == 2


@pytest.mark.parametrize("method,path", [("GET", "/v1/models"), ("GET", "/healthz"),
                                         ("POST", "/v1/classify/batch"),
                                         ("POST", "/own/v1/classify/binary"),
                                         ("POST", "/text/v1/classify/")])
def test_every_route_of_the_service_is_resent(counts, method, path):
    app = Flaky(lose=1)
    sent, _ = exchange(app, method=method, path=path,
                       chunks=(b"",) if method == "GET" else (b"{}",))
    assert status_and_body(sent)[0] == 200
    assert counts["answered"] == 1


@pytest.mark.parametrize("path", ["/orders", "/v1/classify/extra", "/v1/classifyx"])
def test_another_applications_post_is_never_resent(counts, path):
    # a POST that may not be idempotent: ended once, it stays ended (uvicorn answers its 500)
    app = Flaky(lose=1)
    sent, _ = exchange(app, path=path)
    assert sent == [] and app.tries == 1
    assert counts == {"answered": 0, "gave_up": 0}


def test_a_client_that_left_is_not_resent(counts):
    app = Flaky(lose=1)

    async def leaves(scope, receive, send):  # the proxy sees the client leave mid-request
        app.tries += 1
        while (await receive())["type"] != "http.disconnect":
            pass
    sent, _ = exchange(leaves, leave=True)
    assert sent == [] and app.tries == 1
    assert counts == {"answered": 0, "gave_up": 0}


def test_an_answered_500_is_not_resent(counts):
    # the gateway answered (its own error): an answer, not a loss
    app = Flaky(lose=0, status=500)
    sent, _ = exchange(app)
    assert status_and_body(sent)[0] == 500 and app.tries == 1
    assert counts == {"answered": 0, "gave_up": 0}


def test_the_resent_posts_are_the_services_classify_routes():
    # proxy_guard keeps its own copy (the proxy process must not import the service's FastAPI
    # app and torch): it must not drift from the routes the gateway serves
    from service.http import CLASSIFY_PATHS

    assert set(proxy_guard.RESENT_POSTS) == set(CLASSIFY_PATHS)
