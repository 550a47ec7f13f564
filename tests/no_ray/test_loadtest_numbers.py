"""The load tester's numbers worked by hand: loopback checks, percentiles without failed requests,
throughput, counts, stage medians and the MiTA-over-dense ratios (no Ray, no timing; the
arrivals' timing: tests/own_ray/test_loadtest_arrivals.py)."""

from __future__ import annotations

from dataclasses import asdict

import pytest

from loadtest.engine import Sample, check_loopback, summarize

from ..helpers import LOAD_CFG, only_row


def ok(n, req, served, start, lat, stages=None, staged=True):
    return Sample(n, req, served, 200, start, lat, stages or {}, staged=staged)


def err(n, req, status, start, lat, error="x"):
    return Sample(n, req, None, status, start, lat, error=error)




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
    summary = summarize(_ratio_samples(), LOAD_CFG)
    assert summary["ratios"] == [{"n": 1024,
                                  "p50_ratio_mita_over_dense": pytest.approx(2.0),
                                  "p99_ratio_mita_over_dense": pytest.approx(49.8 / 29.8),
                                  "throughput_ratio_mita_over_dense": pytest.approx(0.25)}]
    # Rows in (N, requested variant) order.
    assert [(r["n"], r["variant"]) for r in summary["rows"]] == [
        (256, "dense"), (256, "mita"), (1024, "ab"), (1024, "dense"), (1024, "mita"),
        (2048, "mita"), (4096, "dense"), (4096, "mita")]
    assert summary["config"] == asdict(LOAD_CFG)
    assert set(summary) == {"config", "rows", "ratios"}


def test_ratios_for_each_n_in_order():
    samples = [ok(n, v, v, 0.0, lat) for n, v, lat in
               [(4096, "mita", 0.02), (4096, "dense", 0.08), (512, "dense", 0.01),
                (512, "mita", 0.03)]]
    samples += [ok(n, v, v, 0.5, 0.5) for n in (512, 4096) for v in ("mita", "dense")]
    ratios = summarize(samples, LOAD_CFG)["ratios"]
    assert [x["n"] for x in ratios] == [512, 4096]
    # 512: mita 30, 500 ms, dense 10, 500 ms; p50 265 / 255; both 1 s walls, ratio 1.
    assert ratios[0]["p50_ratio_mita_over_dense"] == pytest.approx(265 / 255)
    assert ratios[1]["p50_ratio_mita_over_dense"] == pytest.approx(260 / 290)
    assert ratios[1]["throughput_ratio_mita_over_dense"] == pytest.approx(1.0)
