"""MiTA's training step on one CUDA GPU: the Triton forward + backward against flash attention's.

    PYTHONPATH=. python3 benchmarks/gpu_training.py [--out DIR] [--budget-s 45]   # on the GPU
    python benchmarks/gpu_training.py --smoke                  # CPU dry run, interpreter

1. Check, fresh random inputs: gradients of ``mita_attention(backend="triton")`` (the Triton
   backward, ``mita/kernels/triton_backward.py``) against the tiled PyTorch backward in float64
   on the same GPU, at N = 4096 (smoke: 96), m = k = 64, s = 1 and 2, a key-padding mask,
   float32 (tolerance 5e-6 of each gradient's largest entry, as the interpreter tests) and
   bfloat16 (3e-2); the deterministic backward twice (the same bits) and the atomic one.
2. Time one attention layer's forward + backward, (B, H, N, d) = (1, 2, N, 64), bfloat16,
   s = 1: MiTA at the Fig. 5 setting (m = k = √(N/4)) and at m = k = 64 against
   ``F.scaled_dot_product_attention`` restricted to flash, N = 16K, 64K, 256K, as far as
   ``--budget-s`` allows (CUDA events, median of repeats after a warm-up); peak memory of
   each (``torch.cuda.max_memory_allocated``).

Writes ``gpu_training.md`` (and the same as ``gpu_training.json``) to ``--out`` after each
part. ``--smoke`` runs the same code on the
CPU under ``TRITON_INTERPRET=1`` in float32 at tiny N (``tests/kernels/test_backward_triton.py``
runs it); its timings mean nothing.
"""

from __future__ import annotations

import json
import os
import sys
import time

if "--smoke" in sys.argv:  # the interpreter is chosen when the kernel modules are imported
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from mita import joint  # noqa: E402
from mita.attention import mita_attention  # noqa: E402
from mita.cost import fig5_setting  # noqa: E402
from mita.hooks import NULL_HOOK  # noqa: E402
from mita.tools.argtypes import Parser  # noqa: E402

FIXED = 64  # m = k of the fixed setting


def grads(fn, q, k, v, weight):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = fn(q, k, v)
    return [out.detach(), *torch.autograd.grad((out * weight.to(out.dtype)).sum(), (q, k, v))]


def rel(a, b) -> float:
    return float((a.double() - b).abs().max() / b.abs().max())


def checks_shape(smoke: bool) -> tuple[int, int]:
    """(N, m = k) of the gradient checks."""
    return (96, 8) if smoke else (4096, 64)


