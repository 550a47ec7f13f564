"""What the service adds around a forward, against a bare Ray Serve app of the same shape,
side by side in one run, in Ray Serve's default mode and with ``RAY_SERVE_THROUGHPUT_OPTIMIZED=1``.

    python benchmarks/serve_overhead.py [--requests 60] [--warmup 10] [--blocks 1 10]
                                        [--duration-s 5] [--rounds 3]

Each mode runs in a fresh process (Serve reads the variable when it is imported), which starts
Ray, the real service (deploy/serve_config.yaml, shipped checkpoint, CPU) and, in the same
Serve instance, the two bare apps written below, of the service's shape: HTTP proxy → FastAPI
ingress → one ``DeploymentHandle`` call to a second deployment, which

- **bare**: returns ``len(ids)`` at once (Ray Serve's own floor);
- **bare + model**: runs the shipped checkpoint's MiTA model on the ids as plainly as PyTorch
  allows — ``model(ids)`` under ``no_grad``, same weights, backend and thread count as the
  product's classifier, without the service's engine, stage timer, profile, checks,
  routing or metrics — and the ingress returns the label with the forward's time in
  ``Server-Timing``. On a CPU the forward shares the cores with everything else, so this
  is the floor for a server that actually runs the model there.

All apps get the same bodies, taking turns:

- **sequential**: for N = 64, 1,024, 16,384 and JSON (``{"ids": [...]}``) and binary
  (uint8) bodies, ``--warmup`` untimed then ``--requests`` timed requests to each app, in
  runs of ``block`` requests to one app before the next takes its turn — one pass per value
  of ``--blocks``: 1 interleaves single requests (each app then runs right after the other
  apps' processes have filled the caches), 10 gives each app a run of requests as a service
  gets them, still alternating over the same minutes. An app's overhead is its round trip
  minus the forward's own time, read from the answer's ``Server-Timing`` header (the
  product's: the profile's ``total_ms``, so the request need not ask for the whole profile —
  as most requests do not; the bare app's forward is 0).
- **closed loop**: N = 64, JSON, ``concurrency`` clients each sending the next request when
  the last answered, for ``--duration-s``, ``--rounds`` times per app, the apps taking turns;
  throughput is answered requests per second over all rounds. Around every loop the CPU
  time of each process on the machine is read (user + system, ``psutil``): the CPU each app
  spends per answered request, by process — the HTTP proxy, its ingress, its second
  deployment, the client, and all other processes (Ray's controller, raylet and agents, the
  idle apps' replicas) — so a throughput ratio can be traced to where the cores went.

The product runs the MiTA classifier (``variant: mita``), ``deterministic: true`` as shipped,
with one replica per classifier (no autoscaling), as the bare apps have one per deployment.
Client and servers share the machine's cores; the client is one asyncio process (aiohttp).
"""

# No ``from __future__ import annotations``: FastAPI must see the bare endpoint's real types
# in the replica, where the cloudpickled functions cannot resolve the names.
import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from pydantic import BaseModel

from mita.tools.argtypes import Parser

ROOT = Path(__file__).resolve().parents[1]
NS = (64, 1024, 16384)
CONCURRENCY = (1, 8, 32)
MODES = {"default": {}, "throughput": {"RAY_SERVE_THROUGHPUT_OPTIMIZED": "1"}}
BARE_PREFIX = "/bare"
BARE_MODEL_PREFIX = "/bare-model"
# Each app's ingress and second deployment, as Ray titles their worker processes
# ("ray::ServeReplica:<app>:<deployment>"); the HTTP proxy ("ray::ProxyActor") serves all apps.
PATH_PROCESSES = {"product": ("mita-serve:Gateway", "mita-serve:MiTAClassifier"),
                  "bare": ("bare:Ingress", "bare:Count"),
                  "bare_model": ("bare-model:Ingress", "bare-model:Count")}
CPU_ROLES = ("proxy", "ingress", "second", "client", "other")


class Body(BaseModel):
    ids: list[int]


