"""p50 latency through the HTTP service vs the same forward in-process, side by side.

    python benchmarks/http_vs_inprocess.py [--n 1024 4096 16384] [--requests 30]

Starts the real service (deploy/serve_config.yaml, shipped checkpoint, CPU), sends sequential
requests with one real ListOps sequence of each N (``generate_long``) to each variant, and
times the in-process forward of the loaded checkpoint on the same ids (batch 1, no_grad).
Prints a Markdown table with both p50s and their ratio.
"""

from __future__ import annotations

import time

import httpx
import numpy as np
import torch

from mita.data.listops import encode, generate_long
from mita.model import load_checkpoint
from mita.tools.argtypes import Parser
from service import launch

CHECKPOINT = "checkpoints/listops-default"


def main() -> None:
    p = Parser()
    p.add_argument("--n", type=int, nargs="+", default=[1024, 4096, 16384])
    p.add_argument("--requests", type=int, default=30)
    p.add_argument("--port", type=int, default=8765)
    a = p.parse_args()
    cfg = launch.load_config(launch.CPU_CONFIG, {"http_options": {"port": a.port},
                                                 "args": {"device": "cpu"}})
    url = launch.start(cfg, metrics_port=a.port + 1)
    models = {v: load_checkpoint(CHECKPOINT, attention=v) for v in ("mita", "dense")}
    rows = []
    try:
        with httpx.Client(base_url=url, timeout=300) as client:
            for n in a.n:
                text, _ = generate_long(n, seed=n)
                ids = torch.tensor([encode(text)])
                for variant, model in models.items():
                    body = {"ids": ids[0].tolist(), "variant": variant}
                    client.post("/v1/classify", json=body).raise_for_status()  # warm-up
                    http_ms, local_ms = [], []
                    for _ in range(a.requests):
                        t0 = time.perf_counter()
                        client.post("/v1/classify", json=body).raise_for_status()
                        http_ms.append(1e3 * (time.perf_counter() - t0))
                        t0 = time.perf_counter()
                        with torch.no_grad():
                            model(ids)
                        local_ms.append(1e3 * (time.perf_counter() - t0))
                    h, loc = float(np.median(http_ms)), float(np.median(local_ms))
                    rows.append((n, variant, h, loc))
    finally:
        launch.stop()
    m = models["mita"].config
    print(f"checkpoint {CHECKPOINT} (m={m.num_landmarks} k={m.topk} s={m.route_topk}), batch 1, "
          f"float32, cpu ({torch.get_num_threads()} threads in-process), {a.requests} "
          f"sequential requests, interleaved; torch {torch.__version__}\n")
    print("| N | variant | HTTP p50 ms | in-process p50 ms | HTTP / in-process |")
    print("|---|---|---|---|---|")
    for n, v, h, loc in rows:
        print(f"| {n} | {v} | {h:.1f} | {loc:.1f} | {h / loc:.2f}× |")


if __name__ == "__main__":
    main()
