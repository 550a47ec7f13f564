"""Ahead-of-time compilation of the Triton MiTA kernels for NVIDIA GPUs, on any machine.

The CPU interpreter (``TRITON_INTERPRET=1``) runs a kernel's Python, not its compilation: it
accepted a plain module global inside ``@triton.jit`` that the GPU compiler rejects, so every MiTA
request on a GPU host failed. This module compiles each kernel the way a GPU launch does — the
launcher's own arguments (``launch_plan``, ``routing.*_plan``) through Triton's launch-time
specialisation (argument types, ``== 1`` integers, 16-byte alignment) to ttir → ttgir → llir → ptx →
cubin — for a chosen ``GPUTarget``, without a GPU (Triton ships ``ptxas``).

    python -m mita.kernels.aot            # every specialisation, sm_80 and sm_90
    python -m mita.kernels.aot --table    # and a Markdown table of their resources

Each record also gives the resources a GPU would allocate, read on this machine: registers per
thread, spill and stack bytes from the ptxas that produced the cubin (``ptxas -v`` on Triton's
PTX with Triton's flags: only ptxas reports spills), cross-checked against ``cuobjdump
--dump-resource-usage`` of the cubin itself; shared memory; and blocks per SM by the CUDA
occupancy rules (``resident_blocks``).

The records of all 440 compiles are committed (``compiled.json`` beside this file, written by
``make kernels-table``; ``aot_table.py``), keyed by a hash of what they depend on.
"""

from __future__ import annotations

import argparse
import itertools
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass

import torch

from ..tools.argtypes import Parser

CAPABILITIES = (80, 90)  # A100, H100/H200
# Largest dynamic shared memory one block may use (CUDA programming guide, "Compute
# Capabilities"): 163 KB on sm_80, 227 KB on sm_90. A kernel over it compiles but fails to launch.
MAX_SHARED_BYTES = {80: 163 * 1024, 90: 227 * 1024}
SM_SHARED_BYTES = {80: 164 * 1024, 90: 228 * 1024}  # largest shared-memory carveout of one SM
SM_REGISTERS = 65536  # 32-bit registers per SM (sm_80 and sm_90), in 4 sub-partitions
SM_WARPS = 64
SM_BLOCKS = 32


KERNELS = ("attention", "landmark_topk", "route_shared", "pool", "tile_count", "tile_scan",
           "tile_scatter", "groupmax", "theta", "filter", "select", "bisect", "shared_dq",
           "shared_dkv", "routed_dq", "routed_dkv", "key_sum")
# the backward's launches (triton_backward.backward_plan) by case name
BACKWARD_LAUNCH = ("shared_dq", "shared_dkv", "routed_dq", "routed_dkv", "key_sum")
TILE_LAUNCH = {"tile_count": 0, "tile_scan": 1, "tile_scatter": 2}  # tile_table_plan's order
# threshold_topk's launches by case name
SELECT_LAUNCH = {"groupmax": 0, "theta": 1, "filter": 2, "select": 3, "bisect": 4}
# keys of the threshold select's example plans: 32 tiles of 32 keys per chunk, the tile loop
# as it runs at long N (its trip count is a runtime value since N, m, k are unspecialised)
SELECT_EXAMPLE_N = 66 * 16 * 64


