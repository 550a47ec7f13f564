"""The live dashboard: /v1/stats against the metrics endpoint, and the page in real Chromium.

The browser test drives Debian's ``chromium`` through its ``chromedriver`` (selenium); it is
skipped where they are missing unless MITA_SERVE_REQUIRE_CHROMIUM=1 (``.ci/run`` sets it and
installs them). The screenshot goes to ``test-artifacts/dashboard.png``.
"""

from __future__ import annotations

import base64
import json
import math
import os
import re
import shutil
import subprocess
import tempfile
import threading
import time
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from mita.data.listops import encode, generate_long
from mita.hooks import MIN_STAGE_SAMPLES, STAGE_COLORS, STAGE_ORDER, VARIANT_COLORS
from service.metrics import DURATION_BUCKETS_S
from service.stats import StatsWindow

from .conftest import set_gateway, wait_for
from .helpers import EXAMPLES

ROOT = Path(__file__).resolve().parent.parent
ARTIFACTS = ROOT / "test-artifacts"
LABELS = ("variant", "stage", "n_bucket", "status", "primary", "agree", "le")
DENSE_STAGES = ["embed", "qkv_proj", "attention", "out_proj", "ffn", "head"]
FAMILIES = ("ray_mita_serve_requests_total", "ray_mita_serve_shadow_comparisons_total",
            *(f"ray_mita_serve_{m}_duration_seconds_{s}" for m in ("request", "stage")
              for s in ("count", "sum", "bucket")),
            "ray_mita_serve_shadow_kl_divergence_bucket")


def metric_snapshot(service) -> dict[str, dict[tuple, float]]:
    """{family: {sorted labels: value}} summed over replicas, as ``test_service.samples``;
    Ray's endpoint serves ~1 MB, so only the service's own lines are parsed, once."""
    text = "\n".join(x for x in service.metrics_text().splitlines() if "mita_serve_" in x)
    out: dict[str, dict[tuple, float]] = {f: {} for f in FAMILIES}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name in out:
                labels = tuple(sorted((k, v) for k, v in s.labels.items() if k in LABELS))
                out[s.name][labels] = out[s.name].get(labels, 0.0) + s.value
    return out


def delta(before: dict, after: dict, family: str, keep_zero: bool = False
          ) -> dict[tuple, float]:
    """Increases of one family (non-zero ones unless ``keep_zero``), keyed by its labels as
    a sorted tuple."""
    out = {k: v - before[family].get(k, 0.0) for k, v in after[family].items()}
    return {k: v for k, v in out.items() if keep_zero or abs(v) > 1e-12}


def settled(service, quiet_s: float = 2.5) -> dict:
    """A metrics snapshot that has not changed for ``quiet_s`` (earlier requests have all
    reached the endpoint, which exports every 0.5 s in the tests and shows them ~2 s
    later)."""
    def counts(snap):  # whole numbers, exact (sums differ in the last bit by label order)
        return {f: v for f, v in snap.items() if not f.endswith("_sum")}
    last = metric_snapshot(service)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        time.sleep(quiet_s)
        now = metric_snapshot(service)
        if counts(now) == counts(last):
            return now
        last = now
    raise AssertionError("metrics never settled")


def quantile_bounds(buckets: dict[float, float], q: float) -> tuple[float, float]:
    """Bounds in seconds on numpy's linear-interpolated q-quantile of the samples that fell
    into these histogram buckets ({upper edge: cumulative count}): the quantile lies between
    the order statistics around rank (n − 1)·q, so between the lower edge of the bucket
    holding the first and the upper edge of the bucket holding the second."""
    edges = sorted(buckets)
    n = buckets[math.inf]
    rank = (n - 1) * q
    lo_i, hi_i = math.floor(rank) + 1, math.ceil(rank) + 1  # 1-based order statistics
    lo_edge = next(i for i, e in enumerate(edges) if buckets[e] >= lo_i)
    hi_edge = next(e for e in edges if buckets[e] >= hi_i)
    return (edges[lo_edge - 1] if lo_edge else 0.0), hi_edge


def sum_bounds(buckets: dict[float, float]) -> tuple[float, float]:
    """Bounds on the true sum of the samples in these histogram buckets: each sample lies
    between its bucket's edges. (Ray exports ``_sum`` as count × bucket midpoint, an
    approximation, so the real sum can only be checked against the buckets.)"""
    edges, lo, hi, prev_edge, prev_count = sorted(buckets), 0.0, 0.0, 0.0, 0.0
    for e in edges:
        n = buckets[e] - prev_count
        lo, hi = lo + n * prev_edge, hi + n * e if n else hi
        prev_edge, prev_count = e, buckets[e]
    return lo, hi


def by_labels(rows: dict[tuple, float], **fixed) -> dict[tuple, float]:
    return {k: v for k, v in rows.items() if all(dict(k).get(a) == b for a, b in fixed.items())}


