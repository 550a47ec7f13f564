"""Request overhead of JSON vs binary ids through the real service, side by side.

    python benchmarks/request_overhead.py [--n 16384 262144 1048576] [--requests 5]

Starts the real service (deploy/serve_config.yaml, shipped checkpoint, CPU; the gateway's
``max_n`` raised to 1,048,576 and ``max_body_bytes`` to 16 MiB) and sends the same random ids of
each N to the MiTA classifier, alternating ``POST /v1/classify`` (JSON ``{"ids": [...]}``) and
``POST /v1/classify/binary`` (1 byte per id), sequentially, after one warm-up of each. Reports
medians of:

- ``pre_forward_ms`` — the service's own measure of arrival at the gateway → forward start:
  body reading and parsing, validation, the hop to the classifier replica, batching wait;
- ``round trip − forward`` — what the client waits beyond the forward (adds the HTTP proxy,
  the response and its JSON);
- the forward itself (``profile.total_ms``) and the body size.
"""

from __future__ import annotations

import json
import time

import httpx
import numpy as np
import torch

from mita.tools.argtypes import Parser
from service import launch


def main() -> None:
    p = Parser()
    p.add_argument("--n", type=int, nargs="+", default=[16384, 262144, 1 << 20])
    p.add_argument("--requests", type=int, default=5)
    p.add_argument("--port", type=int, default=8775)
    a = p.parse_args()
    cfg = launch.load_config(launch.CPU_CONFIG, {
        "http_options": {"port": a.port}, "args": {"device": "cpu"},
        "deployments": {"Gateway": {"user_config": {"max_n": 1 << 20,
                                                    "max_body_bytes": 16 << 20}}}})
    url = launch.start(cfg, metrics_port=a.port + 1)
    rows = []
    try:
        with httpx.Client(base_url=url, timeout=600) as client:
            for n in a.n:
                ids = np.random.default_rng(n).integers(1, 16, n).astype(np.uint8)
                sends = {
                    "json": dict(url="/v1/classify", content=json.dumps(
                        {"ids": ids.tolist(), "variant": "mita", "profile": True}).encode(),
                                 headers={"content-type": "application/json"}),
                    "binary": dict(url="/v1/classify/binary", content=ids.tobytes(),
                                   params={"variant": "mita", "profile": "true"},
                                   headers={"content-type": "application/octet-stream"}),
                }
                got = {fmt: {"pre": [], "rest": [], "fwd": []} for fmt in sends}
                for kw in sends.values():  # warm-up
                    client.post(**kw).raise_for_status()
                for _ in range(a.requests):
                    for fmt, kw in sends.items():
                        t0 = time.perf_counter()
                        r = client.post(**kw)
                        rt = 1e3 * (time.perf_counter() - t0)
                        r.raise_for_status()
                        prof = r.json()["profile"]
                        got[fmt]["pre"].append(prof["pre_forward_ms"])
                        got[fmt]["fwd"].append(prof["total_ms"])
                        got[fmt]["rest"].append(rt - prof["total_ms"])
                med = {fmt: {k: float(np.median(v)) for k, v in g.items()}
                       for fmt, g in got.items()}
                rows.append((n, {fmt: len(kw["content"]) for fmt, kw in sends.items()}, med))
                print(n, med, flush=True)
    finally:
        launch.stop()
    print(f"\nMiTA classifier (shipped checkpoint, m = k = 16, s = 1), batch 1, float32, cpu, "
          f"{a.requests} requests per format alternating, medians; torch {torch.__version__}\n")
    print("| N | body JSON | body binary | pre-forward JSON ms | pre-forward binary ms | "
          "JSON / binary | round trip − forward JSON ms | binary ms | JSON / binary | "
          "forward ms (JSON, binary) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for n, size, med in rows:
        j, b = med["json"], med["binary"]
        print(f"| {n} | {size['json'] / 2**20:.2f} MiB | {size['binary'] / 2**20:.2f} MiB | "
              f"{j['pre']:.1f} | {b['pre']:.1f} | {j['pre'] / b['pre']:.1f}× | "
              f"{j['rest']:.1f} | {b['rest']:.1f} | {j['rest'] / b['rest']:.1f}× | "
              f"{j['fwd']:.0f}, {b['fwd']:.0f} |")


if __name__ == "__main__":
    main()
