"""MiTA on the Triton kernels vs dense SDPA (flash) on one CUDA GPU: check, then time.

    PYTHONPATH=. python3 benchmarks/gpu_mita.py [--out DIR]        # on the GPU (≤ 6 min)
    python benchmarks/gpu_mita.py --smoke                          # CPU dry run, interpreter

One prepared script for a short GPU lease (it must finish within 6 minutes on one H200):

1. Correctness, fresh random inputs (seed printed):
   a. The whole fused path, ``mita_attention(backend="triton")`` (``routing.landmark_topk``,
      SDPA shared values, ``routing.route_shared``, ``fused_attention``), vs the float64
      PyTorch stages given the fused path's routing decisions (16-bit scores may route a
      near-tie differently from float64; the decisions are checked exactly in b), for
      float32 / bfloat16 / float16, s = 1, 2, 3, d = 32, 64, 128, masks, N < m, k = 300.
      Tolerances as in ``tests/kernels/test_kernels.py``: 1e-5 / 1.5e-2 / 2e-3 relative to the
      largest output. The error against the float64 loop reference (``mita/reference.py``)
      is reported beside it.
   b. The routing kernels vs the PyTorch stages on small-integer inputs (exact scores, ties
      everywhere): the bitonic top-k's and the threshold select's indices equal (lowest-index
      ties) up to k = 512, N = 20000; route's experts equal, the shared half within the
      dtype's tolerance.
   c. The fused path (float32, IEEE products) vs the PyTorch path in float64 on the GPU at
      N = 8192, m = k = 64, s = 1 and 2, masked: 1e-5.
   d. The 3-layer bfloat16 model at N = 16K: fused vs unfused (``backend="torch"``) logits.
2. Attention only, one layer (1, 2, N, 64), s = 1, at N = 16K, 64K, 256K, 1M: MiTA at the
   Fig. 5 (m, k) and at a fixed m = k = 64 vs flash SDPA; MiTA's stages from one profiled
   call; and the stock-op floor of the routing stages (pool as one mean, scores as one matmul,
   ``torch.topk`` over them, flash SDPA with the landmarks as queries, matmul + argmax).
3. Whole model: the Fig. 5 setting — 3 layers, dim 128, 2 heads (d = 64), FFN 256, batch 1,
   bfloat16, m = k = √(N/4) (m·k = N/4), s = 1, random weights and token ids — at N = 16K,
   64K, 256K, 1M. Forward (no grad) timed with CUDA events (``mita.timer.StageTimer``), median
   of repeats after a warm-up (which compiles the kernels and times the top-k paths: the
   table names the one chosen); at N ≤ 64K also replayed from a CUDA graph
   (``service.graphs.cuda_capture``, as the service does), with the ratio; dense with
   ``F.scaled_dot_product_attention`` restricted to the flash backend. Prints the ratio next
   to the paper's Fig. 5 ratio (RTX 4090: 4.7×, 19×, 56×, 159×) and the pair-count limit
   N/(2m + sk); peak memory per forward (``torch.cuda.max_memory_allocated``). Then one
   profiled MiTA forward per N: milliseconds per stage (fused: ``landmark_scores`` includes
   top-k, ``route`` the shared half, ``attention`` the gather; the unfused PyTorch path at
   16K for comparison).

``--smoke`` runs the same code on the CPU at tiny N with ``TRITON_INTERPRET=1`` and float32,
so CI checks the script itself (``tests/kernels/test_kernels.py``); its timings mean nothing.
"""

from __future__ import annotations

import json
import os
import sys
import time
from contextlib import nullcontext
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # mita, profiler and benchmarks.gpu_mita_checks without an install

if "--smoke" in sys.argv:  # the interpreter is chosen when the kernel module is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from benchmarks.gpu_mita_checks import (  # noqa: E402
    TOL,
    check_reference,
    check_routing,
    check_torch_path,
    rand_inputs,
    rel_err,
)
from mita import attention as A  # noqa: E402
from mita.cost import fig5_setting  # noqa: E402
from mita.hooks import NULL_HOOK  # noqa: E402
from mita.kernels import choose  # noqa: E402
from mita.model import EncoderClassifier, ModelConfig, set_mita_backend  # noqa: E402
from mita.timer import StageTimer  # noqa: E402
from mita.tools.argtypes import Parser  # noqa: E402

PAPER_FIG5 = {16384: 4.7, 65536: 19.0, 262144: 56.0, 1 << 20: 159.0}
GRAPH_MAX_N = 65536  # whole forwards also replayed from a CUDA graph up to this N
SPEED_NS = [16384, 65536, 262144, 1 << 20]  # the speed rows on a GPU
FIXED_SETTING = (64, 64)  # the one-layer rows' second (m, k), beside Fig. 5's