@pytest.mark.service
def test_stats_match_metrics_endpoint(service):
    """A known set of requests (both variants, two N buckets, shadow on, two refusals):
    /v1/stats over exactly that window equals the metrics endpoint's increases."""
    long_text, _ = generate_long(2048, seed=11)
    plan = ([(t, "mita") for t, _ in EXAMPLES[:4]] + [(t, "dense") for t, _ in EXAMPLES[4:7]]
            + [(long_text, "mita"), (long_text, "dense")])
    set_gateway(service)  # shadow off: no comparison of these reaches the window below
    # Each text's answer from each variant, asked before the window: the KL
    # every comparison should record is KL(dense ‖ MiTA) of these, whichever was primary.
    probs = {(t, v): service.post("/v1/classify", json={"text": t, "variant": v}
                                  ).json()["probabilities"]
             for t, _ in plan for v in ("mita", "dense")}
    want_kl = [sum(d * math.log(d / m) for d, m in zip(probs[t, "dense"], probs[t, "mita"],
                                                         strict=True) if d > 0)
               for t, _ in plan]
    # The old meaning, KL(primary ‖ shadow), is KL(MiTA ‖ dense) on the MiTA-primary texts:
    # their two directions differ by more than 10× the 1e-4 tolerance below (of the mean),
    # so the old meaning cannot pass for this one.
    back_kl = [sum(m * math.log(m / d) for d, m in zip(probs[t, "dense"], probs[t, "mita"],
                                                         strict=True) if m > 0)
               for t, _ in plan]
    gap = sum(b - w for b, w, (_, v) in zip(back_kl, want_kl, plan, strict=True) if v == "mita")
    assert abs(gap) > 1e-3 * sum(want_kl), (want_kl, back_kl)
    set_gateway(service, shadow=True)
    try:
        before = settled(service)
        t0 = time.time()
        for text, variant in plan:
            r = service.post("/v1/classify", json={"text": text, "variant": variant})
            assert r.status_code == 200 and r.json()["shadow"] != variant, r.text
        for bad in ({"text": ""}, {"ids": [99]}):
            assert service.post("/v1/classify", json=bad).status_code == 422

        def landed():  # every request, stage and shadow comparison reached the endpoint
            after = metric_snapshot(service)
            total = {f: sum(delta(before, after, f).values()) for f in FAMILIES}
            return after if (total["ray_mita_serve_shadow_comparisons_total"] == len(plan)
                             and total["ray_mita_serve_requests_total"] == len(plan) + 2
                             and total["ray_mita_serve_stage_duration_seconds_count"]
                             == len(plan) * (len(STAGE_ORDER) + len(DENSE_STAGES))) else None
        after = wait_for(landed)
        assert after, "the requests' metrics never reached the metrics endpoint"
        # t0 was preceded by `quiet_s` without activity: a 0.5 s margin takes nothing older.
        r = service.client.get("/v1/stats", params={"window_s": time.time() - t0 + 0.5})
    finally:
        set_gateway(service, shadow=False)
    assert r.status_code == 200, r.text
    stats = r.json()
    assert stats["source"] == "local" and stats["scope"] == "replica"

    # Requests by variant and status: exactly the plan, and exactly the counter's increase.
    want = {("mita", "200"): 5, ("dense", "200"): 4, ("none", "422"): 2}
    got = {(x["variant"], x["status"]): x["count"] for x in stats["requests"]}
    assert got == want
    counter = delta(before, after, "ray_mita_serve_requests_total")
    assert {(dict(k)["variant"], dict(k)["status"]): v for k, v in counter.items()} == want
    # Every request named its variant: overrides, none routed by the policy.
    assert (stats["ab"]["observed"], stats["ab"]["observed_requests"]) == ({}, 0)
    assert stats["ab"]["overrides"] == {"mita": 5, "dense": 4}
    assert stats["ab"]["observed_basis"] == "policy_routed"
    assert stats["ab"]["weights"] == {"mita": 0.5, "dense": 0.5} and stats["ab"]["shadow"]

    # Request latency per variant and N bucket: counts, sums, and quantiles inside the
    # histogram's own bounds.
    counts = delta(before, after, "ray_mita_serve_request_duration_seconds_count")
    assert {(x["variant"], x["n_bucket"]): x["count"] for x in stats["latency"]} == {
        (dict(k)["variant"], dict(k)["n_bucket"]): v for k, v in counts.items()} == {
        ("mita", "le_1024"): 4, ("mita", "le_4096"): 1, ("dense", "le_1024"): 3,
        ("dense", "le_4096"): 1}
    buckets = delta(before, after, "ray_mita_serve_request_duration_seconds_bucket", True)
    for row in stats["latency"]:
        hist = {float(dict(k)["le"]): v for k, v in by_labels(
            buckets, variant=row["variant"], n_bucket=row["n_bucket"]).items()}
        lo, hi = sum_bounds(hist)
        assert lo <= row["sum_ms"] / 1e3 <= hi, (row, lo, hi)
        assert hist[math.inf] == row["count"]
        for q in (50, 95, 99):
            lo, hi = quantile_bounds(hist, q / 100)
            assert lo <= row[f"p{q}_ms"] / 1e3 <= hi, (row, q, lo, hi)

    # Stages: every (variant, N bucket, stage) series, primary and shadow runs alike.
    counts = delta(before, after, "ray_mita_serve_stage_duration_seconds_count")
    sums = delta(before, after, "ray_mita_serve_stage_duration_seconds_sum")
    buckets = delta(before, after, "ray_mita_serve_stage_duration_seconds_bucket", True)
    rows = {(x["variant"], x["n_bucket"], x["stage"]): x for x in stats["stages"]}
    assert set(rows) == {(dict(k)["variant"], dict(k)["n_bucket"], dict(k)["stage"])
                         for k in counts}
    runs = {"le_1024": 7, "le_4096": 2}  # each request ran both variants (shadow)
    for variant, stages in (("mita", list(STAGE_ORDER)), ("dense", DENSE_STAGES)):
        for b, n in runs.items():
            assert [s for v, nb, s in rows if v == variant and nb == b] == stages
            for stage in stages:
                row = rows[variant, b, stage]
                key = (("n_bucket", b), ("stage", stage), ("variant", variant))
                assert row["count"] == counts[key] == n
                assert row["p50_ms"] > 0
                hist = {float(dict(k)["le"]): v for k, v in by_labels(
                    buckets, variant=variant, n_bucket=b, stage=stage).items()}
                assert len(hist) == len(DURATION_BUCKETS_S) + 1
                lo, hi = sum_bounds(hist)
                assert lo <= row["sum_ms"] / 1e3 <= hi, (row, lo, hi)
                assert sums[key] > 0  # Ray's midpoint-approximated sum
                for q in (50, 95):
                    lo, hi = quantile_bounds(hist, q / 100)
                    assert lo <= row[f"p{q}_ms"] / 1e3 <= hi, (row, q, lo, hi)

    # Shadow agreement: the counter's increase, by agree.
    shadow = delta(before, after, "ray_mita_serve_shadow_comparisons_total")
    agree = sum(by_labels(shadow, agree="true").values())
    assert stats["shadow"]["comparisons"] == len(plan) == sum(shadow.values())
    assert stats["shadow"]["agree"] == agree
    assert stats["shadow"]["rate"] == pytest.approx(agree / len(plan))
    # Its KL: mean and median inside the bounds the KL histogram's buckets allow.
    hist: dict[float, float] = {}  # both primaries' series summed
    for k, v in delta(before, after, "ray_mita_serve_shadow_kl_divergence_bucket", True).items():
        hist[float(dict(k)["le"])] = hist.get(float(dict(k)["le"]), 0.0) + v
    assert hist[math.inf] == len(plan)
    # The KL itself: /v1/stats' mean and median are of exactly these values (1e-4 relative:
    # a shadow forward may share a padded batch with the next primary, which moves the
    # probabilities in their last float32 bits), and each comparison is in the bucket of
    # the metric its value falls in, per primary.
    assert stats["shadow"]["kl_mean"] == pytest.approx(float(np.mean(want_kl)), rel=1e-4)
    assert stats["shadow"]["kl_p50"] == pytest.approx(float(np.median(want_kl)), rel=1e-4)
    for primary in ("mita", "dense"):
        mine = [kl for kl, (_, v) in zip(want_kl, plan, strict=True) if v == primary]
        got = {float(dict(k)["le"]): v for k, v in by_labels(
            delta(before, after, "ray_mita_serve_shadow_kl_divergence_bucket", True),
            primary=primary).items()}
        # each value within 1e-4 relative (as above), so one by a bucket edge may fall either side
        for e, count in got.items():
            assert (sum(kl * (1 + 1e-4) <= e for kl in mine) <= count
                    <= sum(kl * (1 - 1e-4) <= e for kl in mine)), (primary, e, mine, got)
    lo, hi = sum_bounds(hist)
    assert lo / len(plan) <= stats["shadow"]["kl_mean"] <= hi / len(plan), (stats, hist)
    lo, hi = quantile_bounds(hist, 0.5)
    assert lo <= stats["shadow"]["kl_p50"] <= hi, (stats, hist)

    # Ratio and timeline follow from the same records. Like for like: in le_1024 the two
    # variants served different sequences (no N in common unless two lengths coincide); in
    # le_4096 both served N = 2048 once, so the ratio is that pair's.
    p50 = {(x["variant"], x["n_bucket"]): x["p50_ms"] for x in stats["latency"]}
    short = {len(encode(t)) for t, _ in EXAMPLES[:4]} & {len(encode(t)) for t, _ in EXAMPLES[4:7]}
    ratios = {x["n_bucket"]: x for x in stats["ratios"]}
    assert set(ratios) == ({"le_1024"} if short else set()) | {"le_4096"}
    assert ratios["le_4096"] == {
        "n_bucket": "le_4096", "ratio": pytest.approx(p50["mita", "le_4096"]
                                                      / p50["dense", "le_4096"]),
        "mita_p50_ms": p50["mita", "le_4096"], "dense_p50_ms": p50["dense", "le_4096"],
        "like_for_like": True, "n_values": 1, "n_min": 2048, "n_max": 2048}
    for variant, n, by_bucket in (("mita", 5, {"le_1024": 4, "le_4096": 1}),
                                  ("dense", 4, {"le_1024": 3, "le_4096": 1})):
        points = [p for p in stats["timeline"] if p["variant"] == variant]
        assert sum(p["requests"] for p in points) == n
        assert all(p["rps"] == p["requests"] / stats["bin_s"] for p in points)
        for b, count in by_bucket.items():
            points = [p for p in stats["timeline_by_n"]
                      if p["variant"] == variant and p["n_bucket"] == b]
            assert len(points) == len(stats["timeline"]) // 2
            assert sum(p["requests"] for p in points) == count
    assert list(stats["stage_colors"]) == list(STAGE_ORDER)

    mita, dense = stats["models"]["mita"], stats["models"]["dense"]
    assert (mita["m"], mita["k"], mita["s"], mita["attention"]) == (16, 16, 1, "mita")
    assert (dense["m"], dense["attention"]) == (None, "dense")
    assert mita["model_id"] == dense["model_id"] and mita["model_id"].startswith(
        "listops-default@")