@dataclass(frozen=True)
class Case:
    """One launcher choice of one kernel. ``attention`` (``_mita_fused_kernel``): dtype,
    s = 1 or not, mask or not, BLOCK_D from the head dim. ``landmark_topk``: dtype, BLOCK_D,
    K_PAD from ``topk``. ``route_shared``: dtype, BLOCK_D. ``pool`` (``pooling._pool_kernel``):
    dtype, BLOCK_D, mask or not. The tile table (``tile_table.tile_table_plan``, no float
    inputs): ``tile_count`` and ``tile_scatter``, s = 1 or not, mask or not; ``tile_scan``,
    the attention tile (BLOCK_M) of the dtype and s it is planned with."""

    kernel: str
    dtype: str  # "float16" | "bfloat16" | "float32"
    d: int
    s: int = 1
    masked: bool = False
    topk: int = 0
    atomic: bool = False  # the backward's routed kernels: fp32 atomics, not per-key sums

    def __str__(self):
        if self.kernel in ("routed_dq", "routed_dkv"):
            return (f"{self.kernel}-{self.dtype}-s{self.s}-"
                    f"{'atomic' if self.atomic else 'ordered'}-d{self.d}")
        if self.kernel == "key_sum":
            return f"key_sum-d{self.d}"
        if self.kernel in BACKWARD_LAUNCH:
            return f"{self.kernel}-{self.dtype}-d{self.d}"
        if self.kernel == "attention":
            return (f"attention-{self.dtype}-s{self.s}-{'mask' if self.masked else 'nomask'}"
                    f"-d{self.d}")
        if self.kernel == "landmark_topk":
            return f"landmark_topk-{self.dtype}-d{self.d}-k{self.topk}"
        if self.kernel == "pool":
            return f"pool-{self.dtype}-{'mask' if self.masked else 'nomask'}-d{self.d}"
        if self.kernel == "tile_scan":
            return f"tile_scan-{self.dtype}-s{self.s}"
        if self.kernel in TILE_LAUNCH:
            return f"{self.kernel}-s{self.s}-{'mask' if self.masked else 'nomask'}"
        if self.kernel == "select":
            return f"select-k{self.topk}"
        if self.kernel == "theta":
            return "theta"
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
    (mask, none) = 12. The tile table: ``tile_count`` and ``tile_scatter`` (s = 1, s > 1) ×
    (mask, none) = 4 each, ``tile_scan`` per attention tile (BLOCK_M: 16-bit s = 1 and s > 1,
    float32) = 3. The threshold select (``topk.threshold_topk``): ``groupmax``,
    ``filter`` and ``bisect`` 3 dtypes × BLOCK_D ∈ {64, 128} = 6 each; ``theta``
    (no float inputs) 1; ``select`` (no float inputs) CAP ∈ {128 … 4096} (k 40, 100, 200,
    512, 600, 2048) = 6. The select's scoring passes are planned at N = ``SELECT_EXAMPLE_N``
    (32 tiles of 32 keys per chunk, as at long N). Tiles, warps and stages
    follow from (dtype, BLOCK_D) or (dtype, K_PAD) (``triton_fused._blocks``,
    ``routing._route_blocks``, ``routing._topk_blocks``: float32 takes smaller tiles than
    16-bit), so they add no other cases."""
    out = [Case("attention", dt, d, s, masked) for dt, s, masked, d in itertools.product(
        DTYPE_NAMES, (1, 3), (False, True), (8, 32, 48, 128))]
    out += [Case("landmark_topk", dt, d, topk=topk) for dt, d, topk in itertools.product(
        DTYPE_NAMES, (48, 128), (40, 100, 200, 512))]
    out += [Case("route_shared", dt, d) for dt, d in itertools.product(
        DTYPE_NAMES, (8, 32, 48, 128))]
    out += [Case("pool", dt, d, masked=masked) for dt, d, masked in itertools.product(
        DTYPE_NAMES, (48, 128), (False, True))]
    out += [Case(kernel, "bfloat16", 32, s, masked) for kernel, s, masked in itertools.product(
        ("tile_count", "tile_scatter"), (1, 3), (False, True))]
    out += [Case("tile_scan", dt, 32, s) for dt, s in (("bfloat16", 1), ("bfloat16", 3),
                                                       ("float32", 1))]
    out += [Case(kernel, dt, d, topk=8) for kernel, dt, d in itertools.product(
        ("groupmax", "filter", "bisect"), DTYPE_NAMES, (48, 128))]
    out += [Case("theta", "float32", 32, topk=8)]
    out += [Case("select", "float32", 32, topk=topk) for topk in (40, 100, 200, 512, 600, 2048)]
    out += backward_cases()
    return out


def backward_cases() -> list[Case]:
    """The backward's specialisations (``triton_backward.backward_plan``), each over 3 dtypes
    × BLOCK_D ∈ {16, 32, 64, 128} (head dims 8, 32, 48, 128): ``shared_dq`` and ``shared_dkv``
    12 each; ``routed_dq`` s = 1, s > 1 ordered, s > 1 atomic = 36; ``routed_dkv`` ordered and
    atomic = 24; ``key_sum`` (fp32 buffers only) BLOCK_D alone = 4. 88 in all."""
    dims = (8, 32, 48, 128)
    out = [Case(kernel, dt, d) for kernel, dt, d in itertools.product(
        ("shared_dq", "shared_dkv"), DTYPE_NAMES, dims)]
    out += [Case("routed_dq", dt, d, s, atomic=atomic) for dt, d, (s, atomic) in
            itertools.product(DTYPE_NAMES, dims, ((1, False), (3, False), (3, True)))]
    out += [Case("routed_dkv", dt, d, atomic=atomic) for dt, d, atomic in itertools.product(
        DTYPE_NAMES, dims, (False, True))]
    out += [Case("key_sum", "float32", d) for d in dims]
    return out


def example_plan(case: Case) -> tuple:
    """The kernel of ``case`` and its launcher's ``(args, meta)`` on small CPU tensors
    (B = 2, H = 2, N = 600, m = 6, k = 8 unless the case sets k), planned as for CUDA
    (``interpreter=False``): the same arguments and constexprs a CUDA launch of that case
    passes. Returns ``(kernel, args, meta)``."""
    from . import pooling, routing
    from . import topk as select
    from .triton_fused import _mita_fused_kernel, launch_plan

    dtype = getattr(torch, case.dtype)
    g = torch.Generator().manual_seed(0)
    B, H, m, topk = 2, 2, 6, case.topk or 8
    N = SELECT_EXAMPLE_N if case.kernel in SELECT_LAUNCH else max(600, topk)
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
    if case.kernel in BACKWARD_LAUNCH:
        from .triton_backward import backward_plan

        index = torch.randint(0, N, (B, H, m, topk), generator=g)
        experts = torch.randint(0, m, (B, H, N, case.s), generator=g)
        lse = torch.randn(B, H, N, generator=g)
        plan = backward_plan(v, q, landmarks, shared_values, k, v, v, lse, index, experts,
                             landmark_valid, None, deterministic=not case.atomic,
                             interpreter=False)
        _, kernel, _, args, meta = next(launch for launch in plan.launches
                                        if launch[0] == case.kernel)
        return kernel, args, meta
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
    if case.kernel in TILE_LAUNCH:
        kernel, _, args, meta = plan.tiles[TILE_LAUNCH[case.kernel]]
        return kernel, args, meta
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


def resident_blocks(registers: int, shared_bytes: int, num_warps: int,
                    capability: int) -> tuple[int, str]:
    """Blocks (CTAs) of one kernel resident on one SM at once, and the resource that limits
    them: ``"registers"``, ``"shared"``, ``"warps"`` or ``"blocks"`` (0 blocks: it cannot
    launch). The rules of CUDA's occupancy calculator (``cuda_occupancy.h``,
    ``cudaOccMaxBlocksPerSMRegsLimit`` / ``…SmemLimit`` / ``…WarpsLimit``) for sm_80 / sm_90:

    - registers: per warp ``registers · 32`` rounded up to 256 (the allocation unit); they are
      allocated in each of the 4 sub-partitions (16,384 registers each), so blocks =
      ⌊⌊16384 / regs per warp⌋ · 4 / num_warps⌋; none if regs per warp × num_warps (rounded up
      to a multiple of 4) exceeds 65,536;
    - shared memory: ``shared_bytes`` (static + dynamic, bytes) + the 1 KiB the driver reserves
      per block, rounded up to 128 bytes, against the SM's largest carveout (164 KiB sm_80,
      228 KiB sm_90); none above the per-block limit (163 / 227 KiB, + the reserved 1 KiB);
    - warps: ⌊64 / num_warps⌋; blocks: at most 32 per SM.
    """
    regs_per_warp = -(-registers * 32 // 256) * 256
    if regs_per_warp * (-(-num_warps // 4) * 4) > SM_REGISTERS or registers > 255:
        by_regs = 0
    else:
        by_regs = (SM_REGISTERS // 4 // max(regs_per_warp, 256)) * 4 // num_warps
    smem = -(-(shared_bytes + 1024) // 128) * 128
    by_shared = 0 if shared_bytes > MAX_SHARED_BYTES[capability] else \
        SM_SHARED_BYTES[capability] // smem
    limits = {"registers": by_regs, "shared": by_shared, "warps": SM_WARPS // num_warps,
              "blocks": SM_BLOCKS}
    limiter = min(limits, key=limits.get)
    return limits[limiter], limiter


def _ptxas_path(capability: int) -> str:
    """The ptxas Triton itself compiles with for this target (Triton 3.9 takes its newer
    ``ptxas-blackwell`` for sm_90 and up, the older one below)."""
    from triton.backends.nvidia.compiler import get_ptxas

    return get_ptxas(capability).path


def ptxas_usage(ptx: str, capability: int) -> dict:
    """``ptxas -v`` on Triton's PTX with the flags Triton's ``make_cubin`` passes
    (``-lineinfo``, ``--regAllocOptLevel=2``, ``--gpu-name`` sm_80 / sm_90a): registers per
    thread, spill store / spill load bytes and stack-frame bytes, per thread. Raises
    RuntimeError with ptxas's log when it fails or prints no usage line."""
    from triton.backends.nvidia.compiler import sm_arch_from_capability

    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "kernel.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        done = subprocess.run([_ptxas_path(capability), "-v", "-lineinfo",
                               "--regAllocOptLevel=2",
                               f"--gpu-name={sm_arch_from_capability(capability)}", src,
                               "-o", os.path.join(tmp, "kernel.cubin")],
                              capture_output=True, text=True)
    log = done.stderr + done.stdout
    regs = re.search(r"Used (\d+) registers", log)
    frame = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, "
                      r"(\d+) bytes spill loads", log)
    if done.returncode or not regs or not frame:
        raise RuntimeError(f"ptxas -v gave no resource usage:\n{log[-1500:]}")
    return {"registers": int(regs[1]), "stack_bytes": int(frame[1]),
            "spill_store_bytes": int(frame[2]), "spill_load_bytes": int(frame[3])}


