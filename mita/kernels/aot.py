"""Ahead-of-time compilation of the Triton MiTA kernels for NVIDIA GPUs, on any machine.

The CPU interpreter (``TRITON_INTERPRET=1``) runs a kernel's Python, not its compilation: it
accepted a plain module global inside ``@triton.jit`` that the GPU compiler rejects, so every MiTA
request on a GPU host failed. This module compiles each kernel the way a GPU launch does — the
launcher's own arguments (``launch_plan``, ``routing.*_plan``) through Triton's launch-time
specialisation (argument types, ``== 1`` integers, 16-byte alignment) to ttir → ttgir → llir → ptx →
cubin — for a chosen ``GPUTarget``, without a GPU (Triton ships ``ptxas``).

    python -m mita.kernels.aot            # every specialisation, sm_80 and sm_90

``tests/test_kernel_compile.py`` runs it in ``make test``.
"""

from __future__ import annotations

import itertools
import os
import sys
from dataclasses import dataclass

import torch

CAPABILITIES = (80, 90)  # A100, H100/H200
# Largest dynamic shared memory one block may use (CUDA programming guide, "Compute
# Capabilities"): 163 KB on sm_80, 227 KB on sm_90. A kernel over it compiles but fails to launch.
MAX_SHARED_BYTES = {80: 163 * 1024, 90: 227 * 1024}


KERNELS = ("attention", "landmark_topk", "route_shared", "pool", "tile_table", "groupmax",
           "filter", "select", "bisect")
# threshold_topk's launches by case name (the second, torch.topk, is no Triton kernel)
SELECT_LAUNCH = {"groupmax": 0, "filter": 2, "select": 3, "bisect": 4}


@dataclass(frozen=True)
class Case:
    """One launcher choice of one kernel. ``attention`` (``_mita_fused_kernel``): dtype,
    s = 1 or not, mask or not, BLOCK_D from the head dim. ``landmark_topk``: dtype, BLOCK_D,
    K_PAD from ``topk``. ``route_shared``: dtype, BLOCK_D. ``pool`` (``pooling._pool_kernel``):
    dtype, BLOCK_D, mask or not. ``tile_table`` (``_tile_table_kernel``, no float inputs: its
    dtype is the attention case's it is planned with): s = 1 or not, mask or not."""

    kernel: str
    dtype: str  # "float16" | "bfloat16" | "float32"
    d: int
    s: int = 1
    masked: bool = False
    topk: int = 0

    def __str__(self):
        if self.kernel == "attention":
            return (f"attention-{self.dtype}-s{self.s}-{'mask' if self.masked else 'nomask'}"
                    f"-d{self.d}")
        if self.kernel == "landmark_topk":
            return f"landmark_topk-{self.dtype}-d{self.d}-k{self.topk}"
        if self.kernel == "pool":
            return f"pool-{self.dtype}-{'mask' if self.masked else 'nomask'}-d{self.d}"
        if self.kernel == "tile_table":
            return f"tile_table-s{self.s}-{'mask' if self.masked else 'nomask'}"
        if self.kernel == "select":
            return f"select-k{self.topk}"
        if self.kernel in SELECT_LAUNCH:
            return f"{self.kernel}-{self.dtype}-d{self.d}"
        return f"route_shared-{self.dtype}-d{self.d}"


DTYPE_NAMES = ("float16", "bfloat16", "float32")