@pytest.mark.service
def test_stats_endpoint_contract(service):
    c = service.client
    for bad in ("0", "-3", "nan", "inf", "abc", "100000"):
        r = c.get("/v1/stats", params={"window_s": bad})
        assert r.status_code == 422 and "window_s" in r.json()["error"], (bad, r.text)
    r = c.get("/v1/stats", params={"window_s": 3600})
    assert r.status_code == 200 and r.json()["window_s"] == 300  # capped at stats_window_s
    spec = c.get("/openapi.json").json()
    op = spec["paths"]["/v1/stats"]["get"]
    assert op["responses"]["200"]["content"]["application/json"]["schema"]["$ref"].endswith(
        "/StatsResponse")
    assert {"422", "502"} <= set(op["responses"])
    assert "text/html" in spec["paths"]["/dashboard"]["get"]["responses"]["200"]["content"]
    page = c.get("/dashboard")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "default-src 'self'" in page.headers["content-security-policy"]
    js = c.get("/dashboard/dashboard.js")
    assert js.status_code == 200 and js.headers["content-type"].startswith("text/javascript")
    # Nothing is loaded from anywhere but the gateway itself.
    assert "http" not in page.text.replace("http://www.w3.org", "")
    assert "http" not in js.text.replace("http://www.w3.org/2000/svg", "")


