"""The load tester's numbers, worked out by hand: summarize's percentiles, throughput, errors,
stage medians and MiTA/dense ratios, and the open loop's Poisson schedule against a real HTTP
server on loopback."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import threading
import time
from dataclasses import asdict
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from loadtest.engine import LoadConfig, Sample, check_loopback, run_load, summarize

# Tolerances: pytest.approx's default (1e-6 relative) and rel=1e-12 cover only float rounding
# (seconds × 1e3 to ms, numpy's interpolation); every expected value is exact in decimal.
CFG = LoadConfig(url="http://127.0.0.1:8000", ns=[256], variants=["mita"])


def ok(n, req, served, start, lat, stages=None, staged=True):
    return Sample(n, req, served, 200, start, lat, stages or {}, staged=staged)


def err(n, req, status, start, lat, error="x"):
    return Sample(n, req, None, status, start, lat, error=error)


def only_row(samples, cfg=CFG):
    (row,) = summarize(samples, cfg)["rows"]
    return row


# ---------------------------------------------------------------------------- check_loopback

@pytest.mark.parametrize("url", ["http://127.0.0.1:8000", "http://127.5.6.7/", "https://localhost:1",
                                 "http://LOCALHOST:8000/x", "http://[::1]:8000"])
def test_loopback_targets_are_allowed(url):
    assert check_loopback(url) is None


@pytest.mark.parametrize(("url", "host"), [("http://10.0.0.1:8000", "10.0.0.1"),
                                           ("https://example.com", "example.com"),
                                           ("http://128.0.0.1", "128.0.0.1"),
                                           ("http://[::2]:80", "::2"),
                                           ("http://", "")])
def test_other_hosts_are_refused_by_name(url, host):
    with pytest.raises(ValueError) as e:
        check_loopback(url)
    assert str(e.value) == (f"refusing to load-test {host!r}: only loopback targets "
                            "(127.0.0.0/8, ::1, localhost) are allowed")


@pytest.mark.parametrize("url", ["ftp://127.0.0.1/", "127.0.0.1:8000", "localhost"])
def test_other_schemes_are_refused_by_name(url):
    with pytest.raises(ValueError) as e:
        check_loopback(url)
    assert str(e.value) == f"--url must start with http:// or https://, got {url!r}"


# ---------------------------------------------------------------------------- summarize

def test_percentiles_worked_by_hand():
    """numpy's default (linear) percentile of 10..50 ms: rank (5 - 1)·q/100 between the
    sorted values, so p50 = 30, p90 = 40 + 0.6·10 = 46, p99 = 40 + 0.96·10 = 49.6."""
    lat = [0.040, 0.010, 0.050, 0.030, 0.020]  # not sorted: summarize must not assume it
    row = only_row([ok(256, "mita", "mita", 0.1 * i, x) for i, x in enumerate(lat)])
    assert (row["p50_ms"], row["p90_ms"], row["p99_ms"]) == (
        pytest.approx(30.0, rel=1e-12), pytest.approx(46.0, rel=1e-12),
        pytest.approx(49.6, rel=1e-12))
    two = only_row([ok(256, "mita", "mita", 0.0, 0.010), ok(256, "mita", "mita", 0.0, 0.030)])
    # rank 0.5, 0.9, 0.99 between 10 and 30 ms
    assert (two["p50_ms"], two["p90_ms"], two["p99_ms"]) == (
        pytest.approx(20.0), pytest.approx(28.0), pytest.approx(29.8))
    one = only_row([ok(256, "mita", "mita", 0.0, 0.0125)])
    assert one["p50_ms"] == one["p90_ms"] == one["p99_ms"] == pytest.approx(12.5)


def test_failed_requests_are_not_in_the_percentiles():
    """One 10 ms success and one refusal after 1000 ms: the latency is the success's 10 ms,
    not the 505 ms median of both."""
    row = only_row([ok(256, "mita", "mita", 0.0, 0.010), err(256, "mita", 503, 0.0, 1.0)])
    assert (row["p50_ms"], row["p90_ms"], row["p99_ms"]) == (
        pytest.approx(10.0), pytest.approx(10.0), pytest.approx(10.0))
    assert (row["sent"], row["ok"]) == (2, 1)


def test_throughput_errors_and_counts_worked_by_hand():
    """The phase's wall time runs from its first start to its last answer, failures included:
    here both are failures' (0.5 s and 2.0 + 2.5 = 4.5 s), so 4.0 s for 3 successes:
    0.75 req/s and 0.75 · 256 = 192 tokens/s."""
    samples = [
        err(256, "mita", 503, 0.5, 0.25, "overloaded"),  # the first start
        ok(256, "mita", "mita", 1.0, 0.5),
        err(256, "mita", 503, 1.0, 0.25, "overloaded"),
        ok(256, "mita", "mita", 1.5, 1.0),
        err(256, "mita", 422, 2.0, 2.5, "bad ids"),  # the last answer, at 4.5 s
        err(256, "mita", 0, 2.5, 0.125, "ConnectError"),
        ok(256, "mita", "mita", 3.0, 0.5),
    ]
    row = only_row(samples)
    assert row["throughput_rps"] == pytest.approx(0.75, rel=1e-12)
    assert row["tokens_per_s"] == pytest.approx(192.0, rel=1e-12)
    assert (row["n"], row["variant"], row["sent"], row["ok"]) == (256, "mita", 7, 3)
    assert list(row["errors"].items()) == [("503", 2), ("422", 1), ("0", 1)]  # first seen first
    assert row["served"] == {"mita": 3}

    # Under a second: 2 answers from 0.0 to 0.25 s are 8 req/s, 8 · 1024 tokens/s.
    short = only_row([ok(1024, "mita", "mita", 0.0, 0.25), ok(1024, "mita", "mita", 0.125, 0.125)])
    assert (short["throughput_rps"], short["tokens_per_s"]) == (
        pytest.approx(8.0), pytest.approx(8192.0))
    assert short["errors"] == {}
    # No wall time at all (one instant answer): no rate rather than a division by zero.
    instant = only_row([ok(256, "mita", "mita", 0.0, 0.0)])
    assert (instant["throughput_rps"], instant["tokens_per_s"]) == (None, None)
    assert instant["p50_ms"] == 0.0


def test_a_phase_without_successes():
    row = only_row([err(256, "dense", 503, 0.25 * i, 0.25) for i in range(3)])
    assert row == {"n": 256, "variant": "dense", "served": {}, "sent": 3, "ok": 0,
                   "errors": {"503": 3}, "served_n": None, "p50_ms": None, "p90_ms": None,
                   "p99_ms": None,
                   "throughput_rps": 0.0, "tokens_per_s": 0.0, "stages_ms": {}, "stages_n": {}}


def test_served_counts_and_stage_medians_with_a_missing_stage():
    """Per served variant, the median over the responses that were profiled (a response
    without stages is not one of them); a stage one profiled response lacks counts as 0 ms in
    it: dense ffn is the median of 1.0 and 0 = 0.5."""
    samples = [
        ok(512, "ab", "dense", 0.0, 0.1, {"attention": 4.0, "ffn": 1.0}),
        ok(512, "ab", "dense", 0.1, 0.1, {"attention": 6.0}),  # no ffn
        ok(512, "ab", "dense", 0.2, 0.1),  # not profiled
        ok(512, "ab", "mita", 0.3, 0.1, {"zeta": 1.0, "alpha": 2.0, "topk": 3.0}),
        ok(512, "ab", "mita", 0.4, 0.1, {"zeta": 3.0, "alpha": 4.0, "topk": 5.0}),
        ok(512, "ab", "mita", 0.5, 0.1, {"zeta": 2.0, "alpha": 9.0, "topk": 1.0}),
        err(512, "ab", 503, 0.6, 0.1),
    ]
    row = only_row(samples)
    assert row["served"] == {"dense": 3, "mita": 3}
    assert row["stages_ms"] == {"dense": {"attention": 5.0, "ffn": 0.5},
                                "mita": {"topk": 3.0, "alpha": 4.0, "zeta": 2.0}}
    assert row["stages_n"] == {"dense": 2, "mita": 3}
    # Known stages in forward order, others after them alphabetically.
    assert list(row["stages_ms"]["dense"]) == ["attention", "ffn"]
    assert list(row["stages_ms"]["mita"]) == ["topk", "alpha", "zeta"]

    unprofiled = only_row([ok(512, "mita", "mita", 0.0, 0.1)])
    assert (unprofiled["served"], unprofiled["stages_ms"], unprofiled["stages_n"]) == (
        {"mita": 1}, {}, {})
    fused = only_row([ok(512, "mita", "mita", 0.1 * i, 0.1, {"attention": 1.0 + i}, staged=False)
                      for i in range(4)])
    assert (fused["stages_ms"], fused["stages_n"]) == ({"mita": {"attention": 2.5}}, {"mita": 4})


def _ratio_samples():
    """1024: MiTA 30 and 50 ms over 2.0 s of wall time, dense 10 and 30 ms over 0.5 s.
    256: dense refused every time. 2048: MiTA only. 4096: MiTA refused every time."""
    return [
        ok(1024, "mita", "mita", 0.0, 0.030), ok(1024, "mita", "mita", 1.95, 0.050),
        ok(1024, "dense", "dense", 0.0, 0.010), ok(1024, "dense", "dense", 0.47, 0.030),
        ok(1024, "ab", "dense", 0.0, 0.500),
        ok(256, "mita", "mita", 0.0, 0.010), err(256, "dense", 503, 0.0, 0.010),
        ok(2048, "mita", "mita", 0.0, 0.010),
        err(4096, "mita", 503, 0.0, 0.010), ok(4096, "dense", "dense", 0.0, 0.010),
    ]


def test_mita_over_dense_ratios_worked_by_hand():
    """p50 40 / 20 ms = 2; p99 (30 + 0.99·20) / (10 + 0.99·20) = 49.8 / 29.8; throughput
    (2 / 2.0 s) / (2 / 0.5 s) = 0.25. Only where both variants answered at that N."""
    summary = summarize(_ratio_samples(), CFG)
    assert summary["ratios"] == [{"n": 1024,
                                  "p50_ratio_mita_over_dense": pytest.approx(2.0),
                                  "p99_ratio_mita_over_dense": pytest.approx(49.8 / 29.8),
                                  "throughput_ratio_mita_over_dense": pytest.approx(0.25)}]
    # Rows in (N, requested variant) order.
    assert [(r["n"], r["variant"]) for r in summary["rows"]] == [
        (256, "dense"), (256, "mita"), (1024, "ab"), (1024, "dense"), (1024, "mita"),
        (2048, "mita"), (4096, "dense"), (4096, "mita")]
    assert summary["config"] == asdict(CFG)
    assert set(summary) == {"config", "rows", "ratios"}


def test_ratios_for_each_n_in_order():
    samples = [ok(n, v, v, 0.0, lat) for n, v, lat in
               [(4096, "mita", 0.02), (4096, "dense", 0.08), (512, "dense", 0.01),
                (512, "mita", 0.03)]]
    samples += [ok(n, v, v, 0.5, 0.5) for n in (512, 4096) for v in ("mita", "dense")]
    ratios = summarize(samples, CFG)["ratios"]
    assert [x["n"] for x in ratios] == [512, 4096]
    # 512: mita 30, 500 ms, dense 10, 500 ms; p50 265 / 255; both 1 s walls, ratio 1.
    assert ratios[0]["p50_ratio_mita_over_dense"] == pytest.approx(265 / 255)
    assert ratios[1]["p50_ratio_mita_over_dense"] == pytest.approx(260 / 290)
    assert ratios[1]["throughput_ratio_mita_over_dense"] == pytest.approx(1.0)


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
