"""How many stalled client connections the service survives: p50/p99 of normal requests
beside them.

    python benchmarks/stalled_connections.py [--counts 0 256 1000 4000] [--requests 100]
    python benchmarks/stalled_connections.py --no-guard   # Serve's proxy as it comes

Starts the real service (deploy/serve_config.yaml, shipped checkpoint, CPU). For each kind of
stall — ``body`` (headers sent, 4 of 40 body bytes, then nothing) and ``headers`` (half a
header line, then nothing) — and each count, opens that many stalled connections, waits 1 s,
then sends ``--requests`` sequential ``POST /v1/classify`` (a ListOps expression, A/B policy)
and as many ``GET /healthz``, each with a 5 s client timeout; a point stops after 5 failures
(timeouts). The stalled connections stay open through the point (it lasts less than the proxy's
header and body deadlines, 10 s). ``--no-guard`` starts the service without
``service.proxy_guard`` (its variable set empty), for the before/after comparison.
"""

from __future__ import annotations

import asyncio
import os
import time

import httpx
import numpy as np
import torch

from mita.tools.argtypes import NONNEGATIVE_INT, POSITIVE_INT, Parser
from service import launch, proxy_guard

POST = (b"POST /v1/classify HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: 40\r\n\r\n")
STALLS = {"body": POST + b'{"te', "headers": b"POST /v1/classify HTTP/1.1\r\nHost: x\r\nCo"}
MAX_FAILURES = 5


async def point(url: str, port: int, kind: str, count: int, requests: int) -> dict:
    held = []
    for _ in range(count):
        _, w = await asyncio.open_connection("127.0.0.1", port)
        w.write(STALLS[kind])
        held.append(w)
    await asyncio.gather(*(w.drain() for w in held))
    await asyncio.sleep(1.0)
    out = {}
    async with httpx.AsyncClient(base_url=url, timeout=5.0) as c:
        for name, call in (("classify", lambda: c.post(
                "/v1/classify", json={"text": "[MAX 2 [MIN 4 7 ] 0 ]"})),
                           ("healthz", lambda: c.get("/healthz"))):
            ms, failed = [], 0
            for _ in range(requests):
                start = time.perf_counter()
                try:
                    r = await call()
                    ok = r.status_code == 200
                except httpx.HTTPError:
                    ok = False
                if ok:
                    ms.append(1e3 * (time.perf_counter() - start))
                else:
                    failed += 1
                    if failed >= MAX_FAILURES:
                        break
            out[name] = {"ok": len(ms), "failed": failed,
                         "p50": float(np.percentile(ms, 50)) if ms else None,
                         "p99": float(np.percentile(ms, 99)) if ms else None}
    for w in held:
        w.close()
    await asyncio.sleep(1.0)
    return out


def main() -> None:
    p = Parser(description=__doc__.split("\n\n")[0])
    p.add_argument("--counts", type=NONNEGATIVE_INT, nargs="+", default=[0, 256, 1000, 4000])
    p.add_argument("--kinds", nargs="+", choices=list(STALLS), default=list(STALLS))
    p.add_argument("--requests", type=POSITIVE_INT, default=100)
    p.add_argument("--port", type=POSITIVE_INT, default=8785)
    p.add_argument("--no-guard", action="store_true")
    a = p.parse_args()
    if a.no_guard:
        os.environ[proxy_guard.CALLBACK_VARIABLE] = ""
    cfg = launch.load_config(launch.CPU_CONFIG, {"http_options": {"port": a.port},
                                                 "args": {"device": "cpu"}})
    launch.prebuild_cpu_kernels(cfg)
    url = launch.start(cfg, metrics_port=a.port + 1)
    rows = []
    try:
        for kind in a.kinds:
            for count in a.counts:
                got = asyncio.run(point(url, a.port, kind, count, a.requests))
                rows.append((kind, count, got))
                print(kind, count, got, flush=True)
    finally:
        launch.stop()

    def cell(g: dict) -> str:
        if g["p50"] is None:
            return f"— | — | {g['failed']} of {g['ok'] + g['failed']}"
        return f"{g['p50']:.1f} | {g['p99']:.1f} | {g['failed']} of {g['ok'] + g['failed']}"

    print(f"\nproxy guard {'off' if a.no_guard else 'on'}; shipped checkpoint, CPU "
          f"({os.cpu_count()} cores), A/B policy, sequential requests, 5 s client timeout; "
          f"torch {torch.__version__}\n")
    print("| stalled | connections | classify p50 ms | p99 ms | failed | healthz p50 ms | "
          "p99 ms | failed |")
    print("|---|---|---|---|---|---|---|---|")
    for kind, count, got in rows:
        print(f"| {kind} | {count} | {cell(got['classify'])} | {cell(got['healthz'])} |")


if __name__ == "__main__":
    main()