def test_window_summary_against_numpy():
    w = StatsWindow(retention_s=60, max_records=50)
    rng = np.random.default_rng(0)
    lat = rng.uniform(0.001, 0.2, 40)
    for i, x in enumerate(lat):
        w.add_request("mita" if i % 4 else "dense", 200, 1000, float(x))
        w.add_forward("mita", "le_1024", {"embed": float(x) * 10, "topk": 1.0})
    w.add_request("none", 413)
    w.add_shadow("mita", True, 0.1)
    w.add_shadow("dense", False, 0.4)
    s = w.summary()
    mita = lat[[i % 4 != 0 for i in range(40)]] * 1e3
    row = next(r for r in s["latency"] if r["variant"] == "mita")
    assert row["count"] == 30 and row["sum_ms"] == pytest.approx(mita.sum())
    assert [row["p50_ms"], row["p95_ms"], row["p99_ms"]] == pytest.approx(
        list(np.percentile(mita, [50, 95, 99])))
    embed = next(r for r in s["stages"] if r["stage"] == "embed")
    assert embed["p95_ms"] == pytest.approx(np.percentile(lat * 10, 95))
    assert [r["stage"] for r in s["stages"]] == ["embed", "topk"]  # forward order
    assert s["shadow"] == {"comparisons": 2, "agree": 1, "rate": 0.5,
                           "kl_mean": pytest.approx(0.25), "kl_p50": pytest.approx(0.25),
                           "dropped": 0}
    assert s["requests"][-1] == {"variant": "none", "status": "413", "count": 1}
    assert sum(p["requests"] for p in s["timeline"]) == 40 and not s["truncated"]
    assert len(s["timeline"]) in (2 * 60, 2 * 61) and s["bin_s"] == 1
    # The record cap: 41 requests into 50 places is fine, 60 more cut the window short.
    for _ in range(60):
        w.add_request("dense", 200, 1000, 0.01)
    assert w.summary()["truncated"]
    # Records older than the retention are dropped.
    w.requests.appendleft((time.time() - 61, "mita", "200", 1000, 1.0, False))
    w.retention_s = 30
    assert w.summary(window_s=1000)["window_s"] == 30
    assert all(r[0] >= time.time() - 31 for r in w.requests)


def test_ratio_compares_like_with_like():
    """The bucket N ≤ 1,024 holds N = 1,024 (MiTA 0.74× dense, as a load test measured) and
    N = 128 (MiTA 2× dense: its routing costs more than short dense attention). MiTA served
    mostly N = 1,024 and dense mostly N = 128, so the bucket's medians (the old ratio) put
    MiTA at 7.4×; like for like it is the weighted geometric mean of 0.74 and 2."""
    w = StatsWindow(retention_s=60)
    plan = [("mita", 1024, 0.074, 9), ("dense", 1024, 0.100, 1),
            ("mita", 128, 0.020, 1), ("dense", 128, 0.010, 9),
            ("mita", 300, 0.050, 5)]  # no dense request at N = 300: not compared
    for variant, n, latency, times in plan:
        for _ in range(times):
            w.add_request(variant, 200, n, latency)
    s = w.summary()
    bucket = {(r["variant"]): r["p50_ms"] for r in s["latency"]}
    assert bucket["mita"] / bucket["dense"] == pytest.approx(74 / 10)  # the mix, not MiTA
    (row,) = s["ratios"]
    # Each N weighs min(mita, dense) = 1 request: exp(mean(log 0.74, log 2)).
    assert row["ratio"] == pytest.approx(math.sqrt(0.74 * 2.0))
    assert (row["like_for_like"], row["n_values"], row["n_min"], row["n_max"]) == (
        True, 2, 128, 1024)
    # Medians over the matched requests only (the 5 at N = 300 left out).
    assert row["mita_p50_ms"] == pytest.approx(74.0) and row["dense_p50_ms"] == 10.0
    w.add_request("dense", 200, 128, 0.010)  # weights 1 and 1 still: same answer
    assert w.summary()["ratios"][0]["ratio"] == pytest.approx(math.sqrt(0.74 * 2.0))
    for _ in range(2):  # N = 128 now weighs 3, N = 1,024 still 1
        w.add_request("mita", 200, 128, 0.020)
    assert w.summary()["ratios"][0]["ratio"] == pytest.approx((0.74 * 2.0 ** 3) ** 0.25)


