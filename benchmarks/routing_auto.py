"""Policy ``auto`` against all-dense and all-MiTA on one mixed-N load, side by side in one run.

    python benchmarks/routing_auto.py [--requests 40] [--warmup 40] [--min-agreement 0.05]

Starts Ray and the real service (deploy/serve_config.yaml, shipped checkpoint, CPU) in this
process and sends one mixed load — ListOps expressions of 40–64 tokens and of 3,000–4,096
tokens, alternating, one request at a time — three times over the same expressions:

- **auto**: gateway ``policy: auto`` with a guard the shipped checkpoint meets
  (``--min-agreement``; ``min_pairs`` 20, exploration 10 % once settled, 100 % before), after
  ``--warmup`` requests of the same mix that give it evidence;
- **dense** and **mita**: every request names its variant.

Per N group: p50 and p99 of the client's round trip, which variant served it (auto), and the
agreement with dense of the labels auto served (against the all-dense run's labels of the
same expressions). Prints one table and the routing table auto ended with.
"""

import json
import sys
import time
from pathlib import Path

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mita.data.listops import ListOpsConfig, generate  # noqa: E402
from mita.tools.argtypes import Parser  # noqa: E402
from service import launch  # noqa: E402

GROUPS = {"short": ListOpsConfig(min_length=40, max_length=64),
          "long": ListOpsConfig(min_length=3000, max_length=4096)}


def texts(count: int, seed: int) -> list[tuple[str, str]]:
    """(group, text) alternating short and long, ``count`` of each."""
    made = {g: [t for t, _ in generate(count, seed=seed + i, cfg=c)]
            for i, (g, c) in enumerate(GROUPS.items())}
    return [(g, made[g][i]) for i in range(count) for g in GROUPS]


def gateway_config(port: int, user_config: dict):
    shipped = launch.load_config(launch.CPU_CONFIG).applications[0]
    gw = next(d for d in shipped.deployments if d.name == "Gateway").user_config
    return launch.load_config(launch.CPU_CONFIG, {
        "http_options": {"port": port}, "args": {"device": "cpu"},
        "deployments": {"Gateway": {"user_config": {**gw, **user_config}}}})


def run(client: httpx.Client, load: list[tuple[str, str]], variant: str | None) -> list[dict]:
    out = []
    for group, text in load:
        body = {"text": text} | ({"variant": variant} if variant else {})
        t0 = time.perf_counter()
        r = client.post("/v1/classify", json=body)
        ms = 1e3 * (time.perf_counter() - t0)
        r.raise_for_status()
        a = r.json()
        out.append({"group": group, "ms": ms, "variant": a["variant"], "label": a["label"],
                    "n": a["n"]})
    return out


def main() -> None:
    p = Parser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=40, help="timed requests per N group")
    p.add_argument("--warmup", type=int, default=40, help="auto's warm-up requests per group")
    p.add_argument("--min-agreement", type=float, default=0.05)
    p.add_argument("--port", type=int, default=8795)
    a = p.parse_args()
    auto = {"policy": "auto", "auto": {"min_agreement": a.min_agreement, "min_pairs": 20,
                                       "min_latency_samples": 5, "explore": 0.1,
                                       "explore_unsettled": 1.0, "window": 100}}
    url = launch.start(gateway_config(a.port, auto), metrics_port=a.port + 1)
    try:
        client = httpx.Client(base_url=url, timeout=300)
        timed = texts(a.requests, seed=5_000)
        run(client, texts(a.warmup, seed=6_000), None)  # auto's evidence, and every warm-up
        got = {"auto": run(client, timed, None), "dense": run(client, timed, "dense"),
               "mita": run(client, timed, "mita")}
        routing = client.get("/v1/routing").json()
    finally:
        launch.stop()
    lines = [f"Mixed load, sequential, one client: {a.requests} timed requests per N group "
             f"after {a.warmup} warm-up requests per group under auto; shipped checkpoint "
             "(m = k = 16, s = 1), float32, batch 1, cpu; auto's guard: agreement lower bound "
             f"≥ {a.min_agreement}, 20+ pairs, margin 10 %\n",
             "| N group | N | policy | p50 ms | p99 ms | served by auto (mita / dense) | "
             "labels equal to dense's |", "|---|---|---|---|---|---|---|"]
    dense_labels = [r["label"] for r in got["dense"]]
    for group in GROUPS:
        for name, rows in got.items():
            mine = [(r, d) for r, d in zip(rows, dense_labels, strict=True)
                    if r["group"] == group]
            ms = np.array([r["ms"] for r, _ in mine])
            ns = [r["n"] for r, _ in mine]
            served = (f"{sum(r['variant'] == 'mita' for r, _ in mine)} / "
                      f"{sum(r['variant'] == 'dense' for r, _ in mine)}" if name == "auto"
                      else "–")
            agree = np.mean([r["label"] == d for r, d in mine])
            lines.append(f"| {group} | {min(ns)}–{max(ns)} | {name} | "
                         f"{np.percentile(ms, 50):.1f} | {np.percentile(ms, 99):.1f} | "
                         f"{served} | {100 * agree:.1f} % |")
    print("\n".join(lines))
    print("\nrouting table at the end (buckets with evidence):")
    for b in routing["buckets"]:
        if b["mita_forwards"] or b["dense_forwards"]:
            print(json.dumps(b))


if __name__ == "__main__":
    main()
