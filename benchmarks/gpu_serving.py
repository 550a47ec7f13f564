"""The serving code path on one GPU, without Ray: ``service.engine.ClassifierEngine`` (what each
classifier replica runs) for MiTA and dense on the shipped checkpoint.

    PYTHONPATH=. python3 benchmarks/gpu_serving.py [--out DIR]     # on a GPU (≤ 6 min)
    python benchmarks/gpu_serving.py --smoke [--out DIR]            # CPU dry run (CI)

1. Checks (real ListOps, 24 sequences of 100-600 tokens): the GPU engine vs the CPU float32
   engine — float32 on the GPU within 1e-4 of the CPU's probabilities with every label equal;
   bfloat16 (the GPU default) within 0.03 (``tests/no_ray/test_engine.py``'s bound) — and a padded
   batch vs one forward per sequence on the GPU (float32: 1e-5; bfloat16: 0.03); CUDA-graph
   replays vs plain forwards (1e-6).
2. Requests: N = 1K, 4K, 16K, 64K, 256K, 1M random ids, batch 1 and 8 (8 requests of the same
   N arriving together, as ``@serve.batch`` hands them over), each batch as the service runs
   it: ``deterministic: true`` (one forward per sequence, the shipped default) and, for batch
   8, ``deterministic: false`` (one padded forward). Request time = wall time of
   ``engine.run`` (host clock; it ends with the probabilities copied to the host), p50/p99
   over repeats; per-stage p50 from the CUDA-event profile of the batch-1 runs; peak memory
   (``torch.cuda.max_memory_allocated`` per forward). Repeats adapt to a time budget; a cell
   predicted to overrun it is skipped and marked.
   Unstaged forwards replay CUDA graphs per shape (``service.graphs``, N ≤ 16K; the column
   counts the replays); the stage p50 then comes from staged forwards.
3. Profiler overhead: the engine's profiled forward (``profile_forward``: a CUDA-event pair per
   stage) vs the plain ``model(ids)``, interleaved, CUDA events around the whole forward,
   median of repeats, at N = 1K, 16K, 256K.

The model is the shipped checkpoint (2 layers, dim 64, 2 heads of d = 32, m = k = 16, s = 1),
dtype ``auto`` (bfloat16 on CUDA), ``mita_backend: auto`` (the Triton kernel on CUDA).
``--smoke`` runs the same code on the CPU (N = 256 and 1024, ``mita_backend: torch``; the checks
compare a CPU float32 / bfloat16 engine with the CPU float32 one); its timings mean nothing.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # mita, profiler, service without an install

import numpy as np  # noqa: E402
import torch  # noqa: E402

from mita.data.listops import ListOpsConfig, encode, generate  # noqa: E402
from mita.timer import StageTimer  # noqa: E402
from mita.tools.argtypes import Parser  # noqa: E402
from service.engine import ClassifierEngine  # noqa: E402
from service.settings import VARIANTS  # noqa: E402

CHECKPOINT = "checkpoints/listops-default"
NS = [1024, 4096, 16384, 65536, 262144, 1 << 20]  # request cells on a GPU
BATCHES = [1, 8]
OVERHEAD_NS = [1024, 16384, 262144]


def probs(results) -> np.ndarray:
    return np.array([r["probabilities"] for r in results])


def check_row(name, err, tol, labels_equal=None) -> dict:
    ok = bool(err < tol) and labels_equal is not False
    return {"check": name, "max_abs_err": float(err), "tol": tol,
            "labels_equal": labels_equal, "ok": ok}


def checks(device: str, smoke: bool) -> list[dict]:
    data = generate(8 if smoke else 24, seed=31_337, cfg=ListOpsConfig(100, 600))
    batch = [np.array(encode(t), dtype=np.uint8) for t, _ in data]
    rows = []
    for variant in VARIANTS:
        cpu = ClassifierEngine(CHECKPOINT, variant, "cpu", "torch", "float32")
        ref = probs(cpu.run(batch))
        # auto is bfloat16 on CUDA; the CPU dry run names bfloat16 (auto would be float32).
        for dtype, tol in (("float32", 1e-4), ("bfloat16" if smoke else "auto", 0.03)):
            eng = ClassifierEngine(CHECKPOINT, variant, device, "torch" if smoke else "auto",
                                   dtype)
            got = probs(eng.run(batch))
            same = bool((got.argmax(1) == ref.argmax(1)).all()) if dtype == "float32" else None
            rows.append(check_row(f"{variant} {device} {eng.dtype_name} vs cpu float32",
                                  np.abs(got - ref).max(), tol, same))
            padded = probs(eng.run(batch, deterministic=False))
            rows.append(check_row(f"{variant} {device} {eng.dtype_name} padded vs solo",
                                  np.abs(padded - got).max(),
                                  1e-5 if eng.dtype == torch.float32 else 0.03))
        rows.append(check_graphs(variant, device, batch[:3], smoke))
    return rows


def check_graphs(variant: str, device: str, seqs, smoke: bool) -> dict:
    """CUDA-graph replays (``service.graphs``; the CPU dry run uses ``eager_capture``) vs the
    same engine's plain forwards: each sequence three times, the 2nd captured, the 3rd
    replayed. Tolerance 1e-6 absolute: a replay runs the captured kernels on the same
    inputs."""
    from service.graphs import GraphCache, eager_capture

    eng = ClassifierEngine(CHECKPOINT, variant, device, "torch" if smoke else "auto", "auto")
    plain = probs(eng.run(seqs))
    if eng.graphs is None:
        eng.graphs = GraphCache(eng.model, capture=eager_capture)
    runs = [eng.run(seqs) for _ in range(3)]
    replayed = all(r["profile"].cuda_graph for r in runs[2])
    row = check_row(f"{variant} {device} {eng.dtype_name} graph replay vs plain forward "
                    f"({'3rd run replayed' if replayed else '3rd run NOT replayed'})",
                    max(np.abs(probs(r) - plain).max() for r in runs), 1e-6)
    row["ok"] = row["ok"] and replayed
    return row


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def time_requests(engine, batch, deterministic, reps_max, cell_budget_s):
    """Wall-clock ms of ``engine.run`` per repeat (after one warm-up) and the profiles."""
    engine.run(batch, deterministic)  # warm-up: Triton compile, cuBLAS handles, allocator
    times, profiles = [], []
    t_cell = time.perf_counter()
    while len(times) < reps_max and (not times or time.perf_counter() - t_cell < cell_budget_s):
        sync(engine.device)
        t0 = time.perf_counter()
        out = engine.run(batch, deterministic)
        times.append((time.perf_counter() - t0) * 1e3)
        profiles.append(out[0]["profile"])
    return times, profiles


def predict_ms(one_ms: dict, variant: str, n: int) -> float:
    """Batch-1 forward ms at N: measured, or scaled from the largest N measured so far (dense
    ∝ N², MiTA ∝ N at fixed m, k); 0 when nothing is known yet."""
    if (variant, n) in one_ms:
        return one_ms[(variant, n)]
    known = [m for (v, m) in one_ms if v == variant and m < n]
    if not known:
        return 0.0
    prev = max(known)
    return one_ms[(variant, prev)] * (n / prev) ** (2 if variant == "dense" else 1)


def requests(device: str, ns, batches, budget_s, start, smoke) -> list[dict]:
    rows = []
    engines = {v: ClassifierEngine(CHECKPOINT, v, device, "torch" if smoke else "auto", "auto")
               for v in VARIANTS}
    one_ms: dict[tuple[str, int], float] = {}  # batch-1 median, to predict the next cells
    for n in ns:
        for variant, eng in engines.items():
            cfg = eng.model.config
            for b in batches:
                modes = (True,) if b == 1 else (True, False)
                for det in modes:
                    row = {"variant": variant, "N": n, "batch": b,
                           "mode": "per-sequence" if det else "padded",
                           "m": cfg.num_landmarks if variant == "mita" else None,
                           "k": cfg.topk if variant == "mita" else None,
                           "s": cfg.route_topk if variant == "mita" else None,
                           "dtype": eng.dtype_name, "device": device_name(eng.device)}
                    left = budget_s - (time.perf_counter() - start)
                    guess = predict_ms(one_ms, variant, n) * b * 2 / 1e3  # warm-up + 1 run
                    if guess > left - 20:
                        row["skipped"] = f"time budget (~{guess:.0f} s predicted)"
                        rows.append(row)
                        print(f"skip {variant} N={n} batch={b}: {row['skipped']}", flush=True)
                        continue
                    ids = np.random.default_rng(n + b).integers(1, 16, n).astype(np.uint8)
                    batch = [ids] * b
                    if device == "cuda":
                        torch.cuda.reset_peak_memory_stats()
                    times, profiles = time_requests(
                        eng, batch, det, reps_max=3 if smoke else 20,
                        cell_budget_s=min(8.0, max(0.0, left - 30) / 4))
                    row.update(p50_ms=float(np.percentile(times, 50)),
                               p99_ms=float(np.percentile(times, 99)), repeats=len(times),
                               peak_bytes=profiles[-1].peak_memory_bytes,
                               peak_kind=profiles[-1].peak_memory_kind)
                    row["cuda_graph_replays"] = sum(p.cuda_graph for p in profiles)
                    if b == 1:
                        one_ms[(variant, n)] = row["p50_ms"]
                        # replays have no stages: take the stages from staged forwards
                        staged = [p for p in profiles if p.stages_ms] or [
                            eng.run(batch, det, staged=[True])[0]["profile"] for _ in range(3)]
                        row["stages_p50_ms"] = {
                            s: float(np.median([p.stages_ms[s] for p in staged]))
                            for s in staged[0].stages_ms}
                    rows.append(row)
                    print(f"{variant:5} N={n:>8} batch={b} {row['mode']:12} p50 "
                          f"{row['p50_ms']:9.2f} ms  p99 {row['p99_ms']:9.2f} ms  "
                          f"({len(times)} reps)", flush=True)
        if device == "cuda":
            torch.cuda.empty_cache()
    return rows


def profiler_overhead(device: str, ns, smoke) -> list[dict]:
    """Profiled (engine) vs plain forward, interleaved; CUDA events (host clock on CPU)."""
    from mita.timer import profile_forward

    dev = torch.device(device)
    rows = []
    for variant in VARIANTS:
        eng = ClassifierEngine(CHECKPOINT, variant, device, "torch" if smoke else "auto", "auto")
        for n in ns:
            ids = torch.randint(1, 16, (1, n), generator=torch.Generator().manual_seed(n))
            ids = ids.to(dev)
            plain, hooked = [], []
            reps = 3 if smoke else (20 if n <= 16384 else 5)
            with torch.no_grad():
                eng.model(ids)
                for _ in range(reps):
                    timer = StageTimer(dev)
                    with timer.forward():
                        eng.model(ids)
                    plain.append(timer.result().total_ms)
                    _, prof = profile_forward(eng.model, ids)
                    hooked.append(prof.total_ms)
            p, h = float(np.median(plain)), float(np.median(hooked))
            rows.append({"variant": variant, "N": n, "plain_ms": p, "profiled_ms": h,
                         "overhead_pct": 100 * (h - p) / p, "repeats": reps,
                         "dtype": eng.dtype_name})
    return rows


def device_name(dev: torch.device) -> str:
    return torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"


def markdown(header, check_rows, req_rows, over_rows) -> str:
    out = [header, "", "### Checks (real ListOps, probabilities)", "",
           "| check | max abs error | tolerance | labels equal | ok |", "|---|---|---|---|---|"]
    for c in check_rows:
        eq = "-" if c["labels_equal"] is None else ("yes" if c["labels_equal"] else "NO")
        out.append(f"| {c['check']} | {c['max_abs_err']:.1e} | {c['tol']:.0e} | {eq} | "
                   f"{'yes' if c['ok'] else 'NO'} |")
    out += ["", "### Requests through ClassifierEngine (request time = engine.run wall time)", "",
            "| variant | N | m | k | s | batch | mode | dtype | p50 ms | p99 ms | repeats | "
            "peak GiB |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in req_rows:
        mks = [str(r[x]) if r[x] is not None else "-" for x in ("m", "k", "s")]
        head = (f"| {r['variant']} | {r['N']} | {' | '.join(mks)} | {r['batch']} | "
                f"{r['mode']} | {r['dtype']} |")
        if "skipped" in r:
            out.append(head + f" skipped: {r['skipped']} | | | |")
            continue
        peak = (f"{r['peak_bytes'] / 2**30:.2f}" + ("" if r["peak_kind"] == "cuda_max_allocated"
                                                   else " (estimate)")
                if r["peak_bytes"] else "-")
        out.append(head + f" {r['p50_ms']:.2f} | {r['p99_ms']:.2f} | {r['repeats']} | {peak} |")
    stage_rows = [r for r in req_rows if "stages_p50_ms" in r]
    names = []
    for r in stage_rows:
        names += [s for s in r["stages_p50_ms"] if s not in names]
    out += ["", "### Per-stage p50 (ms, batch 1, summed over layers)", "",
            "| variant | N | " + " | ".join(names) + " |", "|---|---|" + "---|" * len(names)]
    for r in stage_rows:
        st = r["stages_p50_ms"]
        out.append(f"| {r['variant']} | {r['N']} | "
                   + " | ".join(f"{st[s]:.3f}" if s in st else "-" for s in names) + " |")
    out += ["", "### Padded batch (deterministic: false) vs one forward per sequence, batch 8",
            "", "| variant | N | per-sequence p50 ms | padded p50 ms | per-sequence / padded |",
            "|---|---|---|---|---|"]
    by = {(r["variant"], r["N"], r["batch"], r["mode"]): r for r in req_rows if "p50_ms" in r}
    for (v, n, b, mode), r in by.items():
        if b == 8 and mode == "per-sequence" and (v, n, 8, "padded") in by:
            pad = by[(v, n, 8, "padded")]["p50_ms"]
            out.append(f"| {v} | {n} | {r['p50_ms']:.2f} | {pad:.2f} | "
                       f"{r['p50_ms'] / pad:.2f}× |")
    out += ["", "### Profiler overhead (profiled vs plain forward, interleaved, batch 1)", "",
            "| variant | N | dtype | plain ms | profiled ms | overhead | repeats |",
            "|---|---|---|---|---|---|---|"]
    for r in over_rows:
        out.append(f"| {r['variant']} | {r['N']} | {r['dtype']} | {r['plain_ms']:.3f} | "
                   f"{r['profiled_ms']:.3f} | {r['overhead_pct']:+.1f} % | {r['repeats']} |")
    return "\n".join(out)


def main() -> int:
    p = Parser(description=__doc__.split("\n")[0])
    p.add_argument("--smoke", action="store_true", help="CPU dry run at tiny N")
    p.add_argument("--out", default=os.environ.get("OUT"), help="folder for the JSON and table")
    p.add_argument("--budget-s", type=float, default=330.0,
                   help="wall-time budget for the request cells (skip what would overrun)")
    a = p.parse_args()
    start = time.perf_counter()
    if a.smoke:
        device, ns, over_ns = "cpu", [256, 1024], [256]
    else:
        if not torch.cuda.is_available():
            print("no CUDA device: run with --smoke for the CPU dry run", file=sys.stderr)
            return 2
        device = "cuda"
        ns, over_ns = NS, OVERHEAD_NS
    import triton
    header = (f"torch {torch.__version__}, triton {triton.__version__}, device "
              f"{device_name(torch.device(device))}, checkpoint {CHECKPOINT}")
    print(header, flush=True)
    with torch.no_grad():
        check_rows = checks(device, a.smoke)
    for c in check_rows:
        print(f"{'ok ' if c['ok'] else 'BAD'} {c['check']}: {c['max_abs_err']:.1e} "
              f"(tol {c['tol']:.0e})", flush=True)
    over_rows = profiler_overhead(device, over_ns, a.smoke)
    req_rows = requests(device, ns, BATCHES, a.budget_s, start, a.smoke)
    table = markdown(header, check_rows, req_rows, over_rows)
    print("\n" + table)
    print(f"\nwall time {time.perf_counter() - start:.0f} s")
    if a.out:
        Path(a.out).mkdir(parents=True, exist_ok=True)
        Path(a.out, "gpu_serving.md").write_text(table + "\n")
        Path(a.out, "gpu_serving.json").write_text(json.dumps(
            {"header": header, "checks": check_rows, "requests": req_rows,
             "profiler_overhead": over_rows}, indent=1))
    return 0 if all(c["ok"] for c in check_rows) else 1


if __name__ == "__main__":
    sys.exit(main())