def test_prometheus_stats_draw_only_buckets_answered_in_the_window():
    """Ray keeps exporting a histogram after its last request, so rate() gives a series of
    zeros for a bucket served long before the window: it must not get a chart (it did, an
    empty one). Ratios from Prometheus say they are not like for like."""
    from service.stats import INSTANT, RANGE, _prometheus_stats

    now, bin_s = 1_000_000.0, 5.0
    steps = [now - 10, now - 5, now]

    def instant(rows):
        return [{"metric": m, "value": [now, str(v)]} for m, v in rows]

    def ranged(rows):
        return [{"metric": m, "values": [[t, str(v)] for t, v in zip(steps, vs, strict=True)]}
                for m, vs in rows]
    mita, dense = {"variant": "mita", "n_bucket": "le_1024"}, {"variant": "dense",
                                                                "n_bucket": "le_1024"}
    res = {k: [] for k in (*INSTANT, *RANGE)}
    res |= {"lat_count": instant([(mita, 6), (dense, 3)]),
            "lat_sum": instant([(mita, 0.6), (dense, 0.6)]),
            "lat_p50": instant([(mita, 0.1), (dense, 0.2)]),
            "requests": instant([({"variant": "mita", "status": "200"}, 6),
                                 ({"variant": "dense", "status": "200"}, 3)]),
            "rps": ranged([({"variant": "mita"}, [0, 0.6, 0.6]),
                           ({"variant": "dense"}, [0, 0.3, 0.3])]),
            "n_rps": ranged([(mita, [0, 0.6, 0.6]), (dense, [0, 0.3, 0.3]),
                             ({"variant": "mita", "n_bucket": "le_4096"}, [0, 0, 0])]),
            "n_p50": ranged([(mita, ["NaN", 0.1, 0.1]), (dense, ["NaN", 0.2, 0.2])])}
    s = _prometheus_stats(res, now, 15.0, bin_s, steps)
    assert {(p["variant"], p["n_bucket"]) for p in s["timeline_by_n"]} == {
        ("mita", "le_1024"), ("dense", "le_1024")}
    mita_points = [p for p in s["timeline_by_n"] if p["variant"] == "mita"]
    assert [p["p50_ms"] for p in mita_points] == [None, 100.0, 100.0]
    assert [p["requests"] for p in mita_points] == [0, 3.0, 3.0]
    (ratio,) = s["ratios"]
    assert ratio["ratio"] == pytest.approx(0.5) and ratio["like_for_like"] is False


def stats_body(summary: dict, weights: dict | None = None, shadow: bool = True) -> dict:
    """A summary completed as the gateway's ``/v1/stats`` completes it (the A/B split, the
    models, the colours), checked against ``StatsResponse``."""
    from service.schemas import StatsResponse
    from service.stats import ab_split

    body = dict(summary)
    body["ab"] = ab_split(body.pop("answered"), weights or {"mita": 0.8, "dense": 0.2}, shadow,
                          "x-client-key")
    body["models"] = {"mita": {"model_id": "listops-default@test", "attention": "mita",
                               "device": "cpu", "dtype": "float32", "m": 16, "k": 16, "s": 1},
                      "dense": {"model_id": "listops-default@test", "attention": "dense",
                                "device": "cpu", "dtype": "float32"}}
    body["stage_colors"], body["variant_colors"] = STAGE_COLORS, VARIANT_COLORS
    StatsResponse.model_validate(body)
    return body


def counted_window() -> StatsWindow:
    """Fixed records: 8 requests routed by the policy (6 mita, 2 dense), 5 that named dense
    (a load test's), one policy-routed 503; MiTA's stages from 2 staged forwards in N ≤ 1,024
    (too few) and 6 in N ≤ 4,096, dense's from 6 in each; three shadow comparisons."""
    w = StatsWindow(retention_s=60)
    for variant, override, times in (("mita", False, 6), ("dense", False, 2), ("dense", True, 5)):
        for i in range(times):
            w.add_request(variant, 200, 512, 0.01 * (i + 1), override=override)
    w.add_request("dense", 503)
    for bucket, mita_runs in (("le_1024", 2), ("le_4096", 6)):
        for i in range(mita_runs):
            w.add_forward("mita", bucket, {"qkv_proj": 13.7 - i, "attention": 3.0 + i})
        for i in range(6):
            w.add_forward("dense", bucket, {"qkv_proj": 2.0 + 0.1 * i, "attention": 9.0 + i})
    for primary, agree, kl in (("mita", True, 0.01), ("mita", True, 0.02), ("dense", False, 0.5)):
        w.add_shadow(primary, agree, kl)
    for variant in ("dense", "dense", "mita", "dense"):  # shadow calls that gave no comparison
        w.add_shadow_drop(variant)
    return w


def test_stats_give_stage_counts_shadow_kl_and_the_policy_split():
    """Found by a user: stage figures from 1-2 samples without a count, the shadow KL recorded
    but not shown, and an "observed" split of 63/37 against a configured 80/20 while the
    policy-routed traffic was 80/20: the load test's requests that named their variant were
    counted as the policy's. Dropped shadow calls are counted apart from the comparisons (they
    have no KL)."""
    s = counted_window().summary()
    assert s["shadow"] == {"comparisons": 3, "agree": 2, "rate": pytest.approx(2 / 3),
                           "kl_mean": pytest.approx(0.53 / 3), "kl_p50": pytest.approx(0.02),
                           "dropped": 4}
    assert s["min_stage_samples"] == MIN_STAGE_SAMPLES == 5
    counts = {(r["variant"], r["n_bucket"], r["stage"]): r["count"] for r in s["stages"]}
    assert counts["mita", "le_1024", "qkv_proj"] == 2 and counts["mita", "le_4096", "qkv_proj"] == 6
    assert counts["dense", "le_1024", "qkv_proj"] == 6
    body = stats_body(s)
    assert body["ab"] == {"weights": {"mita": 0.8, "dense": 0.2}, "shadow": True,
                          "sticky_header": "x-client-key",
                          "observed": {"mita": 0.75, "dense": 0.25}, "observed_requests": 8,
                          "observed_basis": "policy_routed",
                          "overrides": {"mita": 0, "dense": 5}}
    # The request counts still count every request, overrides included.
    assert {(r["variant"], r["status"]): r["count"] for r in s["requests"]} == {
        ("mita", "200"): 6, ("dense", "200"): 7, ("dense", "503"): 1}


