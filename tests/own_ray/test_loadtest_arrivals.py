"""The load tester's loops against a real HTTP server on loopback: the open loop's Poisson
schedule at its rate, its end, the closed loop's concurrency and a piped log's lines (timed:
a busy machine moves the arrivals' gaps; the numbers worked by hand:
tests/no_ray/test_loadtest_numbers.py)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from loadtest.engine import LoadConfig, run_load

from ..helpers import only_row

# slow: timed against a real server (make test-fast leaves it out, as every own_ray test)
pytestmark = pytest.mark.slow

# Tolerances: pytest.approx's default (1e-6 relative) and rel=1e-12 cover only float rounding
# (seconds × 1e3 to ms, numpy's interpolation); every expected value is exact in decimal.








# ---------------------------------------------------------------------------- check_loopback







# ---------------------------------------------------------------------------- summarize

















# ---------------------------------------------------------------------------- run_load on loopback

class _Service(ThreadingHTTPServer):
    """A stand-in for the service on 127.0.0.1: answers /v1/classify like the gateway (JSON
    with the served variant and a profile), after ``delay_s``; every ``refuse_every``-th
    request is a 503. Records each request's arrival time and body, and the most requests it
    was answering at once."""

    daemon_threads = True

    def __init__(self, delay_s=0.0, refuse_every=0):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.delay_s, self.refuse_every = delay_s, refuse_every
        self.lock = threading.Lock()
        self.arrivals: list[tuple[float, dict]] = []
        self.inflight = self.max_inflight = 0
        self.thread = threading.Thread(target=self.serve_forever, daemon=True)

    @property
    def url(self):
        return f"http://127.0.0.1:{self.server_address[1]}"

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.shutdown()
        self.server_close()
        self.thread.join(5)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as the client expects

    def do_POST(self):
        srv: _Service = self.server
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with srv.lock:
            srv.arrivals.append((time.perf_counter(), body))
            k = len(srv.arrivals)
            srv.inflight += 1
            srv.max_inflight = max(srv.max_inflight, srv.inflight)
        time.sleep(srv.delay_s)
        if self.path != "/v1/classify":
            code, payload = 404, {"error": "not found"}
        elif srv.refuse_every and k % srv.refuse_every == 0:
            code, payload = 503, {"error": "overloaded"}
        else:
            code, payload = 200, {"label": 3, "probabilities": [0.1] * 10,
                                  "variant": body.get("variant", "dense"), "n": len(body["ids"]),
                                  "model_id": "test", "shadow": None,
                                  "profile": {"stages_ms": {"attention": 1.25}, "staged": True}}
        data = json.dumps(payload).encode()
        with srv.lock:
            srv.inflight -= 1
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


def test_open_loop_sends_poisson_arrivals_at_the_rate():
    """At R = 50 req/s for D = 2 s (requests not the limit) the phase sends the arrivals of a
    Poisson process in [0, D]: their number is Poisson(R·D = 100), standard deviation
    √100 = 10; the test allows ±4σ = ±40 (outside that with probability < 1e-4 whatever the
    seed; with the fixed seed the schedule is the same every run, only timing jitter moves the
    last arrival across D). The mean gap between start times, (last - first) / (count - 1),
    is 1/R = 20 ms; over ~100 exponential gaps its relative spread is ~1/√100 = 10 %, so
    ±40 % again. An inter-arrival of 1/R seconds mistaken for R seconds sends nothing in 2 s."""
    rate, duration = 50.0, 2.0
    with _Service() as srv:
        cfg = LoadConfig(url=srv.url, ns=[16], variants=["mita"], mode="open", rate=rate,
                         requests=1000, warmup=1, duration_s=duration, sequences_per_n=2)
        t = time.perf_counter()
        samples = asyncio.run(run_load(cfg))
        took = time.perf_counter() - t
    count = len(samples)
    assert abs(count - rate * duration) <= 4 * (rate * duration) ** 0.5, count
    starts = sorted(s.start_s for s in samples)
    # the last arrival is due at 1.96 s; 0.1 s for a loaded machine's event loop to send it
    assert 0 <= starts[0] and starts[-1] <= duration + 0.1
    mean_gap = (starts[-1] - starts[0]) / (count - 1)
    assert mean_gap == pytest.approx(1 / rate, rel=0.4), mean_gap
    # The server saw every one of them (and the warm-up), each answered and kept.
    assert len(srv.arrivals) == count + 1
    assert {(s.status, s.variant, s.n) for s in samples} == {(200, "mita", 16)}
    assert all(s.stages_ms == {"attention": 1.25} for s in samples)
    assert {body["variant"] for _, body in srv.arrivals} == {"mita"}
    server_starts = [at for at, _ in srv.arrivals[1:]]
    server_gap = (server_starts[-1] - server_starts[0]) / (count - 1)
    assert server_gap == pytest.approx(1 / rate, rel=0.4)
    assert took < duration + 5  # the phase stops at D, not at the 1000th arrival (~20 s)


def test_open_loop_ends_when_its_requests_are_sent():
    """requests = 20 at 50 req/s: all 20 sent, the last ~20/50 = 0.4 s in (Gamma(20, 1/R):
    sd 0.09 s), long before the 30 s duration."""
    with _Service() as srv:
        cfg = LoadConfig(url=srv.url, ns=[16], variants=["dense"], mode="open", rate=50.0,
                         requests=20, warmup=0, duration_s=30.0, sequences_per_n=1)
        samples = asyncio.run(run_load(cfg))
    assert len(samples) == len(srv.arrivals) == 20
    assert max(s.start_s for s in samples) < 2.0


def test_closed_loop_keeps_concurrency_requests_in_flight():
    """3 workers, 7 timed requests, each answered after 300 ms (long enough for all three to
    connect on a loaded machine): exactly 7 sent (after 2
    warm-ups), at most 3 at once and 3 at some point; every 4th refused with its error kept."""
    with _Service(delay_s=0.3, refuse_every=4) as srv:
        cfg = LoadConfig(url=srv.url, ns=[16], variants=["dense"], concurrency=3, requests=7,
                         warmup=2, sequences_per_n=1)
        samples = asyncio.run(run_load(cfg))
    assert len(samples) == 7 and len(srv.arrivals) == 9
    assert srv.max_inflight == 3
    refused = [s for s in samples if s.status == 503]
    assert len(refused) == 2  # arrivals 4 and 8 (the 2nd and 6th timed)
    assert all((s.variant, s.error) == (None, "overloaded") for s in refused)
    assert all(s.variant == "dense" and s.latency_s >= 0.05 for s in samples if s.status == 200)
    row = only_row(samples, dataclasses.replace(cfg, variants=["dense"]))
    assert (row["sent"], row["ok"], row["errors"]) == (7, 5, {"503": 2})


def test_a_piped_log_gets_one_line_per_phase_and_no_bar(capsys):
    """Under pytest stderr is not a terminal, as in a piped log: no tqdm bar (whose carriage
    returns made one endless line), one line per finished (N, variant) phase with its answered
    count, refusals by status and p50; the ``[done/total req]`` counts warm-ups too."""
    with _Service(refuse_every=5) as srv:
        cfg = LoadConfig(url=srv.url, ns=[32, 16], variants=["mita", "dense"], requests=4,
                         warmup=1, concurrency=1, sequences_per_n=1)
        asyncio.run(run_load(cfg))
    err = capsys.readouterr().err
    assert "\r" not in err
    lines = err.splitlines()
    assert [line.split(":")[1] for line in lines] == [" N=16 mita", " N=16 dense", " N=32 mita",
                                                        " N=32 dense"]
    # arrivals 5, 10, 15, 20 refused: the 4th timed request of each phase (1 warm-up + 4)
    assert all("3 of 4 timed requests answered (1 × 503), p50 " in line for line in lines)
    assert [line.rsplit("[", 1)[1].split(",")[0] for line in lines] == [
        "5/20 req", "10/20 req", "15/20 req", "20/20 req"]