def bare_app(checkpoint: str | None = None):
    """The bare Ray Serve app of the service's shape, without anything of the service. Its
    second deployment answers ``len(ids)`` at once; with ``checkpoint`` ("bare + model") it
    instead runs that checkpoint's MiTA model on the ids as plainly as PyTorch allows (no
    engine, no stage timer, no profile, no metrics: ``model(ids)`` under ``no_grad``, the
    same weights, backend and thread count as the product's classifier) and the ingress
    answers the label with the forward's milliseconds in ``Server-Timing`` as the product
    does."""
    import time

    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse
    from ray import serve

    api = FastAPI()

    # max_ongoing_requests as the product's classifiers: with Serve's default (5), the
    # ingress holds the requests above it and probes the replica for room, which a forward on
    # its event loop keeps from answering (bare + model fell to ~19 requests/s at concurrency
    # 32 in Serve's default mode)
    @serve.deployment(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=64)
    class Count:
        def __init__(self, checkpoint):
            self.model = None
            if checkpoint is not None:
                import torch

                from mita.model import load_checkpoint

                self.torch = torch
                self.model = load_checkpoint(ROOT / checkpoint, attention="mita").eval()

        async def count(self, ids) -> tuple[int, float]:
            if self.model is None:
                return len(ids), 0.0
            t0 = time.perf_counter()
            with self.torch.no_grad():
                logits = self.model(self.torch.from_numpy(ids.astype(np.int64))[None])
            ms = 1e3 * (time.perf_counter() - t0)
            return int(logits.argmax()), ms

    @serve.deployment(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=256)
    @serve.ingress(api)
    class Ingress:
        def __init__(self, count):
            self.count = count

        async def answer(self, ids: np.ndarray) -> JSONResponse:
            label, ms = await self.count.count.remote(ids)
            return JSONResponse({"label": label, "n": len(ids)},
                                headers={"server-timing": f"forward;dur={ms:.3f}"})

        @api.post("/v1/classify")
        async def classify(self, body: Body) -> JSONResponse:
            return await self.answer(np.asarray(body.ids))

        @api.post("/v1/classify/binary")
        async def binary(self, request: Request) -> JSONResponse:
            return await self.answer(np.frombuffer(await request.body(), dtype=np.uint8))

    return Ingress.bind(Count.bind(checkpoint))


def bodies(n: int) -> dict[str, tuple[str, bytes, str, str]]:
    """(path, body, content type, query) of the JSON and binary request for N = ``n``."""
    ids = np.random.default_rng(n).integers(1, 16, n).astype(np.uint8)
    return {"json": ("/v1/classify", json.dumps({"ids": ids.tolist(), "variant": "mita"}
                                                 ).encode(), "application/json", ""),
            "binary": ("/v1/classify/binary", ids.tobytes(), "application/octet-stream",
                       "?variant=mita")}


async def post(session, url: str, body: bytes, ctype: str) -> tuple[float, float]:
    """(round trip in ms, the forward's ms from the product's ``Server-Timing`` header, 0 for
    the bare app); raises on a status other than 200."""
    t0 = time.perf_counter()
    async with session.post(url, data=body, headers={"content-type": ctype}) as r:
        answer = await r.read()
    rt_ms = 1e3 * (time.perf_counter() - t0)
    if r.status != 200:
        raise RuntimeError(f"{url}: {r.status} {answer[:500]!r}")
    timing = r.headers.get("server-timing")
    return rt_ms, float(timing.split(";dur=")[1]) if timing else 0.0


async def sequential(session, urls: dict[str, str], requests: int, warmup: int,
                     block: int = 1) -> list[dict]:
    """Per (N, body): the product, the bare app and the bare app with the model, in turn —
    ``block`` requests to one before the next (1: one request each; more: each app serves a
    run of requests in a row, as a service does, and the apps still alternate over the same
    minutes)."""
    rows = []
    for n in NS:
        for fmt, (path, body, ctype, query) in bodies(n).items():
            got = {app: [] for app in urls}
            for start in range(0, warmup + requests, block):
                count = min(block, warmup + requests - start)
                timed = [start + j >= warmup for j in range(count)]
                for app, base in urls.items():
                    url = base + path + (query if app == "product" else "")
                    for t in timed:
                        rt, fwd = await post(session, url, body, ctype)
                        if t:
                            got[app].append((rt, rt - fwd, fwd))
            row = {"n": n, "format": fmt}
            for app, samples in got.items():
                a = np.asarray(samples)
                row[app] = {"round_trip_p50_ms": float(np.percentile(a[:, 0], 50)),
                            "overhead_p50_ms": float(np.percentile(a[:, 1], 50)),
                            "overhead_p99_ms": float(np.percentile(a[:, 1], 99)),
                            "forward_p50_ms": float(np.percentile(a[:, 2], 50))}
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


