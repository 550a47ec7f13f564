"""MiTA's exact top-k (eqs. 6-7) on one CUDA GPU: the three paths side by side, per layer.

    PYTHONPATH=. python3 benchmarks/gpu_topk.py [--out DIR]     # on the GPU (~1 min)
    python benchmarks/gpu_topk.py --smoke                       # CPU dry run, interpreter

One layer's landmark top-k at the Fig. 5 shapes (batch 1, 2 heads of d = 64, bfloat16,
m = k = √(N/4)) at N = 16K, 64K, 256K, 1M, each path timed with CUDA events (median of
repeats after a warm-up that compiles the kernels), in one run so the ratios are side by side:

- ``select``: ``mita.kernels.topk.threshold_topk`` (group max, threshold, filter, select,
  fallback: five launches, no m × N scores, no sort of N);
- ``bitonic``: ``mita.kernels.routing.landmark_topk`` (k ≤ 512);
- ``torch``: the scores as one matmul (m × N, float32) and ``mita.stages.topk_tokens``.

Before timing, every path's indices are checked against the ``torch`` path on small-integer
inputs (exact scores, ties at the k-th: the indices must be equal, lowest index first), and
on the timed (normal) inputs each path's indices are compared with ``torch``'s on the
landmarks whose k-th and (k+1)-th scores are more than 1e-3 apart, and the select's overflow
flags are counted. The goal for the top-k
alone at 1M is ≤ 1.5 ms per layer. ``--smoke`` runs the same code under the Triton
interpreter at tiny N so the tests check the script; its timings mean nothing.
"""

from __future__ import annotations

import functools
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

if "--smoke" in sys.argv:  # the interpreter is chosen when the kernel module is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from mita import stages as S  # noqa: E402
from mita.kernels import routing, topk  # noqa: E402
from mita.tools.argtypes import Parser  # noqa: E402

PATHS = ("select", "bitonic", "torch")
NS = [1 << 14, 1 << 16, 1 << 18, 1 << 20]  # on a GPU
EXACT_MAX_N = 1 << 16  # the integer-input exactness check runs at min(N, this)


def m_topk_at(n: int) -> int:
    """m = k = √(N/4) (Fig. 5), at least 4."""
    return max(4, int(round((n / 4) ** 0.5)))


def run_path(name: str, landmarks, k, m_topk: int):
    """One path's ``(B, H, m, k)`` indices; ValueError where the path does not take k."""
    scale = k.shape[-1] ** -0.5
    if name == "select":
        return topk.threshold_topk(landmarks, k, m_topk, scale)
    if name == "bitonic":
        return routing.landmark_topk(landmarks, k, m_topk, scale)
    return S.topk_tokens(S.landmark_scores(landmarks, k.float()), m_topk)


def time_ms(fn, device, repeats: int) -> float:
    """Median milliseconds of ``fn()`` (CUDA events on a GPU after a warm-up call that
    compiles; the host clock on the CPU, no warm-up: the interpreter compiles nothing)."""
    if device.type == "cuda":
        fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            import time
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return float(np.median(times))


def check_exact(device, dtype, n: int, m_topk: int) -> dict[str, bool | str]:
    """Each path vs ``torch`` on integer inputs (d = 16: exact scores, ties everywhere)."""
    g = torch.Generator().manual_seed(n)
    k = torch.randint(-2, 3, (1, 2, n, 16), generator=g).to(device, dtype)
    landmarks = torch.randint(-2, 3, (1, 2, m_topk, 16), generator=g).float().to(device)
    want = run_path("torch", landmarks, k, m_topk)
    out = {}
    for name in PATHS[:2]:
        try:
            out[name] = bool(torch.equal(run_path(name, landmarks, k, m_topk), want))
        except ValueError as e:
            out[name] = f"n/a ({e})"
    return out


