"""Load generator: sequences of each N — real ListOps by default, or the payloads of a user's
rows (``loadtest.inputs``) — sent over HTTP to the running service.

Closed loop: ``concurrency`` workers, each sending its next request when the previous one
answered. Open loop: Poisson arrivals at ``rate`` requests/s, sent whether or not earlier
ones finished. Each (N, variant) phase sends ``warmup`` untimed requests, then up to
``requests`` timed ones, and stops early after ``duration_s``. Every raw sample is kept;
percentiles are computed with numpy. Only loopback targets are allowed.
"""

from __future__ import annotations

import asyncio
import ipaddress
import time
from dataclasses import asdict, dataclass, field
from urllib.parse import urlparse

import httpx
import numpy as np

from mita.data.listops import encode, generate_long
from mita.hooks import stage_sorted
from mita.tools.progress import Progress


def check_loopback(url: str) -> None:
    """Raise ValueError unless ``url`` is http(s) on this machine's loopback interface."""
    if urlparse(url).scheme not in ("http", "https"):
        raise ValueError(f"--url must start with http:// or https://, got {url!r}")
    host = urlparse(url).hostname or ""
    if host == "localhost":
        return
    try:
        if ipaddress.ip_address(host).is_loopback:
            return
    except ValueError:
        pass
    raise ValueError(f"refusing to load-test {host!r}: only loopback targets (127.0.0.0/8, "
                     f"::1, localhost) are allowed")


@dataclass
class Sample:
    n: int
    requested: str  # "mita", "dense" or "ab" (A/B policy decides)
    variant: str | None  # served variant (None on error)
    status: int  # HTTP status, 0 for a transport error
    start_s: float  # since the phase began
    latency_s: float
    stages_ms: dict[str, float] = field(default_factory=dict)
    error: str | None = None
    staged: bool = True  # every stage timed apart (False: a fused MiTA forward)
    # the answer's n: the tokens the model read (None on error). Differs from n when the
    # service tokenized a text (sentencepiece: n counts characters sent) or cut it to the
    # model's max_length.
    served_n: int | None = None


@dataclass
class LoadConfig:
    url: str
    ns: list[int]
    variants: list[str]  # subset of mita, dense, ab
    mode: str = "closed"  # closed | open
    concurrency: int = 4
    rate: float = 5.0
    requests: int = 50
    warmup: int = 3
    duration_s: float = 120.0
    timeout_s: float = 300.0
    sequences_per_n: int = 4
    seed: int = 0


async def _send(client: httpx.AsyncClient, body: dict, n: int, requested: str,
                t0: float) -> Sample:
    start = time.perf_counter()
    try:
        r = await client.post("/v1/classify", json=body)
    except httpx.HTTPError as e:
        return Sample(n, requested, None, 0, start - t0, time.perf_counter() - start,
                      error=f"{type(e).__name__}: {e}"[:200])
    latency = time.perf_counter() - start
    if r.status_code != 200:
        try:
            err = r.json().get("error", r.text)
        except ValueError:
            err = r.text
        return Sample(n, requested, None, r.status_code, start - t0, latency, error=err[:200])
    data = r.json()
    profile = data.get("profile", {})
    return Sample(n, requested, data["variant"], 200, start - t0, latency,
                  profile.get("stages_ms", {}), staged=profile.get("staged", True),
                  served_n=data.get("n"))