def test_prometheus_stats_give_the_kl_and_say_what_observed_counts():
    """Prometheus mode: the KL from the KL histogram (mean from Ray's midpoint sum, p50 from
    histogram_quantile); its request counter does not say how a request was routed, so the
    observed split is of all answered requests and says so, and overrides are unknown."""
    from service.stats import INSTANT, RANGE, _prometheus_stats

    now = 1_000_000.0
    res = {k: [] for k in (*INSTANT, *RANGE)}
    res |= {"requests": [{"metric": {"variant": v, "status": "200"}, "value": [now, str(c)]}
                         for v, c in (("mita", 30), ("dense", 10))],
            "shadow": [{"metric": {"agree": "true"}, "value": [now, "9"]},
                       {"metric": {"agree": "false"}, "value": [now, "1"]}],
            "kl_mean": [{"metric": {}, "value": [now, "0.042"]}],
            "kl_p50": [{"metric": {}, "value": [now, "0.03"]}],
            "shadow_dropped": [{"metric": {}, "value": [now, "7"]}]}
    s = _prometheus_stats(res, now, 300.0, 5.0, [now])
    assert s["shadow"] == {"comparisons": 10, "agree": 9, "rate": 0.9, "kl_mean": 0.042,
                           "kl_p50": 0.03, "dropped": 7}
    ab = stats_body(s)["ab"]
    assert (ab["observed"], ab["observed_basis"], ab["overrides"]) == (
        {"mita": 0.75, "dense": 0.25}, "all_answered", None)
    # No comparisons: no KL (Prometheus answers NaN for 0 / 0).
    res |= {"shadow": [], "kl_mean": [{"metric": {}, "value": [now, "NaN"]}]}
    s = _prometheus_stats(res, now, 300.0, 5.0, [now])
    assert (s["shadow"]["kl_mean"], s["shadow"]["kl_p50"]) == (None, None)


@contextmanager
def dashboard_without_ray(body: dict):
    """The dashboard's page and script as the gateway serves them, with ``body`` as its
    /v1/stats, on a loopback port: the page in a browser with fixed data and no service."""
    static = ROOT / "service" / "static"
    files = {"/dashboard": ((static / "dashboard.html").read_bytes(), "text/html"),
             "/dashboard/dashboard.js": ((static / "dashboard.js").read_bytes(),
                                         "text/javascript"),
             "/v1/stats": (json.dumps(body).encode(), "application/json")}

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            found = files.get(self.path.split("?")[0])
            if found is None:
                self.send_error(404)
                return
            data, ctype = found
            self.send_response(200)
            self.send_header("content-type", f"{ctype}; charset=utf-8")
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()
        server.server_close()


# ---- the page in a real browser ------------------------------------------------------------

_required = os.environ.get("MITA_SERVE_REQUIRE_CHROMIUM") == "1"
CHROMIUM_FLAGS = ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic",
                  "--no-first-run", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--disable-dev-shm-usage",
                  "--window-size=1400,1200")


@pytest.fixture
def browser():
    chromium, driver = shutil.which("chromium"), shutil.which("chromedriver")
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        webdriver = None
    if not (chromium and driver and webdriver):
        if _required:
            pytest.fail("chromium, chromium-driver or selenium missing but "
                        "MITA_SERVE_REQUIRE_CHROMIUM=1")
        pytest.skip("chromium/chromium-driver not installed (.ci/run installs Debian's)")
    opts = webdriver.ChromeOptions()
    opts.binary_location = chromium
    with tempfile.TemporaryDirectory(prefix="chromium-") as profile:
        for flag in (*CHROMIUM_FLAGS, f"--user-data-dir={profile}"):
            opts.add_argument(flag)
        opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
        b = webdriver.Chrome(options=opts, service=Service(driver))
        try:
            yield b
        finally:
            b.quit()