async def closed_loop(session, url: str, body: bytes, concurrency: int,
                      duration_s: float) -> tuple[int, int, float]:
    """(answered 200, other answers, seconds) of ``concurrency`` clients for ``duration_s``."""
    counts = [0, 0]
    stop_at = time.perf_counter() + duration_s

    async def client():
        while time.perf_counter() < stop_at:
            async with session.post(url, data=body,
                                    headers={"content-type": "application/json"}) as r:
                await r.read()
                counts[r.status != 200] += 1
    t0 = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    return counts[0], counts[1], time.perf_counter() - t0


def cpu_seconds() -> dict[int, tuple[str, float]]:
    """pid → (command line, CPU seconds so far: user + system) of every process readable."""
    import psutil

    out = {}
    for p in psutil.process_iter(["cmdline"]):
        try:
            t = p.cpu_times()
        except psutil.Error:  # gone, or not ours to read
            continue
        out[p.pid] = (" ".join(p.info["cmdline"] or ()), t.user + t.system)
    return out


def cpu_by_role(before: dict, after: dict, app: str) -> dict[str, float]:
    """CPU seconds each of ``CPU_ROLES`` used between two ``cpu_seconds`` snapshots while
    ``app`` was loaded: ``proxy``, ``ingress`` and ``second`` (its two deployments' replicas,
    ``PATH_PROCESSES``), ``client`` (this process) and ``other`` (every other process)."""
    ingress, second = (f"ServeReplica:{d}" for d in PATH_PROCESSES[app])
    used = dict.fromkeys(CPU_ROLES, 0.0)
    for pid, (cmd, t) in after.items():
        role = ("client" if pid == os.getpid() else "proxy" if "ProxyActor" in cmd
                else "ingress" if ingress in cmd else "second" if second in cmd else "other")
        used[role] += t - before.get(pid, (cmd, 0.0))[1]
    return used


async def throughput(session, urls: dict[str, str], duration_s: float,
                     rounds: int) -> list[dict]:
    path, body, _, _ = bodies(64)["json"]
    rows = []
    for c in CONCURRENCY:
        done = {app: [0, 0, 0.0] for app in urls}
        cpu = {app: dict.fromkeys(CPU_ROLES, 0.0) for app in urls}
        for _ in range(rounds):
            for app, base in urls.items():
                before = cpu_seconds()
                ok, bad, s = await closed_loop(session, base + path, body, c, duration_s)
                for role, used in cpu_by_role(before, cpu_seconds(), app).items():
                    cpu[app][role] += used
                done[app] = [done[app][0] + ok, done[app][1] + bad, done[app][2] + s]
        row = {"concurrency": c, **{app: {"rps": ok / s, "non_200": bad, "cpu_ms_per_request": {
            role: 1e3 * used / max(ok, 1) for role, used in cpu[app].items()}}
            for app, (ok, bad, s) in done.items()}}
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def child(mode: str, a: argparse.Namespace) -> dict:
    import aiohttp
    import torch
    from ray import serve

    sys.path.insert(0, str(ROOT))
    from service import launch

    # One replica per classifier, as the bare app has one per deployment: the shipped
    # autoscaling would start a second MiTA replica under the closed loops, and its start-up
    # (torch, the checkpoint, the kernels) would be measured as request-path cost.
    one = {"num_replicas": 1, "autoscaling_config": None}
    cfg = launch.load_config(launch.CPU_CONFIG, {
        "http_options": {"port": a.port}, "args": {"device": "cpu"},
        "deployments": {"MiTAClassifier": one, "DenseClassifier": one}})
    url = launch.start(cfg, metrics_port=a.port + 1)
    try:
        serve.run(bare_app(), name="bare", route_prefix=BARE_PREFIX)
        serve.run(bare_app(cfg.applications[0].args["checkpoint"]), name="bare-model",
                  route_prefix=BARE_MODEL_PREFIX)
        urls = {"product": url, "bare": url + BARE_PREFIX,
                "bare_model": url + BARE_MODEL_PREFIX}

        async def run():
            async with aiohttp.ClientSession(
                    connector=aiohttp.TCPConnector(limit=0),
                    timeout=aiohttp.ClientTimeout(total=300)) as session:
                seq = []
                for block in a.blocks:
                    for row in await sequential(session, urls, a.requests, a.warmup, block):
                        seq.append({"block": block, **row})
                return (seq,
                        await throughput(session, urls, a.duration_s, a.rounds))
        seq, tput = asyncio.run(run())
    finally:
        launch.stop()
    return {"mode": mode, "sequential": seq, "throughput": tput,
            "torch": torch.__version__, "cpus": os.cpu_count()}


