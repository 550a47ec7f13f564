"""A ``python -m service`` of a test's own (``test_start_and_stop.py``, the README walkthrough's,
the reliability tests): its ports, its readiness, and long requests in flight while it is
stopped or a replica is killed."""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from pathlib import Path

import httpx


def listening(port: int, pids: set[int] | None = None) -> set[str]:
    """The addresses a socket listens on ``port`` at (of the processes ``pids`` only)."""
    import psutil

    return {c.laddr.ip for c in psutil.net_connections(kind="inet")
            if c.status == psutil.CONN_LISTEN and c.laddr.port == port
            and (pids is None or c.pid in pids)}


def is_ready(url: str) -> bool:
    try:
        return httpx.get(f"{url}/readyz", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


LONG_DENSE_N = 16_384  # ~1-2 s of dense forward on 2 cores


async def send_long_dense(c: httpx.AsyncClient, inflight: int) -> tuple[list, list[int]]:
    """``inflight`` dense requests of N = ``LONG_DENSE_N`` ids sent on ``c``, given 1 s to
    reach the replicas. Returns (their pending answers, asyncio futures; the ids sent)."""
    import asyncio

    from mita.data.listops import encode, generate_long

    ids = encode(generate_long(LONG_DENSE_N, seed=4)[0])
    sent = [asyncio.ensure_future(c.post("/v1/classify", json={"ids": ids, "variant": "dense"}))
            for _ in range(inflight)]
    await asyncio.sleep(1.0)
    return sent, ids


def stop_under_load(url: str, inflight: int, stop) -> tuple:
    """``stop()`` (a signal to the service) 1 s after ``inflight`` long dense requests
    (``send_long_dense``) were sent; 0.5 s later one more request, /healthz and /readyz.
    Returns (the in-flight answers, the late answer, /healthz, /readyz)."""
    import asyncio

    async def scenario():
        async with httpx.AsyncClient(base_url=url, timeout=120) as c:
            sent, ids = await send_long_dense(c, inflight)
            stop()
            await asyncio.sleep(0.5)
            late = await c.post("/v1/classify", json={"ids": ids[:100]})
            health, ready = await c.get("/healthz"), await c.get("/readyz")
            return await asyncio.gather(*sent), late, health, ready
    return asyncio.run(scenario())


def kill_under_load(pid: int, url: str, deployment: str) -> dict:
    """SIGKILL to the replica of ``deployment`` among process ``pid``'s descendants (a Ray
    worker) 1.5 s into 4 closed-loop clients of that variant (N = 1,024), which run 12 s more.
    Returns the statuses of all their answers (0: no HTTP answer)."""
    import asyncio

    import psutil

    from mita.data.listops import encode, generate_long

    ids = encode(generate_long(1024, seed=5)[0])
    variant = "mita" if deployment == "MiTAClassifier" else "dense"
    replica = next(p for p in psutil.Process(pid).children(recursive=True)
                   if f"ServeReplica:mita-serve:{deployment}" in " ".join(p.cmdline()))

    async def scenario():
        statuses: list[int] = []
        stop_at = asyncio.get_running_loop().time() + 13.5

        async def client(c):
            while asyncio.get_running_loop().time() < stop_at:
                try:
                    r = await c.post("/v1/classify", json={"ids": ids, "variant": variant})
                    statuses.append(r.status_code)
                except httpx.HTTPError:
                    statuses.append(0)
        async with httpx.AsyncClient(base_url=url, timeout=120) as c:
            clients = [asyncio.ensure_future(client(c)) for _ in range(4)]
            await asyncio.sleep(1.5)
            replica.kill()
            await asyncio.gather(*clients)
        return statuses
    return {"statuses": asyncio.run(scenario())}


def at_once(tmp_path: Path, scenarios: dict[str, Callable[[Path, dict], None]]) -> None:
    """Run ``scenarios`` (name: a function of its folder and its environment, which starts a
    ``python -m service`` with ``own_instance``) at the same time, each in a thread, a folder
    and a share of this worker's Serve direct-ingress ports of its own (each Ray hands them out
    from the range's first port); then raise the first failure, noted with its scenario's
    name. The starts are the cost of these scenarios and most of it is waiting on other
    processes: two at once took less than one after the other on 2 cores."""
    from concurrent.futures import ThreadPoolExecutor

    envs: list[dict] = [{} for _ in scenarios]
    for protocol, first in (("HTTP", 30000), ("GRPC", 40000)):
        low = int(os.environ.get(f"RAY_SERVE_DIRECT_INGRESS_MIN_{protocol}_PORT", first))
        high = int(os.environ.get(f"RAY_SERVE_DIRECT_INGRESS_MAX_{protocol}_PORT", first + 999))
        share = (high - low + 1) // len(scenarios)
        for i, env in enumerate(envs):
            env[f"RAY_SERVE_DIRECT_INGRESS_MIN_{protocol}_PORT"] = str(low + i * share)
            env[f"RAY_SERVE_DIRECT_INGRESS_MAX_{protocol}_PORT"] = str(low + (i + 1) * share - 1)
    with ThreadPoolExecutor(len(scenarios)) as pool:
        futures = {}
        for (name, scenario), env in zip(scenarios.items(), envs, strict=True):
            folder = tmp_path / re.sub(r"\W+", "-", name)
            folder.mkdir()
            futures[name] = pool.submit(scenario, folder, env)
    for name, future in futures.items():
        try:
            future.result()
        except BaseException as e:  # an assertion, pytest.fail
            e.add_note(f"scenario: {name}")
            raise
