"""MiTA on CPU vs dense SDPA: attention-only and whole-model, with the pair-count limit.

    python benchmarks/cpu_mita.py [--quick]

Part 1, attention only: q, k, v of shape (1, 2, N, 64) float32, random; MiTA
(``mita_attention``: the compiled CPU kernels, ``backend="cpu"``, and the PyTorch stages,
``backend="torch"``) vs ``F.scaled_dot_product_attention``, at N = 4K, 16K, 64K, for m·k ≈ N/4
(m = k ≈ √(N/4)) and a fixed m = k = 64; s = 1. Time ratio SDPA / MiTA (kernels) next to the
pair-count limit N/(2m+sk). MiTA alone at 256K and 1M, and the growth exponent of MiTA time vs
N (log-log fit).
Part 2, whole model (``backend="auto"``: the CPU kernels under ``torch.no_grad``): 3 layers,
dim 128, 2 heads (Fig. 5 size), random weights and token ids, at
N = 4K, 16K, 64K for both variants (dense 64K included: one repeat), MiTA alone at 256K; then
MiTA at N = 1M in a fresh subprocess, reporting its time and peak RSS.
Times are medians of interleaved repeats after one warm-up.
"""

from __future__ import annotations

import argparse
import resource
import subprocess
import sys
import time
from functools import partial

import numpy as np
import torch
import torch.nn.functional as F

from mita import mita_attention
from mita.cost import fig5_setting
from mita.model import EncoderClassifier, ModelConfig
from mita.tools.argtypes import Parser


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def median_times(fns: dict, repeats: int) -> dict[str, float]:
    for f in fns.values():
        f()  # warm-up
    times = {k: [] for k in fns}
    for _ in range(repeats):
        for k, f in fns.items():
            times[k].append(timed(f))
    return {k: float(np.median(v)) for k, v in times.items()}


def attention_only(ns, big_ns, repeats) -> None:
    print("## Attention only: (B, H, N, d) = (1, 2, N, 64), float32, s = 1\n")
    print("| N | setting | m | k | MiTA ms | MiTA torch-stages ms | SDPA ms | SDPA / MiTA | "
          "limit N/(2m+sk) | ratio / limit |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    growth: dict[str, list[tuple[int, float]]] = {}
    for n in ns + big_ns:
        g = torch.Generator().manual_seed(n)
        q, k, v = (torch.randn(1, 2, n, 64, generator=g) for _ in range(3))
        for setting, (m, topk) in (("m·k≈N/4", fig5_setting(n)), ("fixed", (64, 64))):
            fns = {"mita": partial(mita_attention, q, k, v, num_landmarks=m, topk=topk,
                                   backend="cpu")}
            if n in ns:
                fns["torch"] = partial(mita_attention, q, k, v, num_landmarks=m, topk=topk,
                                       backend="torch")
                fns["sdpa"] = partial(F.scaled_dot_product_attention, q, k, v)
            t = median_times(fns, repeats if n <= 65536 else 1)
            limit = n / (2 * m + topk)
            growth.setdefault(setting, []).append((n, t["mita"]))
            if "sdpa" in t:
                r = t["sdpa"] / t["mita"]
                print(f"| {n} | {setting} | {m} | {topk} | {1e3 * t['mita']:.1f} | "
                      f"{1e3 * t['torch']:.1f} | {1e3 * t['sdpa']:.1f} | {r:.1f}× | "
                      f"{limit:.1f}× | {r / limit:.2f} |")
            else:
                print(f"| {n} | {setting} | {m} | {topk} | {1e3 * t['mita']:.1f} | - | - | - | "
                      f"{limit:.1f}× | - |")
    print()
    for setting, pts in growth.items():
        x, y = np.log([p[0] for p in pts]), np.log([p[1] for p in pts])
        slope = np.polyfit(x, y, 1)[0]
        print(f"MiTA time ∝ N^{slope:.2f} for {setting} (N = {pts[0][0]} … {pts[-1][0]})")
    print()


def model(n: int, attention: str, m: int, k: int) -> tuple[EncoderClassifier, torch.Tensor]:
    torch.manual_seed(0)
    cfg = ModelConfig(dim=128, depth=3, num_heads=2, ffn_dim=256, attention=attention,
                      num_landmarks=m, topk=k)
    ids = torch.randint(1, 16, (1, n), generator=torch.Generator().manual_seed(n))
    return EncoderClassifier(cfg).eval(), ids


def whole_model(ns, big_ns, repeats) -> None:
    print("## Whole model: 3 layers, dim 128, 2 heads, m·k ≈ N/4, s = 1, batch 1, float32\n")
    print("| N | m | k | MiTA ms | dense ms | dense / MiTA | limit N/(2m+sk) |")
    print("|---|---|---|---|---|---|---|")
    for n in ns + big_ns:
        m, k = fig5_setting(n)
        mita, ids = model(n, "mita", m, k)
        fns = {"mita": lambda mita=mita, ids=ids: mita(ids)}
        if n in ns:
            dense, _ = model(n, "dense", m, k)
            fns["dense"] = lambda dense=dense, ids=ids: dense(ids)
        with torch.no_grad():
            t = median_times(fns, repeats if n < 65536 else 1)
        dense_ms = f"{1e3 * t['dense']:.0f}" if "dense" in t else "-"
        ratio = f"{t['dense'] / t['mita']:.1f}×" if "dense" in t else "-"
        print(f"| {n} | {m} | {k} | {1e3 * t['mita']:.0f} | {dense_ms} | {ratio} | "
              f"{n / (2 * m + k):.1f}× |")
    print()


def one_million() -> None:
    n = 1 << 20
    m, k = fig5_setting(n)
    mita, ids = model(n, "mita", m, k)
    with torch.no_grad():
        seconds = timed(lambda: mita(ids))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(f"| {n} | {m} | {k} | {seconds:.1f} s | {peak / 2**30:.2f} GiB |")


def main() -> None:
    p = Parser()
    p.add_argument("--quick", action="store_true", help="4K and 16K only, no 256K/1M")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--one-million", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.one_million:
        one_million()
        return
    torch.manual_seed(0)
    from mita.kernels import cpu

    if cpu.load() is None:
        raise SystemExit("the CPU kernels did not build here (see the log above)")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, cpu, "
          f"CPU capability {torch.backends.cpu.get_cpu_capability()}\n")
    ns = [4096, 16384] if a.quick else [4096, 16384, 65536]
    big = [] if a.quick else [262144, 1 << 20]
    with torch.no_grad():
        attention_only(ns, big, a.repeats)
    whole_model(ns, [] if a.quick else [262144], a.repeats)
    if not a.quick:
        print("## Whole model at N = 1M (MiTA only, fresh process)\n")
        print("| N | m | k | forward | peak RSS of the process |")
        print("|---|---|---|---|---|")
        sys.stdout.flush()
        subprocess.run([sys.executable, __file__, "--one-million"], check=True)


if __name__ == "__main__":
    main()