def cubin_usage(cubin: bytes) -> dict:
    """``cuobjdump --dump-resource-usage`` of a one-kernel cubin: ``REG`` (registers per thread),
    ``STACK``, ``SHARED`` (static shared memory), ``LOCAL`` (bytes). Raises RuntimeError when
    cuobjdump prints no resource line."""
    from triton import knobs

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        done = subprocess.run([knobs.nvidia.cuobjdump.path, "--dump-resource-usage", path],
                              capture_output=True, text=True)
    usage = dict(re.findall(r"\b(REG|STACK|SHARED|LOCAL):(\d+)", done.stdout))
    if set(usage) != {"REG", "STACK", "SHARED", "LOCAL"}:
        raise RuntimeError(f"cuobjdump gave no resource usage:\n{done.stdout}{done.stderr}")
    return {key: int(value) for key, value in usage.items()}


def check(case: Case, capability: int) -> dict:
    """``compile_launch`` of the case's kernel with its launcher's arguments, as a record: the
    kernel, the launcher's ``meta`` for the case, ``ok``, the error text if not; and the
    resources: ``registers`` (per thread), ``spill_store_bytes`` / ``spill_load_bytes`` and
    ``stack_bytes`` (per thread, from ``ptxas -v``), ``local_bytes`` (cuobjdump),
    ``shared_bytes`` (Triton's dynamic shared memory ``metadata.shared`` + static, per block),
    ``num_warps``, ``blocks_per_sm`` and its ``limiter`` (``resident_blocks``). ``ok`` needs
    the shared memory to fit the target, at least one resident block, and the re-run ptxas
    to agree with the cubin on registers and stack (the numbers are the cubin's)."""
    fn, args, meta = example_plan(case)
    record = {"case": str(case), "kernel": case.kernel, "sm": capability, "meta": meta}
    try:
        kernel = compile_launch(fn, args, meta, capability)
        ptxas = ptxas_usage(kernel.asm["ptx"], capability)
        cubin = cubin_usage(kernel.asm["cubin"])
    except Exception as e:  # report every failing specialisation, not only the first
        return record | {"ok": False, "error": f"{type(e).__name__}: {e}"[-1500:]}
    shared = int(kernel.metadata.shared) + cubin["SHARED"]
    num_warps = int(kernel.metadata.num_warps)
    blocks, limiter = resident_blocks(cubin["REG"], shared, num_warps, capability)
    record |= {"shared_bytes": shared, "cubin_bytes": len(kernel.asm["cubin"]),
               "registers": cubin["REG"], "spill_store_bytes": ptxas["spill_store_bytes"],
               "spill_load_bytes": ptxas["spill_load_bytes"], "stack_bytes": cubin["STACK"],
               "local_bytes": cubin["LOCAL"], "num_warps": num_warps,
               "blocks_per_sm": blocks, "limiter": limiter}
    errors = []
    if shared > MAX_SHARED_BYTES[capability]:
        errors.append(f"needs {shared} bytes of shared memory, sm_{capability} allows "
                      f"{MAX_SHARED_BYTES[capability]}")
    if blocks == 0:
        errors.append(f"no block fits an SM ({limiter})")
    if (ptxas["registers"], ptxas["stack_bytes"]) != (cubin["REG"], cubin["STACK"]):
        errors.append(f"ptxas -v ({ptxas}) disagrees with the cubin ({cubin})")
    return record | {"ok": not errors, "error": "; ".join(errors) or None}


