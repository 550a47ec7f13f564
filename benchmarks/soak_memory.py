"""Memory of the real service's replicas under many distinct sequence lengths (issue 62).

    python benchmarks/soak_memory.py [--requests 20000] [--lengths 4000] [--concurrency 8]
                                     [--sample-every 1000] [--modes trim no-trim]
                                     [--margin-mib 64] [--out benchmarks/soak-memory]

Each mode runs in a fresh process, which starts Ray and the real service as
``python -m service`` does (``deploy/serve_config.yaml``, shipped checkpoint, CPU, Ray Serve's
throughput mode), with one replica per classifier (no autoscaling: a second replica would
split the traffic and the memory), and sends ``--requests`` requests from ``--concurrency``
closed-loop clients (httpx, ``POST /v1/classify {"ids": [...], "variant": ...}``; ids drawn
from the ListOps vocabulary 1-15, which the ids endpoint takes at any N):

- first every length N = 1 … ``--lengths`` once, in a shuffled order, to each variant
  (2 × ``--lengths`` requests: the warm-up; each replica has then seen every length once);
- then lengths drawn uniformly from those already seen, the variants alternating, until
  ``--requests`` in all.

Every ``--sample-every`` answered requests (and before the first) it reads the resident set
size of each replica's process — the MiTA classifier, the dense classifier and the gateway,
found by the titles Ray gives them ("ServeReplica:mita-serve:<deployment>", psutil). The table
gives the RSS at 0, 5K, 10K, 15K, 20K requests (and the end), the peak up to the end of the
warm-up and after it, and the growth after warm-up: peak after − peak up to the end of the
warm-up, which a bounded replica keeps within ``--margin-mib``.

Modes: ``trim`` is the service as shipped (``service.engine.HeapTrim``: ``malloc_trim(0)``
once the RSS has grown by 128 MiB since the last trim); ``no-trim`` the same with
``MITA_SERVE_HEAP_TRIM_MIB=0``, i.e. before the fix. Results: ``soak.json`` (every sample,
the arguments, the machine) and ``soak.md`` (the table) in ``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from mita.tools.argtypes import Parser, bounded

ROOT = Path(__file__).resolve().parents[1]
MODES = {"trim": {}, "no-trim": {"MITA_SERVE_HEAP_TRIM_MIB": "0"}}
# The replicas measured, by the deployment named in their Ray process title.
REPLICAS = {"mita": "MiTAClassifier", "dense": "DenseClassifier", "gateway": "Gateway"}
TABLE_AT = (0, 5000, 10000, 15000, 20000)


def replica_processes(app: str = "mita-serve") -> dict:
    """``{"mita" | "dense" | "gateway": psutil.Process}``: the replicas of ``app`` among this
    process's descendants (the Ray it started: another instance on the machine, a test
    suite's, has replicas of the same titles). Raises RuntimeError when one is missing or
    there are several (a second replica would make the numbers per deployment, not per
    replica)."""
    import psutil

    found: dict[str, list] = {k: [] for k in REPLICAS}
    for p in psutil.Process().children(recursive=True):
        try:
            cmd = " ".join(p.cmdline())
        except psutil.Error:  # gone meanwhile
            continue
        for key, deployment in REPLICAS.items():
            if f"ServeReplica:{app}:{deployment}" in cmd:
                found[key].append(p)
    bad = {k: len(v) for k, v in found.items() if len(v) != 1}
    if bad:
        raise RuntimeError(f"expected one process per replica, found {bad}")
    return {k: v[0] for k, v in found.items()}


def schedule(requests: int, lengths: int, seed: int) -> list[tuple[int, str]]:
    """(N, variant) of each request, in order: N = 1 … ``lengths`` shuffled, each to MiTA then
    dense, then N drawn from those seen with the variants alternating, ``requests`` in all."""
    rng = np.random.default_rng(seed)
    out = [(int(n), v) for n in rng.permutation(np.arange(1, lengths + 1))
           for v in ("mita", "dense")]
    more = rng.integers(1, lengths + 1, size=max(0, requests - len(out)))
    out += [(int(n), ("mita", "dense")[i % 2]) for i, n in enumerate(more)]
    return out[:requests]


def child(mode: str, a: argparse.Namespace) -> dict:
    """Start the service, run the schedule, return every RSS sample (MiB) and the statuses."""
    import httpx
    import torch

    from service import launch

    one = {"num_replicas": 1, "autoscaling_config": None}
    cfg = launch.load_config(launch.CPU_CONFIG, {
        "http_options": {"port": a.port}, "args": {"device": "cpu"},
        "deployments": {"MiTAClassifier": one, "DenseClassifier": one}})
    launch.prebuild_cpu_kernels(cfg)  # as python -m service does, not inside a replica
    url = launch.start(cfg, metrics_port=a.port + 1)
    try:
        procs = replica_processes(cfg.applications[0].name)
        # what the classifier replicas run with: the mode's variable must have reached them
        trim_env = {k: p.environ().get("MITA_SERVE_HEAP_TRIM_MIB") for k, p in procs.items()}
        plan = schedule(a.requests, a.lengths, a.seed)
        rng = np.random.default_rng(a.seed + 1)
        samples: list[dict] = []
        statuses: dict[int, int] = {}
        began = time.monotonic()

        def sample(done: int) -> None:
            row = {"requests": done, "elapsed_s": round(time.monotonic() - began, 1)}
            row |= {k: p.memory_info().rss / 2**20 for k, p in procs.items()}
            samples.append(row)
            print(json.dumps(row), flush=True)

        async def run() -> None:
            todo = iter(plan)
            done = [0]

            async def client(c: httpx.AsyncClient) -> None:
                for n, variant in todo:
                    ids = rng.integers(1, 16, size=n).tolist()
                    r = await c.post("/v1/classify", json={"ids": ids, "variant": variant})
                    statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
                    done[0] += 1
                    if done[0] % a.sample_every == 0 or done[0] == len(plan):
                        sample(done[0])
            async with httpx.AsyncClient(base_url=url, timeout=300) as c:
                await asyncio.gather(*(client(c) for _ in range(a.concurrency)))

        sample(0)
        asyncio.run(run())
    finally:
        launch.stop()
    return {"mode": mode, "samples": samples, "statuses": statuses, "replica_env": trim_env,
            "seconds": round(time.monotonic() - began, 1), "torch": torch.__version__}


def summary(result: dict, warmup: int, margin_mib: float) -> dict:
    """Per replica: peak RSS up to the end of the warm-up and after it, the growth (MiB) and
    whether it is within ``margin_mib``."""
    out = {}
    for key in REPLICAS:
        before = [s[key] for s in result["samples"] if s["requests"] <= warmup]
        after = [s[key] for s in result["samples"] if s["requests"] > warmup]
        growth = (max(after) - max(before)) if after else float("nan")
        out[key] = {"peak_warmup_mib": max(before), "peak_after_mib": max(after or [np.nan]),
                    "growth_mib": growth, "within_margin": bool(growth <= margin_mib)}
    return out


def table(results: list[dict], a: argparse.Namespace, warmup: int) -> str:
    """The Markdown table: one row per replica and mode."""
    at = [n for n in TABLE_AT if n <= a.requests]
    if a.requests not in at:
        at.append(a.requests)
    head = ("| replica | mode | " + " | ".join(f"RSS @ {n:,} MiB" for n in at)
            + " | peak ≤ warm-up | peak after | growth after warm-up | within "
            f"{a.margin_mib:g} MiB |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for key in REPLICAS:
        for r in results:
            rss = {s["requests"]: s[key] for s in r["samples"]}
            s = r["summary"][key]
            cells = [f"{rss[n]:.0f}" if n in rss else "–" for n in at]
            lines.append(f"| {key} | {r['mode']} | " + " | ".join(cells)
                         + f" | {s['peak_warmup_mib']:.0f} | {s['peak_after_mib']:.0f} | "
                         f"{s['growth_mib']:+.0f} | {'yes' if s['within_margin'] else 'NO'} |")
    lines.append("")
    for r in results:
        lines.append(f"- {r['mode']}: {a.requests:,} requests in {r['seconds']:.0f} s, "
                     f"statuses {r['statuses']}; MITA_SERVE_HEAP_TRIM_MIB in the replicas: "
                     f"{r['replica_env']}")
    return "\n".join(lines)


def main() -> None:
    p = Parser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=bounded(int, 1), default=20000)
    p.add_argument("--lengths", type=bounded(int, 1, 16384), default=4000,
                   help="distinct N = 1 … this, each sent once to each variant first")
    p.add_argument("--concurrency", type=bounded(int, 1), default=8)
    p.add_argument("--sample-every", type=bounded(int, 1), default=1000)
    p.add_argument("--margin-mib", type=bounded(float, 0), default=64.0,
                   help="growth after warm-up a bounded replica stays within (MiB)")
    p.add_argument("--modes", nargs="+", choices=tuple(MODES), default=list(MODES))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--port", type=int, default=8795)
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "soak-memory")
    p.add_argument("--child", choices=tuple(MODES), help=argparse.SUPPRESS)
    p.add_argument("--child-out", type=Path, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        a.child_out.write_text(json.dumps(child(a.child, a)))
        return
    warmup = min(a.requests, 2 * a.lengths)
    results = []
    for mode in a.modes:
        out = Path(f"/tmp/soak_memory-{os.getpid()}-{mode}.json")
        # as python -m service runs: Serve's throughput mode; the heap trim as the mode says
        env = {k: v for k, v in os.environ.items() if k != "MITA_SERVE_HEAP_TRIM_MIB"}
        env |= {"RAY_SERVE_THROUGHPUT_OPTIMIZED": "1"} | MODES[mode]
        subprocess.run([sys.executable, __file__, "--child", mode, "--child-out", str(out),
                        "--requests", str(a.requests), "--lengths", str(a.lengths),
                        "--concurrency", str(a.concurrency),
                        "--sample-every", str(a.sample_every), "--seed", str(a.seed),
                        "--port", str(a.port)], env=env, check=True, cwd=ROOT)
        r = json.loads(out.read_text())
        out.unlink()
        r["summary"] = summary(r, warmup, a.margin_mib)
        results.append(r)
    text = table(results, a, warmup)
    a.out.mkdir(parents=True, exist_ok=True)
    record = {"command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
              "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()
                       if k not in ("child", "child_out")},
              "warmup_requests": warmup,
              "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                          "python": platform.python_version(),
                          "libc": " ".join(platform.libc_ver())},
              "results": results}
    (a.out / "soak.json").write_text(json.dumps(record, indent=1))
    (a.out / "soak.md").write_text(text + "\n")
    print("\n" + text)


if __name__ == "__main__":
    main()