def checks(device, smoke: bool) -> list[str]:
    """Part 1: one line per case, the worst relative error of out, dq, dk, dv."""
    n, m = checks_shape(smoke)
    g = torch.Generator(device="cpu").manual_seed(int(time.time()) % 10_000)
    lines = [f"seed {g.initial_seed()}"]
    dtypes = [(torch.float32, 5e-6)] + ([] if smoke else [(torch.bfloat16, 3e-2)])
    for s in (1, 2):
        for dtype, tol in dtypes:
            q, k, v = (torch.randn(2, 2, n, 64, generator=g).to(device, dtype) for _ in range(3))
            mask = torch.zeros(2, n, dtype=torch.bool, device=device)
            mask[1, n - n // 5:] = True
            kw = dict(num_landmarks=m, topk=m, route_topk=s, key_padding_mask=mask)
            weight = torch.randn(2, 2, n, 64, generator=g).to(device)
            want = grads(lambda a, b, c, s=s, mask=mask: joint.mita_attention_grad(
                a, b, c, m, m, s, mask, None, "paper", "tiled", NULL_HOOK),
                q.double(), k.double(), v.double(), weight.double())
            got = grads(lambda a, b, c, kw=kw: mita_attention(a, b, c, backend="triton", **kw),
                        q, k, v, weight)
            again = grads(lambda a, b, c, kw=kw: mita_attention(a, b, c, backend="triton",
                                                                **kw), q, k, v, weight)
            atomic = grads(lambda a, b, c, s=s, mask=mask: joint.mita_attention_grad(
                a, b, c, m, m, s, mask, None, "paper", "triton_atomic", NULL_HOOK),
                q, k, v, weight)
            worst = max(rel(a, w) for a, w in zip(got, want, strict=True))
            worst_atomic = max(rel(a, w) for a, w in zip(atomic, want, strict=True))
            same = all(torch.equal(a, b) for a, b in zip(got, again, strict=True))
            ok = worst < tol and worst_atomic < tol and same
            lines.append(f"{'PASS' if ok else 'FAIL'} {str(dtype)[6:]} N={n} m=k={m} s={s} "
                         f"masked: worst error {worst:.1e} (atomic {worst_atomic:.1e}, "
                         f"tolerance {tol:.0e}); deterministic runs identical: {same}")
    return lines


def cuda_ms(fn, device, repeats: int) -> float:
    """Median milliseconds of ``fn`` (CUDA events on a GPU, wall clock on the CPU)."""
    fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(
                enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[len(times) // 2]


def step_fn(q, k, v, attend):
    def step():
        for t in (q, k, v):
            t.grad = None
        attend(q, k, v).float().square().mean().backward()
    return step


def timing(device, dtype, ns, repeats: int, budget_s: float, start: float,
           smoke: bool = False) -> list[str]:
    """Part 2: Markdown rows, one per (N, setting)."""
    rows = []
    for n in ns:
        if time.monotonic() - start > budget_s:
            rows.append(f"| {n:,} | (skipped: over the {budget_s:.0f} s budget) |||||||")
            continue
        g = torch.Generator(device="cpu").manual_seed(n)
        q, k, v = (torch.randn(1, 2, n, 64, generator=g).to(device, dtype).requires_grad_()
                   for _ in range(3))

        def flash(a, b, c):
            if device.type != "cuda":
                return F.scaled_dot_product_attention(a, b, c)
            with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
                return F.scaled_dot_product_attention(a, b, c)

        dense_ms, dense_mib = measure(step_fn(q, k, v, flash), device, repeats)
        for m, topk in dict.fromkeys([fig5_setting(n)] + ([] if smoke else [(FIXED, FIXED)])):
            mita_ms, mita_mib = measure(step_fn(q, k, v, lambda a, b, c, m=m, t=topk:
                                                mita_attention(a, b, c, num_landmarks=m,
                                                               topk=t, backend="triton")),
                                        device, repeats)
            rows.append(f"| {n:,} | {m} | {topk} | {dense_ms:.2f} | {mita_ms:.2f} | "
                        f"{dense_ms / mita_ms:.2f}× | {dense_mib:.0f} | {mita_mib:.0f} |")
    return rows


def measure(step, device, repeats: int) -> tuple[float, float]:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    ms = cuda_ms(step, device, repeats)
    peak = torch.cuda.max_memory_allocated() / 2**20 if device.type == "cuda" else float("nan")
    return ms, peak


def write(out: str, header: str, check_lines, rows) -> None:
    text = [header, "", "### Gradients of the Triton backward against float64 (tiled PyTorch)",
            "", *[f"- {line}" for line in check_lines], "",
            "### One layer, forward + backward, (1, 2, N, 64), s = 1", "",
            "| N | m | k | flash ms | MiTA ms | flash / MiTA | flash peak MiB | "
            "MiTA peak MiB |", "|---|---|---|---|---|---|---|---|", *rows, ""]
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "gpu_training.md"), "w") as f:
        f.write("\n".join(text))
    with open(os.path.join(out, "gpu_training.json"), "w") as f:
        json.dump({"checks": check_lines, "rows": rows}, f, indent=1)
    print("\n".join(text), flush=True)


def main() -> int:
    p = Parser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="runs/gpu-check")
    p.add_argument("--budget-s", type=float, default=45.0)
    p.add_argument("--smoke", action="store_true", help="CPU dry run at tiny N (interpreter)")
    a = p.parse_args()
    start = time.monotonic()
    if a.smoke:
        device, dtype, ns, repeats = torch.device("cpu"), torch.float32, [128], 1
    else:
        if not torch.cuda.is_available():
            print("no CUDA device: run with --smoke for the CPU dry run", file=sys.stderr)
            return 2
        device, dtype, ns, repeats = torch.device("cuda"), torch.bfloat16, [
            16_384, 65_536, 262_144], 5
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU (smoke)"
    header = f"## MiTA training step on {name} (`benchmarks/gpu_training.py`)"
    check_lines = checks(device, a.smoke)
    write(a.out, header, check_lines, [])
    rows = timing(device, dtype, ns, repeats, float("inf") if a.smoke else a.budget_s, start,
                  a.smoke)
    write(a.out, header, check_lines, rows)
    return 0 if all(not line.startswith("FAIL") for line in check_lines) else 1


if __name__ == "__main__":
    sys.exit(main())
