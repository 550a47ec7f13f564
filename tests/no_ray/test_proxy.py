"""Proxy variables (HTTP_PROXY …) never reach traffic to this machine: the gateway's Prometheus
queries go direct, and what the service starts has loopback in NO_PROXY."""

from __future__ import annotations

import json
import os
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from ..helpers import NO_PROXY_VARIABLES

PROXY_VARIABLES = ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy",
                   "all_proxy")


class Refusing:
    """A proxy on loopback that answers every connection 502 (as a corporate proxy does for
    an address it cannot reach) and counts them in ``hits`` (first line of each)."""

    def __init__(self):
        self.hits: list[bytes] = []
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:  # closed
                return
            with conn:
                conn.settimeout(2)
                try:
                    self.hits.append(conn.recv(4096).split(b"\r\n")[0])
                    conn.sendall(b"HTTP/1.1 502 Bad Gateway\r\nContent-Length: 0\r\n"
                                 b"Connection: close\r\n\r\n")
                except OSError:
                    pass

    def close(self):
        self.sock.close()


@pytest.fixture
def proxied(monkeypatch):
    """Every proxy variable names a refusing proxy; no NO_PROXY (this process's may already
    name loopback: launch.start added it)."""
    proxy = Refusing()
    for name in PROXY_VARIABLES:
        monkeypatch.setenv(name, proxy.url)
    for name in (*NO_PROXY_VARIABLES, "no_grpc_proxy"):
        monkeypatch.delenv(name, raising=False)
    yield proxy
    proxy.close()


class FakePrometheus(BaseHTTPRequestHandler):
    """Answers the query API as Prometheus does when it has no data: success, no series."""
    paths: list[str] = []

    def do_GET(self):  # noqa: N802 (http.server's name)
        FakePrometheus.paths.append(self.path.split("?")[0])
        body = json.dumps({"status": "success",
                           "data": {"resultType": "vector", "result": []}}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_prometheus_queries_do_not_go_through_an_environment_proxy(proxied):
    """With HTTP_PROXY set, Prometheus-mode stats still reach a loopback Prometheus (they
    went to the proxy, and /v1/stats answered 502), and nothing reaches the proxy."""
    from service.stats import INSTANT, RANGE, prometheus_summary

    server = ThreadingHTTPServer(("127.0.0.1", 0), FakePrometheus)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    FakePrometheus.paths = []
    try:
        body = prometheus_summary(f"http://127.0.0.1:{server.server_port}", 300)
    finally:
        server.shutdown()
        server.server_close()
    assert proxied.hits == []
    assert body["source"] == "prometheus" and body["requests"] == []
    assert sorted(FakePrometheus.paths) == sorted(
        ["/api/v1/query"] * len(INSTANT) + ["/api/v1/query_range"] * len(RANGE))


def test_no_proxy_gets_this_machine_and_keeps_its_own(monkeypatch):
    """Loopback and the given addresses are added to NO_PROXY and no_proxy after what they
    named, once; the proxy variables that are set are returned (for the start's warning)."""
    from service.launch import no_proxy_for_this_machine

    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.example:3128")
    monkeypatch.setenv("NO_PROXY", "corp.example, localhost")
    monkeypatch.delenv("no_proxy", raising=False)
    monkeypatch.delenv("no_grpc_proxy", raising=False)
    for name in ("HTTP_PROXY", "http_proxy", "https_proxy", "ALL_PROXY", "all_proxy",
                 "grpc_proxy"):
        monkeypatch.delenv(name, raising=False)
    assert no_proxy_for_this_machine(["10.1.2.3"]) == ["HTTPS_PROXY"]
    assert os.environ["NO_PROXY"] == "corp.example,localhost,127.0.0.1,::1,10.1.2.3"
    assert os.environ["no_proxy"] == "127.0.0.1,localhost,::1,10.1.2.3"
    no_proxy_for_this_machine(["10.1.2.3"])  # a second start adds nothing
    assert os.environ["NO_PROXY"] == "corp.example,localhost,127.0.0.1,::1,10.1.2.3"