def clear_rows_equal(landmarks, k, m_topk: int) -> dict[str, float]:
    """On the timed (normal) inputs: the share of landmarks whose k-th and (k+1)-th float32
    scores differ by more than 1e-3 (far above the paths' last-bit differences) on which each
    Triton path's indices equal the torch path's (1.0 = all)."""
    scores = S.landmark_scores(landmarks.to(k.dtype).float(), k.float())
    top = scores.topk(min(m_topk + 1, k.shape[2]), dim=-1).values
    clear = (top[..., m_topk - 1] - top[..., -1]) > 1e-3
    del scores, top
    want = run_path("torch", landmarks, k, m_topk)
    out = {}
    for name in PATHS[:2]:
        try:
            same = (run_path(name, landmarks, k, m_topk) == want).all(-1)
        except ValueError:
            continue
        out[name] = float(same[clear].float().mean()) if clear.any() else 1.0
    return out


def main() -> int:
    p = Parser(description=__doc__.split("\n")[0])
    p.add_argument("--smoke", action="store_true", help="CPU dry run at tiny N (interpreter)")
    p.add_argument("--out", default=os.environ.get("OUT"), help="folder for the table")
    a = p.parse_args()
    if a.smoke:
        device, dtype, ns, repeats = torch.device("cpu"), torch.float32, [128], 1
    else:
        if not torch.cuda.is_available():
            print("no CUDA device: run with --smoke for the CPU dry run", file=sys.stderr)
            return 2
        device, dtype, ns, repeats = torch.device("cuda"), torch.bfloat16, NS, 10
    rows, ok = [], True
    for n in ns:
        m_topk = m_topk_at(n)
        exact = check_exact(device, dtype, min(n, EXACT_MAX_N), m_topk)
        ok &= all(v is True or str(v).startswith("n/a") for v in exact.values())
        g = torch.Generator().manual_seed(n + 1)
        k = torch.randn(1, 2, n, 64, generator=g).to(device, dtype)
        landmarks = torch.randn(1, 2, m_topk, 64, generator=g).to(device)
        row = {"N": n, "m": m_topk, "k": m_topk, "batch": 1, "heads": 2, "d": 64,
               "dtype": str(dtype).replace("torch.", ""), "exact_vs_torch": exact}
        for name in PATHS:
            try:
                row[f"{name}_ms"] = time_ms(functools.partial(run_path, name, landmarks, k,
                                                              m_topk), device, repeats)
            except ValueError as e:
                row[f"{name}_ms"] = None
                print(f"{name} at N = {n}: {e}")
        row["clear_rows_equal"] = clear_rows_equal(landmarks, k, m_topk)
        ok &= all(v == 1.0 for v in row["clear_rows_equal"].values())
        launches, _ = topk.threshold_topk_plans(landmarks, k, m_topk, 64 ** -0.5)
        topk.run_launches(launches)
        row["select_overflow_landmarks"] = int(topk.overflow_flags(launches).sum())
        rows.append(row)
        print(json.dumps(row), flush=True)
    lines = ["| N | m = k | select ms | bitonic ms | torch ms | torch / select | exact (select, "
             "bitonic) |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        ms = [r[f"{p}_ms"] for p in PATHS]
        ratio = f"{ms[2] / ms[0]:.2f}×" if ms[0] and ms[2] else "–"
        lines.append(f"| {r['N']:,} | {r['m']} | " + " | ".join(
            f"{v:.3f}" if v is not None else "–" for v in ms)
            + f" | {ratio} | {r['exact_vs_torch']['select']}, {r['exact_vs_torch']['bitonic']} |")
    device_name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu (interpreter)"
    table = (f"Top-k per layer, {device_name}, batch 1, 2 heads, d 64, {rows[0]['dtype']}, "
             f"median of {repeats}\n\n" + "\n".join(lines))
    print("\n" + table)
    if a.out:
        Path(a.out).mkdir(parents=True, exist_ok=True)
        Path(a.out, "gpu_topk.md").write_text(table + "\n")
        Path(a.out, "gpu_topk.json").write_text(json.dumps(rows, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
