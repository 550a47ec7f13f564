"""Profiling overhead: the same forward with the stage timer on vs off, interleaved in one run.

    python benchmarks/profiler_overhead.py [--device cuda] [--n 4096 16384] [--repeats 15]

Model: 3 layers, dim 128, 2 heads (Fig. 5 size), random weights and token ids, batch 1;
MiTA with m = k ≈ √(N/4). Prints a Markdown table of median ms and the overhead in %.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from mita.model import EncoderClassifier, ModelConfig
from mita.timer import profile_forward
from mita.tools.argtypes import Parser
from profiler.sweep import landmarks_for


def timed(fn, device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3


def main() -> None:
    p = Parser()
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--n", type=int, nargs="+", default=[4096, 16384])
    p.add_argument("--repeats", type=int, default=15)
    a = p.parse_args()
    device, dtype = torch.device(a.device), getattr(torch, a.dtype)
    print(f"device {device}, {a.dtype}, batch 1, depth 3, dim 128, heads 2, "
          f"median of {a.repeats} interleaved pairs, torch {torch.__version__}\n")
    print("| N | variant | m | k | s | timer off ms | timer on ms | overhead |")
    print("|---|---|---|---|---|---|---|---|")
    for n in a.n:
        m, k = landmarks_for(n, "fig5")
        for variant in ("mita", "dense"):
            torch.manual_seed(0)
            cfg = ModelConfig(dim=128, depth=3, num_heads=2, ffn_dim=256, attention=variant,
                              num_landmarks=m, topk=k)
            model = EncoderClassifier(cfg).to(device=device, dtype=dtype).eval()
            ids = torch.randint(1, 16, (1, n), device=device)

            def off(model=model, ids=ids):
                with torch.no_grad():
                    model(ids)

            def on(model=model, ids=ids):
                profile_forward(model, ids)

            off(), on()  # warm-up
            t_off, t_on = [], []
            for _ in range(a.repeats):
                t_off.append(timed(off, device))
                t_on.append(timed(on, device))
            mo, mn = float(np.median(t_off)), float(np.median(t_on))
            mk = (m, k, 1) if variant == "mita" else ("-", "-", "-")
            print(f"| {n} | {variant} | {mk[0]} | {mk[1]} | {mk[2]} | {mo:.2f} | {mn:.2f} | "
                  f"{100 * (mn / mo - 1):+.1f} % |")


if __name__ == "__main__":
    main()