@pytest.mark.service
def test_dashboard_page_in_chromium(service, browser):
    """After requests of both variants in two N buckets with shadow on, the page draws every
    stage of both variants with non-zero p50, the latency/throughput lines, the ratio bars,
    the shadow rate and m/k/s; no console errors; full-page screenshot saved."""
    long_text, _ = generate_long(3000, seed=12)
    set_gateway(service, shadow=True)
    try:
        for variant in ("mita", "dense"):
            for text in [t for t, _ in EXAMPLES[:3]] + [long_text]:
                r = service.post("/v1/classify", json={"text": text, "variant": variant})
                assert r.status_code == 200, r.text
        assert wait_for(lambda: service.client.get("/v1/stats").json()["shadow"]["comparisons"]
                        >= 8)

        browser.get(f"{service.url}/dashboard")

        def drawn():
            bars = browser.execute_script(
                "return [...document.querySelectorAll('#stages g.bar')].map(g => "
                "[g.dataset.variant, g.dataset.stage, +g.dataset.p50, g.closest('svg')"
                ".dataset.bucket])")
            return bars if {b[0] for b in bars} == {"mita", "dense"} else None
        bars = wait_for(drawn, 30)
        assert bars, browser.find_element("tag name", "body").text[:2000]
        page_text = browser.find_element("tag name", "body").text
        ab_text = browser.find_element("id", "ab").text
        shadow_text = browser.find_element("id", "shadow").text
        models_rows = browser.execute_script(
            "return [...document.querySelectorAll('#models tr[data-variant]')].map(r => "
            "[...r.cells].map(c => c.textContent))")
        series = browser.execute_script(
            "return [...document.querySelectorAll('path.series')].map(p => "
            "[p.closest('svg').id || p.closest('svg').dataset.bucket, p.dataset.variant, "
            "p.dataset.key])")
        ratio = browser.execute_script(
            "return [...document.querySelectorAll('#ratio g.ratio')].map(g => "
            "[g.dataset.bucket, +g.dataset.ratio, g.dataset.likeForLike, g.textContent])")
        swatches = browser.execute_script(
            "return [...document.querySelectorAll('#stages rect.stage-swatch')].map(r => "
            "[r.dataset.stage, r.getAttribute('fill')])")
        t0s = browser.execute_script(
            "return [...document.querySelectorAll('#latency svg, #throughput-chart')].map(c => "
            "+c.dataset.t0)")
        timeline = service.client.get("/v1/stats").json()["timeline"]
        legend = browser.execute_script(
            "return [...document.querySelectorAll('#legend [data-variant]')].map(e => "
            "e.textContent)")
        ARTIFACTS.mkdir(exist_ok=True)
        width, height = browser.execute_script(
            "const e = document.documentElement; return [e.scrollWidth, e.scrollHeight]")
        shot = browser.execute_cdp_cmd("Page.captureScreenshot", {  # the whole page
            "format": "png", "captureBeyondViewport": True,
            "clip": {"x": 0, "y": 0, "width": width, "height": height, "scale": 1}})
        (ARTIFACTS / "dashboard.png").write_bytes(base64.b64decode(shot["data"]))
        # Prometheus-mode counts (increase() estimates) showed "106.6 of 143.2 labels agree"
        counts = browser.execute_script("return [fmtCount(106.6), fmtCount(143), fmtCount(0)]")
        # A bucket where only dense has stage timings (MiTA's forwards ran fused) says so.
        notes = browser.execute_script(
            "const row = {variant: 'dense', stage: 'attention', p50_ms: 5, p95_ms: 6, count: 5};"
            "const one = stageChart('le_16384', [row], ['attention']);"
            "const both = stageChart('le_16384', [row, {...row, variant: 'mita'}], "
            "['attention']);"
            "return [[...one.querySelectorAll('text.sub')].map(t => t.textContent), "
            "both.querySelectorAll('text.sub').length]")
        # 1 h offered, 300 s kept: the page said only "last 300 s"
        browser.get(f"{service.url}/dashboard?window_s=3600")
        capped = wait_for(lambda: (lambda t: t if "asked" in t else None)(
            browser.find_element("id", "updated").text), 30)
        logs = browser.get_log("browser")
    finally:
        set_gateway(service, shadow=False)

    for bucket in ("le_1024", "le_4096"):
        for variant, stages in (("mita", list(STAGE_ORDER)), ("dense", DENSE_STAGES)):
            got = [b for b in bars if b[0] == variant and b[3] == bucket]
            assert [b[1] for b in got] == stages, (variant, bucket, got)
            assert all(b[2] > 0 for b in got), got
    for stage in STAGE_ORDER:
        assert stage in page_text
    assert legend == ["mita", "dense"]
    assert "configured: mita 50.0 % · dense 50.0 %" in ab_text and "shadow on" in ab_text
    assert shadow_text.split("\n")[0].endswith("%") and "labels agree" in shadow_text
    assert models_rows == [["mita", "16", "16", "1", "cpu", "float32"],
                           ["dense", "–", "–", "–", "cpu", "float32"]]
    # Request latency: one chart per N bucket served, both variants' p50 and p99 in each.
    for chart, key in (("le_1024", "p50_ms"), ("le_1024", "p99_ms"), ("le_4096", "p50_ms"),
                       ("le_4096", "p99_ms"), ("throughput-chart", "rps")):
        assert {v for c, v, k in series if c == chart and k == key} == {"mita", "dense"}
    # The same sequences went to both variants: every bucket compares like with like.
    assert {b for b, *_ in ratio} == {"le_1024", "le_4096"} and all(x > 0 for _, x, *_ in ratio)
    assert all(like == "true" for _, _, like, _ in ratio)
    assert any("–3,000" in text or "N = 3,000" in text for *_, text in ratio), ratio
    # Every stage's swatch in its one colour (mita.hooks.STAGE_COLORS), in forward order.
    assert {stage: fill for stage, fill in swatches} == {
        st: STAGE_COLORS[st] for st in STAGE_ORDER}
    assert [st for st, _ in swatches][:len(STAGE_ORDER)] == list(STAGE_ORDER)
    # Time axes start at the first answered request's bin, not at the window's start.
    first = min(p["t"] for p in timeline if p["requests"])
    assert len(t0s) >= 3 and set(t0s) == {first}, (t0s, first)
    assert counts == ["≈107", "143", "0"]
    assert notes == [["no mita stage timings in this bucket yet (staged forwards only)"], 0]
    assert capped.startswith("last 300 s (3600 s asked: the gateway keeps 300 s, its "
                             "stats_window_s; set prometheus_url for more)"), capped
    errors = [e for e in logs if e["level"] == "SEVERE"]
    assert not errors, errors