def cases() -> list[Case]:
    """Every specialisation the launchers can choose on CUDA. ``attention``: 3 dtypes ×
    (s = 1, s > 1) × (mask, none) × BLOCK_D ∈ {16, 32, 64, 128} (head dims 8, 32, 48, 128
    reach each one) = 48. ``landmark_topk``: 3 dtypes × BLOCK_D ∈ {64, 128} (d 48, 128) ×
    K_PAD ∈ {64, 128, 256, 512} (k 40, 100, 200, 512) = 24. ``route_shared``: 3 dtypes ×
    BLOCK_D ∈ {16, 32, 64, 128} = 12. ``pool``: 3 dtypes × BLOCK_D ∈ {64, 128} (d 48, 128) ×
    (mask, none) = 12. ``tile_table``: (s = 1, s > 1) × (mask, none) = 4. The threshold
    select (``topk.threshold_topk``): ``groupmax``, ``filter`` and ``bisect`` 3 dtypes ×
    BLOCK_D ∈ {64, 128} = 6 each; ``select`` (no float inputs) CAP ∈ {128 … 4096} (k 40, 100,
    200, 512, 600, 2048) = 6."""
    out = [Case("attention", dt, d, s, masked) for dt, s, masked, d in itertools.product(
        DTYPE_NAMES, (1, 3), (False, True), (8, 32, 48, 128))]
    out += [Case("landmark_topk", dt, d, topk=topk) for dt, d, topk in itertools.product(
        DTYPE_NAMES, (48, 128), (40, 100, 200, 512))]
    out += [Case("route_shared", dt, d) for dt, d in itertools.product(
        DTYPE_NAMES, (8, 32, 48, 128))]
    out += [Case("pool", dt, d, masked=masked) for dt, d, masked in itertools.product(
        DTYPE_NAMES, (48, 128), (False, True))]
    out += [Case("tile_table", "float32", 32, s, masked) for s, masked in itertools.product(
        (1, 3), (False, True))]
    out += [Case(kernel, dt, d, topk=8) for kernel, dt, d in itertools.product(
        ("groupmax", "filter", "bisect"), DTYPE_NAMES, (48, 128))]
    out += [Case("select", "float32", 32, topk=topk) for topk in (40, 100, 200, 512, 600, 2048)]
    return out


def example_plan(case: Case) -> tuple:
    """The kernel of ``case`` and its launcher's ``(args, meta)`` on small CPU tensors
    (B = 2, H = 2, N = 600, m = 6, k = 8 unless the case sets k), planned as for CUDA
    (``interpreter=False``): the same arguments and constexprs a CUDA launch of that case
    passes. Returns ``(kernel, args, meta)``."""
    from . import pooling, routing
    from . import topk as select
    from .mita_attention import _mita_fused_kernel, _tile_table_kernel, launch_plan

    dtype = getattr(torch, case.dtype)
    g = torch.Generator().manual_seed(0)
    B, H, m, topk = 2, 2, 6, case.topk or 8
    N = max(600, topk)
    q, k, v = (torch.randn(B, H, N, case.d, generator=g).to(dtype) for _ in range(3))
    landmarks = torch.randn(B, H, m, case.d, generator=g)
    shared_values = torch.randn(B, H, m, case.d, generator=g)
    landmark_valid = torch.ones(B, m, dtype=torch.bool)
    mask = None
    if case.masked:
        mask = torch.zeros(B, N, dtype=torch.bool)
        mask[1, N - 10:] = True
    if case.kernel == "landmark_topk":
        _, args, meta, _ = routing.landmark_topk_plan(landmarks, k, topk, case.d ** -0.5, mask,
                                                      interpreter=False)
        return routing._landmark_topk_kernel, args, meta
    if case.kernel in SELECT_LAUNCH:
        launches, _ = select.threshold_topk_plans(landmarks, k, topk, case.d ** -0.5, mask,
                                                  interpreter=False)
        kernel, _, args, meta = launches[SELECT_LAUNCH[case.kernel]]
        return kernel, args, meta
    if case.kernel == "pool":
        _, args, meta, _ = pooling.pool_plan(q, m, mask)
        return pooling._pool_kernel, args, meta
    if case.kernel == "route_shared":
        _, args, meta, _ = routing.route_shared_plan(q, landmarks, shared_values, landmark_valid,
                                                     case.d ** -0.5, interpreter=False)
        return routing._route_shared_kernel, args, meta
    index = torch.randint(0, N, (B, H, m, topk), generator=g)
    experts = torch.randint(0, m, (B, H, N, case.s), generator=g)
    partial = None
    if case.s == 1:
        partial = (torch.randn(B, H, N, generator=g), torch.rand(B, H, N, generator=g) + 1,
                   torch.randn(B, H, N, case.d, generator=g))
    plan = launch_plan(q, k, v, landmarks, shared_values, landmark_valid, index, experts, mask,
                       interpreter=False, shared_partial=partial)
    if case.kernel == "tile_table":
        return _tile_table_kernel, plan.tiles[1], plan.tiles[2]
    return _mita_fused_kernel, plan.args, plan.meta


