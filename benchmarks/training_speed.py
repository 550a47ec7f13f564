"""MiTA's training speed against dense attention on the CPU: forward + backward of one attention
layer, the whole model's training step, and peak training memory.

    python benchmarks/training_speed.py [--quick] [--threads 2]

Part 1, one attention layer (``MiTAAttention`` vs ``DenseAttention``: the same qkv and output
projections; dense is ``F.scaled_dot_product_attention`` with its fused backward): dim 64,
2 heads (d = 32), float32, s = 1, input (B, N, 64) with B·N = 32,768 tokens, loss = mean of
the squared output; forward + backward, tokens per second. MiTA with ``backend="auto"`` (the
CPU kernels' forward and backward, ``mita/joint.py``) and ``backend="torch"`` (the PyTorch
stages' forward, the tiled PyTorch backward). N = 512 (m = k = 16 and 128), 2K, 8K, 32K
(m = k = 128).
Part 2, the whole training step of ``EncoderClassifier`` (dim 64, 2 layers, 2 heads, the
shipped model's shape): forward, cross-entropy, backward, AdamW step, random token ids, B·N =
32,768 tokens (N = 512: m = k = 16; 4K and 16K: m = k = 128).
Part 3, peak training memory at N = 16K, batch 1, m = k = 128: one forward + backward in a
fresh process per variant; the peak resident set during it (``VmHWM`` after resetting it
through ``/proc/self/clear_refs``) minus the resident set before it.
Times are medians of interleaved repeats after one warm-up; all in one run.
"""

from __future__ import annotations

import platform
import subprocess
import sys
import time

import numpy as np
import torch

from mita.layers import DenseAttention, MiTAAttention
from mita.model import EncoderClassifier, ModelConfig
from mita.tools.argtypes import Parser

TOKENS = 32_768


def median_times(fns: dict, repeats: int) -> dict[str, float]:
    """Seconds per call of each function: median of ``repeats`` interleaved calls after one
    warm-up each."""
    for f in fns.values():
        f()
    times = {k: [] for k in fns}
    for _ in range(repeats):
        for k, f in fns.items():
            t0 = time.perf_counter()
            f()
            times[k].append(time.perf_counter() - t0)
    return {k: float(np.median(v)) for k, v in times.items()}


def layer_step(layer, x):
    def step():
        layer.zero_grad(set_to_none=True)
        x.grad = None
        layer(x).square().mean().backward()
    return step


