"""What ``GET /v1/stats`` (and the ``/dashboard`` page it feeds) reports, from two sources.

``StatsWindow`` keeps the gateway's own recent records — every request answered, the stage
timings of every classifier result it received (primary and shadow runs alike, so the counts
are those of ``mita_serve_stage_duration_seconds``), every shadow comparison — for a bounded
time (``retention_s``, at most ``MAX_RECORDS`` of each kind) and summarises a window of them
with numpy percentiles. It holds only this replica's records: with several gateway replicas
each answers for itself.

``prometheus_summary`` answers the same question from the Prometheus HTTP API: fixed PromQL
(instant queries over the window, range queries for the timeline), all replicas together,
asked directly: proxy variables of the environment are not used.

Both return the same dict (``schemas.StatsResponse`` less ``models``, ``ab`` and the colours,
which the gateway adds; ``answered`` instead, which ``ab_split`` turns into ``ab``):
milliseconds for durations, KL in nats, ``None`` where a quantile has no data.
"""

from __future__ import annotations

import json
import math
import time
import urllib.error
import urllib.parse
import urllib.request
from collections import deque
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from mita.hooks import MIN_STAGE_SAMPLES, STAGE_ORDER

from .metrics import N_BUCKETS, exported, n_bucket
from .settings import VARIANTS

MAX_RECORDS = 20_000  # per kind; bounds the gateway's memory under any request rate
TIMELINE_BINS = 60


def _rank(order: tuple[str, ...], name: str) -> int:
    return order.index(name) if name in order else len(order)


def _finite(x: float | None) -> float | None:
    return float(x) if x is not None and math.isfinite(x) else None


def bin_seconds(window_s: float) -> float:
    """Width of one timeline bin: the window in ``TIMELINE_BINS`` bins, whole seconds."""
    return float(max(1, math.ceil(window_s / TIMELINE_BINS)))