async def run_phase(client: httpx.AsyncClient, cfg: LoadConfig, n: int, requested: str,
                    bodies: list[dict], bar: Progress, rng: np.random.Generator) -> list[Sample]:
    """One (N, variant) phase: warm-up (discarded), then timed requests. Advances ``bar`` by
    ``cfg.warmup + cfg.requests`` in all: one per request sent, warm-ups included, and the
    requests a phase cut short by ``duration_s`` never sent, so the bar's ETA is over every
    request still to come."""
    for i in range(cfg.warmup):
        await _send(client, bodies[i % len(bodies)], n, requested, time.perf_counter())
        bar.update(1)
    t0 = time.perf_counter()
    samples: list[Sample] = []

    def out_of_time() -> bool:
        return time.perf_counter() - t0 > cfg.duration_s

    if cfg.mode == "closed":
        counter = iter(range(cfg.requests))

        async def worker():
            for i in counter:
                if out_of_time():
                    return
                samples.append(await _send(client, bodies[i % len(bodies)], n, requested, t0))
                bar.update(1)

        await asyncio.gather(*(worker() for _ in range(cfg.concurrency)))
    else:
        gaps = rng.exponential(1.0 / cfg.rate, size=cfg.requests)
        tasks = []
        for i, at in enumerate(np.cumsum(gaps)):
            if at > cfg.duration_s:  # past the phase's end: do not sleep until then
                break
            delay = t0 + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            if out_of_time():
                break
            task = asyncio.create_task(_send(client, bodies[i % len(bodies)], n, requested, t0))
            task.add_done_callback(lambda _: bar.update(1))
            tasks.append(task)
        samples = list(await asyncio.gather(*tasks))
    if len(samples) < cfg.requests:  # those never sent: the phase ran out of time
        bar.update(cfg.requests - len(samples))
    return samples


def phase_line(n: int, requested: str, samples: list[Sample], wall_s: float) -> str:
    """One finished phase in a line of a log: timed requests, failures by status, p50 latency
    of the answered ones (numpy's median), the phase's wall time (warm-ups included)."""
    ok = [s.latency_s for s in samples if s.status == 200]
    failed: dict[int, int] = {}
    for s in samples:
        if s.status != 200:
            failed[s.status] = failed.get(s.status, 0) + 1
    text = f"N={n} {requested}: {len(ok)} of {len(samples)} timed requests answered"
    if failed:
        text += " (" + ", ".join(f"{count} × {status or 'no answer'}"
                                 for status, count in sorted(failed.items())) + ")"
    if ok:
        text += f", p50 {np.median(ok) * 1e3:.1f} ms"
    return text + f", {wall_s:.1f} s"


def fetch_models(url: str, timeout_s: float) -> dict:
    """The target's ``GET {url}/v1/models`` JSON (its task, variants, A/B policy). Raises
    ValueError naming the address and the cause: no answer, a status other than 200, or an
    answer that is not a JSON object."""
    where = url.rstrip("/") + "/v1/models"
    try:
        r = httpx.get(where, timeout=timeout_s)
    except httpx.HTTPError as e:
        raise ValueError(f"{where} did not answer ({type(e).__name__}: {e}): is the service "
                         "running there?") from None
    if r.status_code != 200:
        raise ValueError(f"{where} answered {r.status_code}: {r.text[:200]}")
    try:
        body = r.json()
    except ValueError:
        body = None
    if not isinstance(body, dict):
        raise ValueError(f"{where} answered no JSON object: {r.text[:200]!r}")
    return body


async def run_load(cfg: LoadConfig, payloads: dict[int, list[dict]] | None = None
                   ) -> list[Sample]:
    """Every phase, N ascending, variants in the given order. ``payloads``: per N the
    sequences to send (``{"ids": …}`` or ``{"text": …}``, ``loadtest.inputs.build``), used in
    turn; None: ``cfg.sequences_per_n`` generated ListOps expressions of exactly N tokens.
    Returns all timed samples (warm-ups are not kept)."""
    check_loopback(cfg.url)
    if cfg.mode not in ("closed", "open"):
        raise ValueError(f"mode must be 'closed' or 'open', got {cfg.mode!r}")
    rng = np.random.default_rng(cfg.seed)
    phases = [(n, v) for n in sorted(cfg.ns) for v in cfg.variants]
    # Keep every connection alive (httpx keeps 20 by default): under overload the default
    # closes and reopens hundreds of connections a second. Failed connects are retried (the
    # request was never sent); a request that was sent is never sent again.
    size = max(cfg.concurrency, 64)
    transport = httpx.AsyncHTTPTransport(
        limits=httpx.Limits(max_connections=size, max_keepalive_connections=size), retries=2)
    samples: list[Sample] = []
    async with httpx.AsyncClient(base_url=cfg.url, timeout=cfg.timeout_s,
                                 transport=transport) as c:
        # Every request counts, warm-ups too: a bar of timed requests only said "2 s left"
        # before a 100 s phase whose warm-ups had not started.
        with Progress(len(phases) * (cfg.warmup + cfg.requests), "load", "req") as bar:
            for n in sorted(cfg.ns):
                seqs = payloads[n] if payloads is not None else [
                    {"ids": encode(generate_long(n, seed=cfg.seed * 1000 + i)[0])}
                    for i in range(cfg.sequences_per_n)]
                for v in cfg.variants:
                    bar.phase(f"n={n}, variant={v}")
                    bodies = [s | {"profile": True} | ({} if v == "ab" else {"variant": v})
                              for s in seqs]
                    t0 = time.perf_counter()
                    got = await run_phase(c, cfg, n, v, bodies, bar, rng)
                    bar.phase_done(phase_line(n, v, got, time.perf_counter() - t0))
                    samples += got
    return samples