def layers(rows, repeats) -> None:
    print("## One attention layer, forward + backward (dim 64, 2 heads, float32, s = 1, "
          f"B·N = {TOKENS:,} tokens)\n")
    print("| N | batch | m = k | dense ms | MiTA ms | MiTA torch-stages ms | dense k tok/s | "
          "MiTA k tok/s | MiTA / dense |")
    print("|---|---|---|---|---|---|---|---|---|")
    for n, m in rows:
        batch = max(1, TOKENS // n)
        cfg = ModelConfig(num_landmarks=m, topk=m)
        torch.manual_seed(n)
        dense = DenseAttention(cfg.replace(attention="dense"))
        mita = MiTAAttention(cfg, backend="auto")
        stages = MiTAAttention(cfg, backend="torch")
        mita.load_state_dict(dense.state_dict())
        stages.load_state_dict(dense.state_dict())
        x = torch.randn(batch, n, 64, requires_grad=True)
        fns = {"dense": layer_step(dense, x), "mita": layer_step(mita, x),
               "stages": layer_step(stages, x)}
        t = median_times(fns, repeats if n < 32_768 else max(2, repeats // 2))
        tok = batch * n
        print(f"| {n:,} | {batch} | {m} | {t['dense'] * 1e3:.0f} | {t['mita'] * 1e3:.0f} | "
              f"{t['stages'] * 1e3:.0f} | {tok / t['dense'] / 1e3:.0f} | "
              f"{tok / t['mita'] / 1e3:.0f} | {t['dense'] / t['mita']:.2f}× |", flush=True)
    print()


def model_step(model, opt, ids, labels):
    def step():
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(model(ids), labels)
        loss.backward()
        opt.step()
    return step


def whole_model(rows, repeats) -> None:
    print("## Whole training step (EncoderClassifier: dim 64, 2 layers, 2 heads; AdamW; "
          f"float32, s = 1, B·N = {TOKENS:,} tokens)\n")
    print("| N | batch | m = k | dense ms | MiTA ms | dense k tok/s | MiTA k tok/s | "
          "MiTA / dense |")
    print("|---|---|---|---|---|---|---|---|")
    for n, m in rows:
        batch = max(1, TOKENS // n)
        cfg = ModelConfig(num_landmarks=m, topk=m, vocab_size=64, num_classes=10)
        fns = {}
        g = torch.Generator().manual_seed(n)
        ids = torch.randint(1, 64, (batch, n), generator=g)
        labels = torch.randint(0, 10, (batch,), generator=g)
        for name in ("dense", "mita"):
            torch.manual_seed(0)
            model = EncoderClassifier(cfg.replace(attention=name))
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            fns[name] = model_step(model, opt, ids, labels)
        t = median_times(fns, repeats)
        tok = batch * n
        print(f"| {n:,} | {batch} | {m} | {t['dense'] * 1e3:.0f} | {t['mita'] * 1e3:.0f} | "
              f"{tok / t['dense'] / 1e3:.0f} | {tok / t['mita'] / 1e3:.0f} | "
              f"{t['dense'] / t['mita']:.2f}× |", flush=True)
    print()


_MEMORY_CHILD = """
import torch
from mita.model import EncoderClassifier, ModelConfig
torch.set_num_threads({threads})
cfg = ModelConfig(num_landmarks=128, topk=128, vocab_size=64, max_len={n}, attention="{name}")
model = EncoderClassifier(cfg)
ids = torch.randint(1, 64, (1, {n}))
labels = torch.zeros(1, dtype=torch.long)
torch.nn.functional.cross_entropy(model(ids[:, :512]), labels).backward()  # warm-up: not counted

def status(field):
    return next(int(line.split()[1]) for line in open("/proc/self/status")
                if line.startswith(field + ":"))

with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # resets the peak resident set (VmHWM) to the current one
before = status("VmRSS")
torch.nn.functional.cross_entropy(model(ids), labels).backward()
print(before, status("VmHWM"))
"""


def memory(n: int, threads: int) -> None:
    print(f"## Peak training memory at N = {n:,} (batch 1, dim 64, 2 layers, m = k = 128; "
          "forward + backward in a fresh process each, after a warm-up step at N = 512)\n")
    print("| attention | resident before the step MiB | peak during the step MiB | "
          "the step's peak increase MiB |")
    print("|---|---|---|---|")
    for name in ("dense", "mita"):
        done = subprocess.run([sys.executable, "-c", _MEMORY_CHILD.format(
            threads=threads, name=name, n=n)], capture_output=True, text=True, check=True)
        before, after = (int(x) / 1024 for x in done.stdout.split())  # /proc reports KiB
        print(f"| {name} | {before:.0f} | {after:.0f} | {after - before:.0f} |", flush=True)
    print()


def main() -> None:
    ap = Parser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="N ≤ 8K, fewer repeats")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                if line.startswith("model name")), platform.processor())
    print(f"CPU: {cpu}; torch {torch.__version__}; {args.threads} threads; "
          f"`python benchmarks/training_speed.py{' --quick' if args.quick else ''}`\n")
    repeats = 3 if args.quick else 5
    rows = [(512, 16), (512, 128), (2048, 128), (8192, 128)]
    layers(rows if args.quick else rows + [(32_768, 128)], repeats)
    whole_model([(512, 16), (4096, 128)] + ([] if args.quick else [(16_384, 128)]), repeats)
    memory(4096 if args.quick else 16_384, args.threads)


if __name__ == "__main__":
    main()