def _bin_starts(start: float, now: float, bin_s: float) -> list[float]:
    """Bin starts aligned to multiples of ``bin_s`` (stable across refreshes)."""
    first = math.floor(start / bin_s) * bin_s
    return [first + i * bin_s for i in range(int((now - first) // bin_s) + 1)]


def bucket_ratios(latency: list[dict]) -> list[dict]:
    """MiTA/dense ratio of median request latency per N bucket where both have data. Not like
    for like: the variants may have served different N inside a bucket (Prometheus mode,
    whose metrics know only the bucket)."""
    p50 = {(r["variant"], r["n_bucket"]): r["p50_ms"] for r in latency}
    out = []
    for b in N_BUCKETS:
        m, d = p50.get(("mita", b)), p50.get(("dense", b))
        if m is not None and d:
            out.append({"n_bucket": b, "mita_p50_ms": m, "dense_p50_ms": d, "ratio": m / d,
                        "like_for_like": False, "n_values": None, "n_min": None,
                        "n_max": None})
    return out


def matched_ratios(latency_by_n: dict[tuple[str, int], list[float]]) -> list[dict]:
    """Like-for-like MiTA/dense ratio per N bucket, from request latencies (ms) keyed by
    (variant, exact N): only the N values both variants served count, each N's ratio of
    medians weighted by the smaller of its two request counts, combined by geometric mean
    (the mean of log-ratios). ``mita_p50_ms`` / ``dense_p50_ms``: medians over those matched
    requests. Buckets with no N served by both are left out."""
    median = {key: float(np.median(ms)) for key, ms in latency_by_n.items()}
    by_bucket: dict[str, list[int]] = {}
    for n in sorted(n for variant, n in latency_by_n if variant == "mita"):
        # a zero median has no ratio (not seen; never a 500)
        if median.get(("dense", n), 0) > 0 and median["mita", n] > 0:
            by_bucket.setdefault(n_bucket(n), []).append(n)
    out = []
    for b in N_BUCKETS:
        ns = by_bucket.get(b)
        if not ns:
            continue
        weights = [min(len(latency_by_n["mita", n]), len(latency_by_n["dense", n])) for n in ns]
        logs = [math.log(median["mita", n] / median["dense", n]) for n in ns]
        out.append({"n_bucket": b, "ratio": float(np.exp(np.average(logs, weights=weights))),
                    **{f"{v}_p50_ms": float(np.median(np.concatenate(
                        [latency_by_n[v, n] for n in ns]))) for v in ("mita", "dense")},
                    "like_for_like": True, "n_values": len(ns), "n_min": ns[0],
                    "n_max": ns[-1]})
    return out


def _shadow(agree: float, disagree: float, kl_mean: float | None,
            kl_p50: float | None, dropped: float) -> dict:
    total = agree + disagree
    return {"comparisons": total, "agree": agree, "rate": agree / total if total else None,
            "kl_mean": _finite(kl_mean) if total else None,
            "kl_p50": _finite(kl_p50) if total else None, "dropped": dropped}


def ab_split(answered: dict, weights: dict, shadow: bool, sticky_header: str,
             policy: str = "weighted") -> dict:
    """``StatsResponse.ab`` from a summary's ``answered`` counts: ``{"policy": {variant:
    count}, "override": {…}}`` (local mode: requests routed by the A/B policy, and those whose
    ``variant`` was given) or ``{"all": {…}}`` (Prometheus mode: its counter does not say how
    a request was routed). ``observed`` is the split of the policy-routed requests only, so
    that explicit overrides (a load test per variant, a curl) do not read as the policy's.
    ``policy``: the gateway's (under ``auto`` the weights split only sticky clients)."""
    if "policy" in answered:
        counts, basis, overrides = answered["policy"], "policy_routed", answered["override"]
    else:
        counts, basis, overrides = answered["all"], "all_answered", None
    total = sum(counts.values())
    return {"policy": policy, "weights": weights, "shadow": shadow,
            "sticky_header": sticky_header,
            "observed": {v: counts.get(v, 0) / total for v in VARIANTS} if total else {},
            "observed_requests": total, "observed_basis": basis,
            "overrides": None if overrides is None else {v: overrides.get(v, 0)
                                                         for v in VARIANTS}}


# The dashboard's order of rows: by these fields, each in its fixed order, then by status.
SORT_ORDERS = {"variant": ("mita", "dense", "none"), "n_bucket": N_BUCKETS, "stage": STAGE_ORDER}


def _sort(rows: list[dict]) -> list[dict]:
    return sorted(rows, key=lambda r: [_rank(SORT_ORDERS[f], r[f]) if f in SORT_ORDERS else r[f]
                                       for f in (*SORT_ORDERS, "status") if f in r])


class StatsWindow:
    """The gateway's recent records. ``add_*`` are called by ``service.recorder.Recorder``
    with the matching metric; ``summary(window_s)`` summarises the last ``window_s`` seconds
    (capped at ``retention_s``). Times are wall-clock seconds (``time.time``)."""

    def __init__(self, retention_s: float = 300.0, max_records: int = MAX_RECORDS):
        self.retention_s = retention_s
        # (t, variant, status, N or None, latency_s or None, override)
        self.requests: deque = deque(maxlen=max_records)
        # (t, variant, n_bucket, ((stage, ms), ...))
        self.forwards: deque = deque(maxlen=max_records)
        # (t, primary, agree, KL nats); (t, shadow variant, None, None) for a dropped call
        self.shadows: deque = deque(maxlen=max_records)

    def add_request(self, variant: str, status: int | str, n: int | None = None,
                    latency_s: float | None = None, override: bool = False) -> None:
        """One request's answer; ``n`` (tokens) and ``latency_s`` for answered ones;
        ``override``: its ``variant`` was given, not chosen by the A/B policy."""
        self.requests.append((time.time(), variant, str(status), n, latency_s, override))

    def add_forward(self, variant: str, bucket: str, stages_ms: dict[str, float]) -> None:
        self.forwards.append((time.time(), variant, bucket, tuple(stages_ms.items())))

    def add_shadow(self, primary: str, agree: bool, kl: float) -> None:
        """A shadow comparison: labels ``agree``, ``kl`` in nats (as the metric's)."""
        self.shadows.append((time.time(), primary, bool(agree), float(kl)))

    def add_shadow_drop(self, variant: str) -> None:
        """A shadow call to ``variant`` that gave no comparison (shed, refused by
        back-pressure or failed)."""
        self.shadows.append((time.time(), variant, None, None))

    def _drop_old(self, now: float) -> None:
        for records in (self.requests, self.forwards, self.shadows):
            while records and records[0][0] < now - self.retention_s:
                records.popleft()

    def snapshot(self, window_s: float | None = None) -> tuple:
        """Copies of the records in the last ``window_s`` seconds (default and upper bound:
        ``retention_s``), for ``summarize``. Cheap; call it on the thread that records."""
        now = time.time()
        self._drop_old(now)
        window_s = min(window_s or self.retention_s, self.retention_s)
        start = now - window_s
        kinds = (self.requests, self.forwards, self.shadows)
        truncated = any(len(d) == d.maxlen and d[0][0] >= start for d in kinds)
        return (now, window_s, truncated, *([r for r in d if r[0] >= start] for d in kinds))

    def summary(self, window_s: float | None = None) -> dict:
        return summarize(self.snapshot(window_s))


def summarize(snapshot: tuple) -> dict:
    """The stats dict of a ``StatsWindow.snapshot`` (numpy percentiles, linear interpolation)."""
    now, window_s, truncated, requests, forwards, shadows = snapshot
    start = now - window_s
    counts: dict[tuple, int] = {}
    by_n: dict[tuple[str, int], list[float]] = {}
    answered: dict[str, dict[str, int]] = {"policy": {}, "override": {}}
    for _, variant, status, n, latency, override in requests:
        counts[variant, status] = counts.get((variant, status), 0) + 1
        if status == "200":
            split = answered["override" if override else "policy"]
            split[variant] = split.get(variant, 0) + 1
        if latency is not None:
            by_n.setdefault((variant, n), []).append(latency * 1e3)
    latencies: dict[tuple, list[float]] = {}
    for (variant, n), ms in by_n.items():
        latencies.setdefault((variant, n_bucket(n)), []).extend(ms)
    latency_rows = []
    for (variant, bucket), ms in latencies.items():
        p50, p95, p99 = np.percentile(ms, [50, 95, 99])
        latency_rows.append({"variant": variant, "n_bucket": bucket, "count": len(ms),
                             "sum_ms": float(np.sum(ms)), "p50_ms": float(p50),
                             "p95_ms": float(p95), "p99_ms": float(p99)})

    stage_ms: dict[tuple, list[float]] = {}
    for _, variant, bucket, stages in forwards:
        for stage, ms in stages:
            stage_ms.setdefault((variant, bucket, stage), []).append(ms)
    stage_rows = []
    for (variant, bucket, stage), ms in stage_ms.items():
        p50, p95 = np.percentile(ms, [50, 95])
        stage_rows.append({"variant": variant, "n_bucket": bucket, "stage": stage,
                           "count": len(ms), "sum_ms": float(np.sum(ms)),
                           "p50_ms": float(p50), "p95_ms": float(p95)})

    bin_s = bin_seconds(window_s)
    starts = _bin_starts(start, now, bin_s)
    binned: dict[tuple, list[float]] = {}
    for t, variant, status, n, latency, _ in requests:
        if status == "200" and latency is not None:
            i = min(int((t - starts[0]) // bin_s), len(starts) - 1)
            binned.setdefault((variant, None, i), []).append(latency * 1e3)
            binned.setdefault((variant, n_bucket(n), i), []).append(latency * 1e3)
    timeline, timeline_by_n = [], []
    for variant in VARIANTS:
        for bucket in (None, *N_BUCKETS):
            if bucket is not None and (variant, bucket) not in latencies:
                continue
            for i, t in enumerate(starts):
                ms = binned.get((variant, bucket, i), [])
                p50, p99 = np.percentile(ms, [50, 99]) if ms else (None, None)
                point = {"t": t, "variant": variant, "requests": len(ms), "rps": len(ms) / bin_s,
                         "p50_ms": _finite(p50), "p99_ms": _finite(p99)}
                if bucket is None:
                    timeline.append(point)
                else:
                    timeline_by_n.append(point | {"n_bucket": bucket})

    agree = sum(1 for s in shadows if s[2])
    kl = [s[3] for s in shadows if s[3] is not None]
    return {
        "source": "local", "scope": "replica", "window_s": window_s, "bin_s": bin_s,
        "generated_at": now, "truncated": truncated,
        "requests": _sort([{"variant": v, "status": s, "count": c}
                           for (v, s), c in counts.items()]),
        "latency": _sort(latency_rows), "stages": _sort(stage_rows),
        "ratios": matched_ratios(by_n), "timeline": timeline, "timeline_by_n": timeline_by_n,
        "shadow": _shadow(agree, len(kl) - agree, float(np.mean(kl)) if kl else None,
                          float(np.median(kl)) if kl else None, len(shadows) - len(kl)),
        "answered": answered, "min_stage_samples": MIN_STAGE_SAMPLES,
    }


class PrometheusError(Exception):
    """Prometheus did not answer, or answered with an error."""


# The fixed, read-only queries of Prometheus mode. {w}: the window; {r}: the timeline's rate
# window. Only these run; nothing from a request goes into them but two whole numbers.
REQ, STAGE, KL = exported("request_duration"), exported("stage_duration"), exported("shadow_kl")
REQUESTS, SHADOW = exported("requests"), exported("shadow_comparisons")
DROPPED, REJECTIONS = exported("shadow_dropped"), exported("rejections")
INSTANT = {
    "requests": f"sum by (variant, status) (increase({REQUESTS}[{{w}}]))",
    "lat_count": f"sum by (variant, n_bucket) (increase({REQ}_count[{{w}}]))",
    "lat_sum": f"sum by (variant, n_bucket) (increase({REQ}_sum[{{w}}]))",
    **{f"lat_p{q}": f"histogram_quantile(0.{q}, sum by (le, variant, n_bucket) "
                    f"(rate({REQ}_bucket[{{w}}])))" for q in (50, 95, 99)},
    "stage_count": f"sum by (variant, stage, n_bucket) (increase({STAGE}_count[{{w}}]))",
    "stage_sum": f"sum by (variant, stage, n_bucket) (increase({STAGE}_sum[{{w}}]))",
    **{f"stage_p{q}": f"histogram_quantile(0.{q}, sum by (le, variant, stage, n_bucket) "
                      f"(rate({STAGE}_bucket[{{w}}])))" for q in (50, 95)},
    "shadow": f"sum by (agree) (increase({SHADOW}[{{w}}]))",
    # Ray exports a histogram's _sum as bucket midpoint × count: the mean is approximate.
    "kl_mean": f"sum(increase({KL}_sum[{{w}}])) / sum(increase({KL}_count[{{w}}]))",
    "kl_p50": f"histogram_quantile(0.5, sum by (le) (rate({KL}_bucket[{{w}}])))",
    "shadow_dropped": f"sum(increase({DROPPED}[{{w}}])) + "
                      f"sum(increase({REJECTIONS}{{{{role=\"shadow\"}}}}[{{w}}]))",
}
RANGE = {
    "rps": f'sum by (variant) (rate({REQUESTS}{{{{status="200"}}}}[{{r}}]))',
    **{f"p{q}": f"histogram_quantile(0.{q}, sum by (le, variant) (rate({REQ}_bucket[{{r}}])))"
       for q in (50, 99)},
    "n_rps": f"sum by (variant, n_bucket) (rate({REQ}_count[{{r}}]))",
    **{f"n_p{q}": f"histogram_quantile(0.{q}, sum by (le, variant, n_bucket) "
                  f"(rate({REQ}_bucket[{{r}}])))" for q in (50, 99)},
}
_pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="prometheus")
# No proxy from the environment (HTTP_PROXY …): Prometheus is reached directly, as the
# scrape targets are (a loopback Prometheus behind a corporate proxy answered 502).
_opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _get(base_url: str, path: str, params: dict, timeout_s: float) -> list[dict]:
    url = f"{base_url.rstrip('/')}{path}?{urllib.parse.urlencode(params)}"
    try:
        with _opener.open(url, timeout=timeout_s) as r:
            body = json.loads(r.read())
    except urllib.error.HTTPError as e:
        try:
            msg = json.loads(e.read()).get("error", "")
        except ValueError:
            msg = ""
        raise PrometheusError(f"Prometheus answered {e.code} {msg}".strip()) from None
    except (OSError, ValueError) as e:
        raise PrometheusError(f"Prometheus at {base_url} did not answer: {e}") from None
    if not isinstance(body, dict) or body.get("status") != "success":
        raise PrometheusError(f"Prometheus query failed: {str(body)[:300]}")
    return body.get("data", {}).get("result", [])


def _value(x: str) -> float | None:
    return _finite(float(x))


def prometheus_summary(base_url: str, window_s: float, timeout_s: float = 5.0) -> dict:
    """The ``StatsWindow.summary`` dict computed by Prometheus over the last ``window_s``
    seconds (all gateway replicas: they record every metric). Blocking; raises
    PrometheusError."""
    now = time.time()
    window = f"{max(1, round(window_s))}s"
    bin_s = bin_seconds(window_s)
    rate_window = f"{max(60, round(2 * bin_s))}s"
    steps = _bin_starts(now - window_s, now, bin_s)
    jobs = {k: _pool.submit(_get, base_url, "/api/v1/query",
                            {"query": q.format(w=window), "time": f"{now:.3f}"}, timeout_s)
            for k, q in INSTANT.items()}
    jobs |= {k: _pool.submit(_get, base_url, "/api/v1/query_range",
                             {"query": q.format(r=rate_window), "start": f"{steps[0]:.3f}",
                              "end": f"{steps[-1]:.3f}", "step": f"{bin_s:g}"}, timeout_s)
             for k, q in RANGE.items()}
    res = {k: job.result() for k, job in jobs.items()}
    try:
        return _prometheus_stats(res, now, window_s, bin_s, steps)
    except (KeyError, IndexError, TypeError, ValueError, AttributeError) as e:
        raise PrometheusError(f"unexpected answer from {base_url}: {e!r}") from None


def _prometheus_stats(res: dict, now: float, window_s: float, bin_s: float,
                      steps: list[float]) -> dict:
    def by(key: str, labels: tuple[str, ...]) -> dict[tuple, float | None]:
        return {tuple(s["metric"].get(x, "") for x in labels): _value(s["value"][1])
                for s in res[key]}

    requests = [{"variant": v, "status": s, "count": c}
                for (v, s), c in by("requests", ("variant", "status")).items() if c]
    lab = ("variant", "n_bucket")
    lat_sum, q = by("lat_sum", lab), {p: by(f"lat_p{p}", lab) for p in (50, 95, 99)}
    latency = _sort([{"variant": v, "n_bucket": b, "count": c,
                      "sum_ms": (lat_sum.get((v, b)) or 0.0) * 1e3,
                      **{f"p{p}_ms": _ms(q[p].get((v, b))) for p in (50, 95, 99)}}
                     for (v, b), c in by("lat_count", lab).items() if c and v in VARIANTS])
    lab = ("variant", "n_bucket", "stage")
    st_sum, q = by("stage_sum", lab), {p: by(f"stage_p{p}", lab) for p in (50, 95)}
    stages = [{"variant": v, "n_bucket": b, "stage": s, "count": c,
               "sum_ms": (st_sum.get((v, b, s)) or 0.0) * 1e3,
               **{f"p{p}_ms": _ms(q[p].get((v, b, s))) for p in (50, 95)}}
              for (v, b, s), c in by("stage_count", lab).items() if c and v in VARIANTS]
    shadow = by("shadow", ("agree",))
    kl_mean, kl_p50, dropped = (by(k, ()).get((), None)
                                for k in ("kl_mean", "kl_p50", "shadow_dropped"))

    series = {k: {(s["metric"].get("variant"), s["metric"].get("n_bucket"), float(t)):
                  _value(x) for s in res[k] for t, x in s["values"]} for k in RANGE}
    timeline, timeline_by_n = [], []
    served = {(r["variant"], r["n_bucket"]) for r in latency}
    for variant in VARIANTS:
        for bucket in (None, *N_BUCKETS):
            pre = "" if bucket is None else "n_"
            # Ray keeps exporting a histogram after its last request: rate() then gives zeros
            # for a bucket served long ago. Only buckets answered in the window are drawn.
            if bucket is not None and (variant, bucket) not in served:
                continue
            for t in steps:
                key = (variant, bucket, t)
                rps = series[f"{pre}rps"].get(key) or 0.0
                point = {"t": t, "variant": variant, "requests": rps * bin_s, "rps": rps,
                         "p50_ms": _ms(series[f"{pre}p50"].get(key)),
                         "p99_ms": _ms(series[f"{pre}p99"].get(key))}
                if bucket is None:
                    timeline.append(point)
                else:
                    timeline_by_n.append(point | {"n_bucket": bucket})
    return {
        "source": "prometheus", "scope": "all_replicas", "window_s": float(window_s),
        "bin_s": bin_s, "generated_at": now, "truncated": False,
        "requests": _sort(requests), "latency": latency, "stages": _sort(stages),
        "ratios": bucket_ratios(latency), "timeline": timeline, "timeline_by_n": timeline_by_n,
        "shadow": _shadow(shadow.get(("true",)) or 0.0, shadow.get(("false",)) or 0.0,
                          kl_mean, kl_p50, dropped or 0.0),
        "answered": {"all": {r["variant"]: r["count"] for r in requests
                             if r["status"] == "200" and r["variant"] in VARIANTS}},
        "min_stage_samples": MIN_STAGE_SAMPLES,
    }


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1e3