def _check_args(args):
    return check(*args)


def jobs(capabilities=CAPABILITIES) -> list[tuple[Case, int]]:
    """Every (case, capability) to compile: ``cases()`` × ``capabilities``, 440 by default."""
    return [(c, cap) for cap in capabilities for c in cases()]


def check_all(capabilities=CAPABILITIES, workers: int | None = None,
              only: list[tuple[Case, int]] | None = None) -> list[dict]:
    """``check`` for every case and capability (or the (case, capability) pairs ``only``), in
    ``workers`` fresh processes (spawned, with ``TRITON_INTERPRET`` removed, so an
    interpreter-mode import elsewhere cannot leak in). Records in the order of the jobs run."""
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    # slowest first (the large top-k sorts), so the process pool ends evenly
    todo = sorted(jobs(capabilities) if only is None else only,
                  key=lambda job: (job[0].kernel != "landmark_topk", -job[0].topk, job[1]))
    saved = os.environ.pop("TRITON_INTERPRET", None)
    try:
        with ProcessPoolExecutor(workers or os.cpu_count() or 1,
                                 mp_context=mp.get_context("spawn")) as pool:
            return list(pool.map(_check_args, todo))
    finally:
        if saved is not None:
            os.environ["TRITON_INTERPRET"] = saved


