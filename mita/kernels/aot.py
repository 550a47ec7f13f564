"""Ahead-of-time compilation of the Triton MiTA kernel for NVIDIA GPUs, on any machine.

The CPU interpreter (``TRITON_INTERPRET=1``) runs a kernel's Python, not its compilation: it
accepted a plain module global inside ``@triton.jit`` that the GPU compiler rejects, so every
MiTA request on a GPU host failed. This module compiles the kernel the way a GPU launch does —
the launcher's own arguments (``launch_plan``) through Triton's launch-time specialisation
(argument types, ``== 1`` integers, 16-byte alignment) to ttir → ttgir → llir → ptx → cubin —
for a chosen ``GPUTarget``, without a GPU (Triton ships ``ptxas``).

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


@dataclass(frozen=True)
class Case:
    """One launcher choice: the constexprs it leads to are dtype, s = 1 or not, mask or not,
    and BLOCK_D from the head dim."""

    dtype: str  # "float16" | "bfloat16" | "float32"
    s: int
    masked: bool
    d: int

    def __str__(self):
        return f"{self.dtype}-s{self.s}-{'mask' if self.masked else 'nomask'}-d{self.d}"


def cases() -> list[Case]:
    """Every specialisation ``launch_plan`` can choose on CUDA: 3 dtypes × (s = 1, s > 1) ×
    (mask, none) × BLOCK_D ∈ {16, 32, 64, 128} (head dims 8, 32, 48, 128 reach each one)."""
    return [Case(dt, s, masked, d) for dt, s, masked, d in itertools.product(
        ("float16", "bfloat16", "float32"), (1, 3), (False, True), (8, 32, 48, 128))]


def example_plan(case: Case):
    """``launch_plan`` on small CPU tensors shaped for ``case`` (B = 2, H = 2, N = 96, m = 6,
    k = 8), planned as for CUDA (``interpreter=False``): the same arguments and constexprs a
    CUDA launch of that case passes."""
    from .mita_attention import launch_plan

    dtype = getattr(torch, case.dtype)
    g = torch.Generator().manual_seed(0)
    B, H, N, m, kk = 2, 2, 96, 6, 8
    q, k, v = (torch.randn(B, H, N, case.d, generator=g).to(dtype) for _ in range(3))
    shared_keys = torch.randn(B, H, m, case.d, generator=g)
    shared_values = torch.randn(B, H, m, case.d, generator=g)
    live = torch.ones(B, m, dtype=torch.bool)
    index = torch.randint(0, N, (B, H, m, kk), generator=g)
    experts = torch.randint(0, m, (B, H, N, case.s), generator=g)
    mask = None
    if case.masked:
        mask = torch.zeros(B, N, dtype=torch.bool)
        mask[1, N - 10:] = True
    return launch_plan(q, k, v, shared_keys, shared_values, live, index, experts, mask,
                       interpreter=False)


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
    """``compile_launch`` of ``_mita_fused_kernel`` with the launcher's arguments for ``case``,
    as a record: the launcher's ``meta`` for the case, ``ok``, the error text if not, shared
    memory bytes and whether they fit the target."""
    from .mita_attention import _mita_fused_kernel

    plan = example_plan(case)
    meta = plan.meta
    try:
        kernel = compile_launch(_mita_fused_kernel, plan.args, plan.meta, capability)
    except Exception as e:  # report every failing specialisation, not only the first
        return {"case": str(case), "sm": capability, "meta": meta, "ok": False,
                "error": f"{type(e).__name__}: {e}"[-1500:]}
    shared = int(kernel.metadata.shared)
    return {"case": str(case), "sm": capability, "meta": meta,
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

    jobs = [(c, cap) for cap in capabilities for c in cases()]
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