def table(results: list[dict], a: argparse.Namespace) -> str:
    lines = [f"MiTA classifier (shipped checkpoint, m = k = 16, s = 1), deterministic, batch 1, "
             f"float32, cpu ({results[0]['cpus']} cores, client included); torch "
             f"{results[0]['torch']}; {a.requests} timed requests per cell after {a.warmup} "
             f"warm-ups, apps in turn; closed loops {a.rounds} × {a.duration_s:g} s per app "
             "and cell, alternating\n",
             "### Sequential: overhead = round trip − forward (bare app: round trip)\n",
             "| mode | in a row | N | body | product overhead p50 ms | bare p50 ms | "
             "product − bare ms | bare + model overhead p50 ms | product − (bare + model) ms | "
             "product overhead p99 ms | bare p99 ms | product forward p50 ms | "
             "bare + model forward p50 ms |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        for row in r["sequential"]:
            p, b, w = row["product"], row["bare"], row["bare_model"]
            lines.append(f"| {r['mode']} | {row['block']} | {row['n']} | {row['format']} | "
                         f"{p['overhead_p50_ms']:.2f} | {b['overhead_p50_ms']:.2f} | "
                         f"{p['overhead_p50_ms'] - b['overhead_p50_ms']:+.2f} | "
                         f"{w['overhead_p50_ms']:.2f} | "
                         f"{p['overhead_p50_ms'] - w['overhead_p50_ms']:+.2f} | "
                         f"{p['overhead_p99_ms']:.2f} | {b['overhead_p99_ms']:.2f} | "
                         f"{p['forward_p50_ms']:.2f} | {w['forward_p50_ms']:.2f} |")
    lines += ["", "### Closed loop, N = 64, JSON: answered requests per second\n",
              "| mode | concurrency | product req/s | bare req/s | bare + model req/s | "
              "product / bare | product / (bare + model) | non-200 |",
              "|---|---|---|---|---|---|---|---|"]
    for r in results:
        for row in r["throughput"]:
            p, b, w = row["product"], row["bare"], row["bare_model"]
            lines.append(f"| {r['mode']} | {row['concurrency']} | {p['rps']:.0f} | "
                         f"{b['rps']:.0f} | {w['rps']:.0f} | {p['rps'] / b['rps']:.2f} | "
                         f"{p['rps'] / w['rps']:.2f} | "
                         f"{p['non_200'] + b['non_200'] + w['non_200']} |")
    lines += ["", f"### Closed loop at concurrency {CONCURRENCY[-1]}: CPU ms per answered request, "
              "by process (user + system; all rounds)\n",
              "| mode | app | HTTP proxy | ingress | second deployment | client | "
              "other processes | all |",
              "|---|---|---|---|---|---|---|---|"]
    for r in results:
        row = r["throughput"][-1]
        for app in PATH_PROCESSES:
            ms = row[app]["cpu_ms_per_request"]
            lines.append(f"| {r['mode']} | {app.replace('_', ' + ')} | "
                         + " | ".join(f"{ms[role]:.2f}" for role in CPU_ROLES)
                         + f" | {sum(ms.values()):.2f} |")
    return "\n".join(lines)


def main() -> None:
    p = Parser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=60)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--blocks", type=int, nargs="+", default=[1, 10],
                   help="sequential requests in a row to one app before the next; each value "
                        "is one full sequential pass (default: 1 and 10)")
    p.add_argument("--duration-s", type=float, default=5.0)
    p.add_argument("--rounds", type=int, default=3,
                   help="closed-loop rounds per concurrency, the apps taking turns")
    p.add_argument("--port", type=int, default=8785)
    p.add_argument("--modes", nargs="+", choices=tuple(MODES), default=list(MODES))
    p.add_argument("--child", choices=tuple(MODES), help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        a.out.write_text(json.dumps(child(a.child, a)))
        return
    results = []
    for mode in a.modes:
        out = Path(f"/tmp/serve_overhead-{os.getpid()}-{mode}.json")
        env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_SERVE_THROUGHPUT")}
        subprocess.run([sys.executable, __file__, "--child", mode, "--out", str(out),
                        "--requests", str(a.requests), "--warmup", str(a.warmup),
                        "--blocks", *map(str, a.blocks),
                        "--duration-s", str(a.duration_s), "--rounds", str(a.rounds),
                        "--port", str(a.port)],
                       env=env | MODES[mode], check=True)
        results.append(json.loads(out.read_text()))
        out.unlink()
    print("\n" + table(results, a))


if __name__ == "__main__":
    main()