def test_dashboard_draws_counts_kl_and_the_policy_split(browser):
    """The page, with fixed /v1/stats data (``counted_window``) and no service: every stage
    figure says its n, MiTA's two-sample bucket is greyed out (its qkv_proj 13.2 ms against
    dense's 2.25 ms is no comparison), the shadow card gives the KL's mean and p50, the A/B
    card the policy-routed split (75/25 of 8) and the overrides (5 dense) apart; each
    variant in the colour /v1/stats gives (the load tester's too)."""
    body = stats_body(counted_window().summary())
    with dashboard_without_ray(body) as url:
        browser.get(f"{url}/dashboard")

        def drawn():
            return browser.execute_script(
                "return [...document.querySelectorAll('#stages g.bar')].map(g => "
                "[g.closest('svg').dataset.bucket, g.dataset.variant, g.dataset.stage, "
                "g.getAttribute('class'), g.getAttribute('opacity'), "
                "g.querySelector('text.figure').textContent, "
                "g.querySelector('rect').getAttribute('fill')])") or None
        bars = wait_for(drawn, 30)
        assert bars, browser.find_element("tag name", "body").text[:2000]
        notes = browser.execute_script(
            "return [...document.querySelectorAll('#stages svg')].map(c => "
            "[c.dataset.bucket, [...c.querySelectorAll('text.sub')].map(t => t.textContent)])")
        observed = browser.find_element("id", "ab-observed").text
        overrides = browser.find_element("id", "ab-overrides").text
        kl = browser.find_element("id", "shadow-kl").text
        dropped = browser.find_element("id", "shadow-dropped").text
        # Prometheus mode: the split of all answered requests, said so; no overrides line.
        prom = browser.execute_script(
            "renderAB({...arguments[0], observed_basis: 'all_answered', overrides: null});"
            "return [document.getElementById('ab-observed').textContent, "
            "document.getElementById('ab-overrides')]", body["ab"])
        logs = browser.get_log("browser")
    got = {(b, v, st): (cls, op, text, fill) for b, v, st, cls, op, text, fill in bars}
    assert got["le_1024", "mita", "qkv_proj"] == ("bar few", "0.3", "13.2 ms n=2",
                                                  VARIANT_COLORS["mita"])
    assert got["le_1024", "dense", "qkv_proj"] == ("bar", "1", "2.25 ms n=6",
                                                   VARIANT_COLORS["dense"])
    assert got["le_4096", "mita", "qkv_proj"] == ("bar", "1", "11.2 ms n=6",
                                                  VARIANT_COLORS["mita"])
    assert all(text.endswith((" n=2", " n=6")) for _, _, text, _ in got.values())
    assert dict(notes) == {
        "le_1024": ["grey: fewer than 5 staged forwards (n), too few to compare"],
        "le_4096": []}
    assert observed == "observed, policy-routed: mita 75.0 % · dense 25.0 % (8 requests)"
    assert overrides == "overrides (variant named, not in the split): mita 0 · dense 5"
    assert dropped.startswith("4 shadow calls dropped"), dropped
    assert kl == "KL(dense ‖ MiTA): mean 0.177 · p50 0.02 nats"
    assert prom == ["observed, all answered (overrides included: Prometheus does not record "
                    "routing): mita 75.0 % · dense 25.0 % (8 requests)", None]
    errors = [e for e in logs if e["level"] == "SEVERE"]
    assert not errors, errors


def readme_screenshot_command() -> str:
    """The README's dashboard screenshot command (a bash block's lines joined)."""
    for block in re.findall(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), re.S):
        command = " ".join(block.replace("\\\n", " ").split())
        if command.startswith("chromium "):
            return command
    raise AssertionError("the README shows no chromium screenshot command")


@pytest.mark.service
def test_readme_screenshot_command_draws_the_data(service, tmp_path):
    """Found by a user: the README's ``chromium --headless --screenshot`` captured the page
    before the first /v1/stats answer ("connecting…", empty panels). Its command, run as
    written against a running service, draws the data: the stage bars of both variants, in
    their colours, fill thousands of pixels (the "connecting…" page has none)."""
    import matplotlib.image

    chromium = shutil.which("chromium")
    if chromium is None:
        if _required:
            pytest.fail("chromium missing but MITA_SERVE_REQUIRE_CHROMIUM=1")
        pytest.skip("chromium not installed (.ci/run installs Debian's)")
    for variant in ("mita", "dense"):
        for text, _ in EXAMPLES[:2]:
            r = service.post("/v1/classify", json={"text": text, "variant": variant,
                                                   "profile": "staged"})
            assert r.status_code == 200, r.text
    command = readme_screenshot_command()
    assert "'http://127.0.0.1:8000/dashboard" in command, command
    assert " --screenshot=docs/dashboard.png " in command, command
    shot = tmp_path / "dashboard.png"
    done = subprocess.run(["bash", "-c", command.replace("http://127.0.0.1:8000", service.url)
                           .replace("docs/dashboard.png", str(shot))], cwd=tmp_path,
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 0 and shot.is_file(), done.stderr[-3000:]
    rgb = (matplotlib.image.imread(shot)[..., :3] * 255).round().astype(int)
    assert rgb.shape[:2] == (1750, 1400)
    drawn = {v: int((rgb == [int(c[i:i + 2], 16) for i in (1, 3, 5)]).all(axis=-1).sum())
             for v, c in VARIANT_COLORS.items()}
    assert drawn["mita"] > 2000 and drawn["dense"] > 2000, drawn