def compile_launch(fn, args: tuple, meta: dict, capability: int):
    """Compile the ``@triton.jit`` function ``fn`` for ``GPUTarget("cuda", capability, 32)``,
    specialised exactly as ``fn[grid](*args, **meta)`` would be on a GPU (Triton's own binder:
    argument types, ``== 1`` integers, alignment; ``meta``: constexprs and launch options such
    as ``num_stages``). ``args`` may be CPU tensors. Returns Triton's ``CompiledKernel``
    (``.asm["cubin"]``, ``.metadata.shared``). Raises Triton's ``CompilationError`` (or the
    backend's error) when the kernel does not compile, RuntimeError when ``fn`` was defined
    under ``TRITON_INTERPRET=1`` (an interpreted function cannot be compiled)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    if not hasattr(fn, "params"):
        raise RuntimeError("the kernel was defined under TRITON_INTERPRET=1; compile in a "
                           "process without it")
    target = GPUTarget("cuda", capability, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    kwargs = dict(meta, debug=False)
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound,
                                                          specialization, options)
    return triton.compile(ASTSource(fn, signature, constexprs, attrs), target=target,
                          options=options.__dict__)


def check(case: Case, capability: int) -> dict:
    """``compile_launch`` of the case's kernel with its launcher's arguments, as a record: the
    kernel, the launcher's ``meta`` for the case, ``ok``, the error text if not, shared memory
    bytes and whether they fit the target."""
    fn, args, meta = example_plan(case)
    try:
        kernel = compile_launch(fn, args, meta, capability)
    except Exception as e:  # report every failing specialisation, not only the first
        return {"case": str(case), "kernel": case.kernel, "sm": capability, "meta": meta,
                "ok": False,
                "error": f"{type(e).__name__}: {e}"[-1500:]}
    shared = int(kernel.metadata.shared)
    return {"case": str(case), "kernel": case.kernel, "sm": capability, "meta": meta,
            "ok": shared <= MAX_SHARED_BYTES[capability],
            "shared_bytes": shared, "cubin_bytes": len(kernel.asm["cubin"]),
            "error": None if shared <= MAX_SHARED_BYTES[capability] else
            f"needs {shared} bytes of shared memory, sm_{capability} allows "
            f"{MAX_SHARED_BYTES[capability]}"}


def _check_args(args):
    return check(*args)


def check_all(capabilities=CAPABILITIES, workers: int | None = None) -> list[dict]:
    """``check`` for every case and capability, in ``workers`` fresh processes (spawned, with
    ``TRITON_INTERPRET`` removed, so an interpreter-mode import elsewhere cannot leak in)."""
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    # slowest first (the large top-k sorts), so the process pool ends evenly
    jobs = sorted(((c, cap) for cap in capabilities for c in cases()),
                  key=lambda job: (job[0].kernel != "landmark_topk", -job[0].topk, job[1]))
    saved = os.environ.pop("TRITON_INTERPRET", None)
    try:
        with ProcessPoolExecutor(workers or os.cpu_count() or 1,
                                 mp_context=mp.get_context("spawn")) as pool:
            return list(pool.map(_check_args, jobs))
    finally:
        if saved is not None:
            os.environ["TRITON_INTERPRET"] = saved


def main() -> int:
    results = check_all()
    bad = [r for r in results if not r["ok"]]
    for r in bad:
        print(f"FAIL sm_{r['sm']} {r['case']}: {r['error']}")
    print(f"{len(results) - len(bad)} passed, {len(bad)} failed "
          f"({len(cases())} specialisations × sm_{', sm_'.join(map(str, CAPABILITIES))})")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