def summarize(samples: list[Sample], cfg: LoadConfig) -> dict:
    """Per (N, requested variant): counts, errors by status, p50/p90/p99 latency (ms, numpy),
    the answers' n (``served_n``: [min, max] tokens the model read, None without answers),
    throughput (ok req/s, and tokens/s of the tokens read: the answers' n, N for a sample
    without one, over the phase's wall time) and median stage times per
    served variant (``stages_ms[served][stage]``, ms summed over layers) with the profiled
    responses each median is of (``stages_n[served]``: 1 is a single response, not a median);
    plus MiTA/dense ratios per N where both ran."""
    groups: dict[tuple[int, str], list[Sample]] = {}
    for s in samples:
        groups.setdefault((s.n, s.requested), []).append(s)
    rows = []
    for (n, req), ss in sorted(groups.items()):
        ok = [s for s in ss if s.status == 200]
        lat = np.array([s.latency_s for s in ok]) * 1e3
        wall = max(s.start_s + s.latency_s for s in ss) - min(s.start_s for s in ss)
        errors: dict[str, int] = {}
        for s in ss:
            if s.status != 200:
                errors[str(s.status)] = errors.get(str(s.status), 0) + 1
        served: dict[str, int] = {}
        for s in ok:
            served[s.variant] = served.get(s.variant, 0) + 1
        # Per served variant: an A/B phase mixes MiTA and dense answers, whose stages differ;
        # and a fused MiTA's sampled staged forwards ("mita (staged)") time other stages.
        stages_ms, stages_n = {}, {}
        for v in served:
            mine = [s for s in ok if s.variant == v and s.stages_ms]
            kinds = sorted({s.staged for s in mine})
            for staged in kinds:
                group = [s for s in mine if s.staged == staged]
                names = stage_sorted(k for s in group for k in s.stages_ms)
                label = f"{v} (staged)" if staged and len(kinds) > 1 else v
                stages_ms[label] = {k: float(np.median([s.stages_ms.get(k, 0.0)
                                                         for s in group])) for k in names}
                stages_n[label] = len(group)
        read = [s.served_n if s.served_n is not None else n for s in ok]
        rows.append({
            "n": n, "variant": req, "served": served, "sent": len(ss), "ok": len(ok),
            "errors": errors, "served_n": [min(read), max(read)] if read else None,
            "p50_ms": float(np.percentile(lat, 50)) if len(ok) else None,
            "p90_ms": float(np.percentile(lat, 90)) if len(ok) else None,
            "p99_ms": float(np.percentile(lat, 99)) if len(ok) else None,
            "throughput_rps": len(ok) / wall if wall > 0 else None,
            "tokens_per_s": sum(read) / wall if wall > 0 else None,
            "stages_ms": stages_ms, "stages_n": stages_n,
        })
    by = {(r["n"], r["variant"]): r for r in rows}
    ratios = []
    for n in sorted({r["n"] for r in rows}):
        m, d = by.get((n, "mita")), by.get((n, "dense"))
        if m and d and m["p50_ms"] and d["p50_ms"]:
            ratios.append({"n": n, "p50_ratio_mita_over_dense": m["p50_ms"] / d["p50_ms"],
                           "p99_ratio_mita_over_dense": m["p99_ms"] / d["p99_ms"],
                           "throughput_ratio_mita_over_dense":
                               m["throughput_rps"] / d["throughput_rps"]})
    return {"config": asdict(cfg), "rows": rows, "ratios": ratios}