def build(n: int, attention: str, device, dtype) -> EncoderClassifier:
    m, k = fig5_setting(n)
    torch.manual_seed(0)  # same weights for both variants
    cfg = ModelConfig(dim=128, depth=3, num_heads=2, ffn_dim=256, attention=attention,
                      num_landmarks=m, topk=k, max_len=max(n, 1 << 20))
    return EncoderClassifier(cfg).to(device, dtype).eval()


def check_model(device, dtype, gen, smoke: bool) -> dict:
    n = 128 if smoke else 16384
    model = build(n, "mita", device, dtype)
    ids = torch.randint(1, 16, (1, n), generator=gen).to(device)
    set_mita_backend(model, "triton")
    fused = model(ids)
    set_mita_backend(model, "torch")
    unfused = model(ids)
    err = rel_err(fused, unfused)
    return {"check": "3-layer model logits, fused vs unfused", "dtype": str(dtype),
            "shape": f"N{n}", "rel_err": err, "tol": TOL[dtype], "ok": err < TOL[dtype]}


def flash_only(device):
    if device.type != "cuda":
        return nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel
    return sdpa_kernel([SDPBackend.FLASH_ATTENTION])


def time_forward(model, ids, device, repeats: int) -> tuple[float, int | None, list[float]]:
    """Median forward ms (CUDA events on GPU), peak bytes of the last forward, all times."""
    times, peak = [], None
    for _ in range(repeats):
        timer = StageTimer(device)
        with timer.forward():
            model(ids)
        result = timer.result()
        times.append(result.total_ms)
        peak = result.peak_memory_bytes
    return float(np.median(times)), peak, times


def graph_ms(model, ids, repeats: int) -> float:
    """Median ms of one forward replayed from a CUDA graph (``service.graphs.cuda_capture``,
    as the service replays short sequences), CUDA events around each replay."""
    from service.graphs import cuda_capture

    captured = cuda_capture(model, ids, None)
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        captured.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return float(np.median(times))


def stage_breakdown(model, ids, device) -> dict[str, float]:
    timer = StageTimer(device)
    with timer.forward():
        model(ids, hook=timer)
    return {k: round(v, 3) for k, v in timer.result().stages_ms.items()}


def speed(device, dtype, ns, repeats: int, budget_s: float, start: float,
          unfused_at: int | None = None) -> tuple[list[dict], list[dict]]:
    rows, stages = [], []
    for n in ns:
        m, k = fig5_setting(n)
        gen = torch.Generator().manual_seed(n)
        ids = torch.randint(1, 16, (1, n), generator=gen).to(device)
        mita = build(n, "mita", device, dtype)
        set_mita_backend(mita, "triton")
        dense = build(n, "dense", device, dtype)
        row = {"N": n, "m": m, "k": k, "s": 1, "batch": 1, "dtype": str(dtype),
               "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu"}
        with torch.no_grad():
            choose.CHOOSER.take_served()
            mita(ids)  # warm-up: Triton compile, cuBLAS handles, the top-k path chosen
            row["topk_path"] = choose.CHOOSER.take_served()
            row["mita_ms"], row["mita_peak_bytes"], row["mita_all_ms"] = time_forward(
                mita, ids, device, repeats)
            if device.type == "cuda" and n <= GRAPH_MAX_N:
                row["mita_graph_ms"] = graph_ms(mita, ids, repeats)
            left = budget_s - (time.perf_counter() - start)
            with flash_only(device):
                t0 = time.perf_counter()
                dense(ids)  # warm-up, and a guess at one forward's cost
                one = time.perf_counter() - t0
                reps = max(1, min(repeats, int((left - 30) / max(one, 1e-3) / 2)))
                if left - 30 > one:
                    row["dense_ms"], row["dense_peak_bytes"], row["dense_all_ms"] = (
                        time_forward(dense, ids, device, reps))
                    if device.type == "cuda" and n <= GRAPH_MAX_N:
                        row["dense_graph_ms"] = graph_ms(dense, ids, reps)
            stages.append({"N": n, "backend": "triton (fused)",
                           **stage_breakdown(mita, ids, device)})
            if n == unfused_at:
                set_mita_backend(mita, "torch")
                mita(ids)
                stages.append({"N": n, "backend": "torch (unfused)",
                               **stage_breakdown(mita, ids, device)})
        rows.append(row)
        del mita, dense
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows, stages