COLUMNS = ("case", "sm", "tiles", "num_warps", "num_stages", "registers", "spill_store_bytes",
           "spill_load_bytes", "stack_bytes", "local_bytes", "shared_bytes", "blocks_per_sm",
           "limiter")


def table(results: list[dict]) -> str:
    """A Markdown table of ``check`` records, one row per specialisation × target: the
    ``BLOCK_*`` constexprs (``tiles``, in ``meta`` order), ``num_warps``, ``num_stages`` and the
    resources (bytes; registers and spills per thread, shared memory per block)."""
    rows = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for r in sorted(results, key=lambda r: (r["kernel"], r["case"], r["sm"])):
        cells = dict(r, sm=f"sm_{r['sm']}", num_stages=r["meta"].get("num_stages", "-"),
                     tiles="×".join(str(v) for k, v in r["meta"].items()
                                    if k.startswith("BLOCK_") or k == "K_PAD"))
        rows.append("| " + " | ".join(str(cells.get(c, "FAILED")) for c in COLUMNS) + " |")
    return "\n".join(rows)


def versions() -> str:
    """Triton's version and the ptxas release it compiles each target with."""
    import triton

    out = [f"triton {triton.__version__}"]
    for cap in CAPABILITIES:
        text = subprocess.run([_ptxas_path(cap), "--version"], capture_output=True,
                              text=True).stdout
        found = re.search(r"release [\d.]+, V[\d.]+", text)
        out.append(f"sm_{cap}: {os.path.basename(_ptxas_path(cap))} "
                   f"{found[0] if found else '?'}")
    return "; ".join(out)


def main(argv: list[str] | None = None) -> int:
    """``python -m mita.kernels.aot [--table]``: compile every specialisation for every target
    and print the failures (exit 1 if any). The flags are parsed before anything compiles:
    ``--help`` or a misspelt flag answers at once, not after minutes of compiles."""
    p = Parser(prog="python -m mita.kernels.aot", description=__doc__,
               formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--table", action="store_true",
                   help="also print the versions and a Markdown table of each compile's "
                        "resources (registers, spills, shared memory, blocks per SM)")
    a = p.parse_args(argv)
    results = check_all()
    bad = [r for r in results if not r["ok"]]
    if a.table:
        print(f"{versions()}\n\n{table(results)}\n")
    for r in bad:
        print(f"FAIL sm_{r['sm']} {r['case']}: {r['error']}")
    print(f"{len(results) - len(bad)} passed, {len(bad)} failed "
          f"({len(cases())} specialisations × sm_{', sm_'.join(map(str, CAPABILITIES))})")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
