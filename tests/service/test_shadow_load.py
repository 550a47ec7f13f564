"""Shadow mode under load on the real service (Ray Serve on loopback, in this process): shadow
work is best effort and never starves primary requests."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from mita.data.listops import encode, generate_long

from ..helpers import delta, set_gateway, wait_for

# quiet: its dense p99 ratio (shadow on over off, bound 2x) was 0.8x alone, 2.1-2.5x beside
# background tests
pytestmark = pytest.mark.quiet

ROOT = Path(__file__).resolve().parents[2]
FLOOD_N, PROBE_N = 2048, 4096  # a dense forward at 2K takes ~1/4 of one at 4K here
FLOOD_CONCURRENCY, PROBES = 8, 16
THINK_S = 0.3  # between probes: dense is free, and shadow calls start
SHADOW_MAX_INFLIGHT = 2  # the default; one gateway replica here, so at most 2 in the cluster


async def flood_with_probes(url: str, flood_ids: list[int], probe_ids: list[int]):
    """A closed loop of ``FLOOD_CONCURRENCY`` MiTA-routed clients (the A/B policy sends all
    traffic to MiTA) while one client sends ``PROBES`` dense requests one after another.
    Returns the probes' latencies (s) and statuses, and the flood's statuses."""
    done = asyncio.Event()
    flood_status: list[int] = []
    async with httpx.AsyncClient(base_url=url, timeout=120) as c:
        async def flood():
            while not done.is_set():
                r = await c.post("/v1/classify", json={"ids": flood_ids})
                flood_status.append(r.status_code)

        async def probes():
            await asyncio.sleep(1.0)  # the flood's queues have filled
            out = []
            for _ in range(PROBES):
                await asyncio.sleep(THINK_S)  # shadow calls start between probes
                t0 = time.perf_counter()
                r = await c.post("/v1/classify", json={"ids": probe_ids, "variant": "dense"})
                out.append((time.perf_counter() - t0, r.status_code))
            done.set()
            return out
        tasks = [asyncio.ensure_future(flood()) for _ in range(FLOOD_CONCURRENCY)]
        probed = await probes()
        await asyncio.gather(*tasks)
    return [t for t, _ in probed], [s for _, s in probed], flood_status


def test_shadow_flood_does_not_delay_dense_primaries(service, serve_reset):
    """Found by a user: with shadow on and all traffic to MiTA, the dense queue filled with
    shadow calls and dense *primary* requests took 0.71, 10.2 and 45.4 s instead of ~0.5 s.
    Now shadow calls are capped per variant and shed while the variant serves primaries, so
    a probe waits behind at most ``shadow_max_inflight`` shadow forwards (between probes dense
    is free and shadow calls start there): the dense primaries' p99 under a MiTA flood with
    shadow on stays within their p99 with shadow off plus that many dense forwards, each
    counted as the probes' median with shadow off (a forward at ``PROBE_N``, ~4x one at
    ``FLOOD_N``: a generous bound that still fails the 10-45 s the user saw by 10x). Each
    flood request's shadow has one counted outcome.

    A bound of 2x the p99 with shadow off (16 probes: the p99 is about the slowest) failed on
    a slow CI machine at 0.98 s against 2 x 0.45 s, with the median 0.39 against 0.32 s."""
    flood_ids = encode(generate_long(FLOOD_N, seed=21)[0])
    probe_ids = encode(generate_long(PROBE_N, seed=22)[0])
    policy = {"weights": {"mita": 1.0, "dense": 0.0}}
    report = {"flood_n": FLOOD_N, "probe_n": PROBE_N, "concurrency": FLOOD_CONCURRENCY}
    set_gateway(service, **policy, shadow=False)
    base, base_status, _ = asyncio.run(flood_with_probes(service.url, flood_ids, probe_ids))
    set_gateway(service, **policy, shadow=True, shadow_max_inflight=SHADOW_MAX_INFLIGHT)
    text0 = service.metrics_text()
    shadowed, status, flood_status = asyncio.run(
        flood_with_probes(service.url, flood_ids, probe_ids))
    flood_done = len(flood_status)

    def shadow_outcomes():  # each flood request's dense shadow: one outcome
        text = service.metrics_text()
        dropped = "ray_mita_serve_shadow_dropped_total"
        got = {k: delta(text, text0, name, **labels)
               for k, (name, labels) in {
                   "compared": ("ray_mita_serve_shadow_comparisons_total",
                                {"primary": "mita"}),
                   "busy": (dropped, {"variant": "dense", "reason": "busy"}),
                   "failed": (dropped, {"variant": "dense", "reason": "failed"}),
                   "rejected": ("ray_mita_serve_rejections_total",
                                {"variant": "dense", "role": "shadow"}),
               }.items()}
        return got if sum(got.values()) == flood_done else None
    outcomes = wait_for(shadow_outcomes, timeout_s=60)
    p99 = {"off": float(np.percentile(base, 99)), "on": float(np.percentile(shadowed, 99))}
    report |= {"dense_p99_s": p99, "dense_p50_s": {"off": float(np.median(base)),
                                                   "on": float(np.median(shadowed))},
               "flood_requests": flood_done, "shadow_outcomes": outcomes}
    report["dense_p99_bound_s"] = p99["off"] + SHADOW_MAX_INFLIGHT * report["dense_p50_s"]["off"]
    print(f"shadow_flood: {report}")
    out = ROOT / "test-artifacts"
    out.mkdir(exist_ok=True)
    (out / "shadow_flood.json").write_text(json.dumps(report, indent=1) + "\n")
    assert base_status == [200] * PROBES and status == [200] * PROBES
    assert set(flood_status) == {200}
    assert outcomes is not None, report
    assert outcomes["busy"] >= 1 and outcomes["compared"] >= 1, report
    assert p99["on"] <= report["dense_p99_bound_s"], report