def cuda_ms(fn, device, repeats: int) -> float:
    """Median milliseconds of ``fn()`` (CUDA events on GPU, host clock on CPU) after one
    warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        timer = StageTimer(device)
        with timer.forward():
            fn()
        times.append(timer.result().total_ms)
    return float(np.median(times))


def stock_floor(q, k, v, m, topk, device, repeats: int) -> dict[str, float]:
    """The routing stages as stock PyTorch ops on the same (1, H, N, d) inputs — the floor
    the kernels should beat: pool as one mean,
    landmark scores as one matmul in the input dtype, ``torch.topk`` over those scores, the
    shared values as flash SDPA with the landmarks as queries, route as matmul + argmax."""
    B, H, N, d = q.shape
    lm = q.view(B, H, m, N // m, d).mean(3)
    scores = lm @ k.transpose(-1, -2)
    with flash_only(device):
        floor = {"pool": cuda_ms(lambda: q.view(B, H, m, N // m, d).mean(3), device, repeats),
                 "landmark_scores": cuda_ms(lambda: lm @ k.transpose(-1, -2), device, repeats),
                 "topk": cuda_ms(lambda: scores.topk(topk, dim=-1), device, repeats),
                 "shared_compress": cuda_ms(
                     lambda: torch.nn.functional.scaled_dot_product_attention(lm, k, v),
                     device, repeats),
                 "route": cuda_ms(lambda: (q @ lm.transpose(-1, -2)).argmax(-1), device,
                                  repeats)}
    return floor  # scores (m × N) freed on return


def attention_only(device, dtype, ns, repeats: int, smoke: bool) -> list[dict]:
    """One attention layer, (1, 2, N, 64): MiTA (fused path) at the Fig. 5 (m, k) and at a
    fixed m = k = 64, flash SDPA, the stock-op floor of MiTA's routing stages, and MiTA's
    stages from one profiled call."""
    rows = []
    for n in ns:
        rows += attention_rows_at(n, device, dtype, repeats, smoke)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def attention_rows_at(n, device, dtype, repeats: int, smoke: bool) -> list[dict]:
    gen = torch.Generator().manual_seed(n + 1)
    q, k, v = rand_inputs((1, 2, n, 64), gen, device, dtype)
    with flash_only(device):
        dense = cuda_ms(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v),
                        device, 1 if n > 300000 else repeats)
    rows = []
    for m, topk in [fig5_setting(n)] + ([] if smoke else [FIXED_SETTING]):
        def run(hook=NULL_HOOK, m=m, topk=topk):
            return A.mita_attention(q, k, v, num_landmarks=m, topk=topk, backend="triton",
                                    hook=hook)
        row = {"N": n, "m": m, "k": topk, "s": 1, "batch": 1, "heads": 2, "d": 64,
               "dtype": str(dtype), "mita_ms": cuda_ms(run, device, repeats),
               "dense_ms": dense}
        timer = StageTimer(device)
        with timer.forward():
            run(timer)
        row["stages"] = {st: round(ms, 3) for st, ms in timer.result().stages_ms.items()}
        if (m, topk) == fig5_setting(n):
            row["floor"] = stock_floor(q, k, v, m, topk, device, repeats)
        rows.append(row)
    return rows


def attention_markdown(rows) -> list[str]:
    out = ["", "### Attention only: one layer, (1, 2, N, 64), s = 1", "",
           "| N | m | k | dtype | MiTA ms | flash ms | flash / MiTA | MiTA stages (ms) | "
           "stock-op floor of the routing stages (ms) |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        stages = ", ".join(f"{k} {v:.2f}" for k, v in r["stages"].items())
        floor = ", ".join(f"{k} {v:.2f}" for k, v in r.get("floor", {}).items()) or "-"
        out.append(f"| {r['N']} | {r['m']} | {r['k']} | {r['dtype'].replace('torch.', '')} | "
                   f"{r['mita_ms']:.2f} | {r['dense_ms']:.2f} | "
                   f"{r['dense_ms'] / r['mita_ms']:.1f}× | {stages} | {floor} |")
    return out


def markdown(checks, rows, stages, header: str, attention_rows=()) -> str:
    out = [header, "", "### Correctness", "",
           "| check | dtype | shape | rel. error | tolerance | ok |", "|---|---|---|---|---|---|"]
    for c in checks:
        out.append(f"| {c['check']} | {c['dtype'].replace('torch.', '')} | {c['shape']} | "
                   f"{c['rel_err']:.2e} | {c['tol']:.1e} | {'yes' if c['ok'] else 'NO'} |")
    out += ["", "### Speed: 3 layers, dim 128, 2 heads, batch 1, m·k = N/4, s = 1", "",
            "| N | m | k | dtype | top-k path | MiTA ms | dense (flash) ms | dense / MiTA | "
            "paper Fig. 5 | limit N/(2m+sk) | MiTA peak GiB | dense peak GiB | MiTA graph ms | "
            "dense graph ms | graph ratio |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    gib = 2 ** 30
    for r in rows:
        dense = r.get("dense_ms")
        ratio = f"{dense / r['mita_ms']:.1f}×" if dense else "not run (time budget)"
        paper = f"{PAPER_FIG5[r['N']]}×" if r["N"] in PAPER_FIG5 else "-"
        mp = f"{r['mita_peak_bytes'] / gib:.2f}" if r.get("mita_peak_bytes") else "-"
        dp = f"{r['dense_peak_bytes'] / gib:.2f}" if r.get("dense_peak_bytes") else "-"
        mg, dg = r.get("mita_graph_ms"), r.get("dense_graph_ms")
        graphs = (f"{mg:.2f} | {dg:.2f} | {dg / mg:.1f}×" if mg and dg
                  else f"{f'{mg:.2f}' if mg else '-'} | - | -")
        out.append(f"| {r['N']} | {r['m']} | {r['k']} | {r['dtype'].replace('torch.', '')} | "
                   f"{r.get('topk_path') or '-'} | "
                   f"{r['mita_ms']:.2f} | {f'{dense:.2f}' if dense else '-'} | {ratio} | "
                   f"{paper} | {r['N'] / (2 * r['m'] + r['k']):.0f}× | {mp} | {dp} | {graphs} |")
    names = []
    for st in stages:
        names += [k for k in st if k not in ("N", "backend") and k not in names]
    out += ["", "### MiTA forward by stage (ms, summed over 3 layers; one profiled forward)", "",
            "| N | backend | " + " | ".join(names) + " |", "|---|---|" + "---|" * len(names)]
    for st in stages:
        out.append(f"| {st['N']} | {st['backend']} | "
                   + " | ".join(f"{st[k]:.2f}" if k in st else "-" for k in names) + " |")
    out += attention_markdown(attention_rows)
    return "\n".join(out)


def main() -> int:
    p = Parser(description=__doc__.split("\n")[0])
    p.add_argument("--smoke", action="store_true", help="CPU dry run at tiny N (interpreter)")
    p.add_argument("--out", default=os.environ.get("OUT"), help="folder for the JSON and table")
    p.add_argument("--budget-s", type=float, default=420.0,
                   help="stop starting dense runs when this much wall time is used")
    a = p.parse_args()
    start = time.perf_counter()
    if a.smoke:
        device, dtype, ns, repeats = torch.device("cpu"), torch.float32, [128], 1
    else:
        if not torch.cuda.is_available():
            print("no CUDA device: run with --smoke for the CPU dry run", file=sys.stderr)
            return 2
        device, dtype, repeats = torch.device("cuda"), torch.bfloat16, 5
        ns = SPEED_NS
    import triton
    seed = int.from_bytes(os.urandom(4), "little")
    gen = torch.Generator().manual_seed(seed)
    header = (f"torch {torch.__version__}, triton {triton.__version__}, device "
              f"{torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu (interpreter)'}"
              f", random seed {seed}")
    print(header, flush=True)
    checks, rows, stages, attention_rows = [], [], [], []

    def save(done: str) -> None:  # each table the moment it exists: a killed run keeps them
        table = markdown(checks, rows, stages, header, attention_rows)
        print(f"\n[{done}, {time.perf_counter() - start:.0f} s]\n{table}", flush=True)
        if a.out:
            Path(a.out).mkdir(parents=True, exist_ok=True)
            Path(a.out, "gpu_mita.md").write_text(table + "\n")
            Path(a.out, "gpu_mita.json").write_text(json.dumps(
                {"header": header, "checks": checks, "speed": rows, "stages": stages,
                 "attention_only": attention_rows}, indent=1))

    # correctness first (its compiles are in Triton's cache from gpu_compiles.py --warm), then
    # the whole model (the headline), then one layer; each table saved the moment it exists
    with torch.no_grad():
        checks += (check_reference(device, gen, a.smoke) + check_routing(device, gen, a.smoke)
                   + check_torch_path(device, gen, a.smoke))
        checks.append(check_model(device, dtype, gen, a.smoke))
    for c in checks:
        print(f"{'ok ' if c['ok'] else 'BAD'} {c['check']} {c['dtype']} {c['shape']}: "
              f"{c['rel_err']:.2e} (tol {c['tol']:.1e})", flush=True)
    save("checks")
    for n in ns:
        r, st = speed(device, dtype, [n], repeats, a.budget_s, start, unfused_at=ns[0])
        rows += r
        stages += st
        save(f"whole model at N = {n}")
    with torch.no_grad():
        attention_rows += attention_only(device, dtype, ns, repeats, a.smoke)
    save("attention only")
    print(f"\nwall time {time.perf_counter() - start:.0f} s")
    return 0 if all(c["ok"] for c in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
