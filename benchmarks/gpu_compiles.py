"""The Triton specialisations each step of the GPU command compiles, listed on the CPU.

    python benchmarks/gpu_compiles.py [--list]      # also: bash benchmarks/gpu_check.sh --dry
    python3 benchmarks/gpu_compiles.py --warm       # on the GPU: compile them all, in parallel

A fresh GPU host JIT-compiles every specialisation a run launches (a kernel × its constexprs ×
Triton's argument specialisation: pointer dtypes, integers equal to 1, 16-byte alignment), at
0.3-8 s of CPU each, inside a short GPU loan. This script runs the same entry points the GPU
steps call (``mita_attention(backend="triton")``, the model's forward, the top-k paths,
``route_shared``), at the same shapes (the steps' own constants), on tensors of PyTorch's
``meta`` device — shapes, dtypes and strides, no data — with every Triton launch replaced by a
recorder that computes the sm_90 specialisation as Triton's launcher would
(``mita.kernels.aot.compile_launch``'s binder) and runs nothing. The top-k chooser tries
every path, as it does on its first call on a GPU.

Per step it prints the specialisations a step compiles that no earlier step compiled (the
steps share Triton's cache, ``TRITON_CACHE_DIR``) against ``BUDGET``; the exit status is 1
when a step is over its budget, so a change that adds compiles fails ``make test``
(``tests/kernels/test_gpu_compiles.py``). ``--warm`` compiles the same list for the GPU at hand in
one process per core (``WARM_WORKERS``) into Triton's cache, before the steps run; the GPU
command prints the fresh compiles each step still made beside these.

What it cannot see: a launch that only data decides (the bisection fallback's grid is fixed,
so it is listed; a path the chooser drops on the GPU is listed anyway — an upper bound).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

# The kernel modules first, while TRITON_INTERPRET is unset: Triton decides at decoration
# whether a kernel is compiled (what the recorder needs) or interpreted.
from mita.kernels import (  # noqa: E402,F401
    bisect,
    choose,
    pooling,
    routing,
    topk,
    triton_backward,
    triton_fused,
    triton_mita,
)

# Fresh compiles per step: what the run measured plus headroom. A change that adds
# specialisations must raise these on purpose (each costs 0.3-8 s of a ≤ 6 min loan).
BUDGET = {"mita": 90, "training": 24, "topk": 4, "serving": 8}
META = torch.device("meta")


class Recorder:
    """Replaces ``JITFunction.run``: records each launch's sm_90 specialisation, runs nothing.
    ``seen``: specialisation key → the step that first launched it."""

    def __init__(self):
        from triton.backends.compiler import GPUTarget
        from triton.compiler import make_backend

        self.backend = make_backend(GPUTarget("cuda", 90, 32))
        self.seen: dict[tuple, str] = {}
        self.launches: dict[tuple, tuple] = {}  # key → (kernel, args, meta) of its first launch
        self.step = ""

    def run(self, fn, *args, grid, warmup, **kwargs):
        from triton.runtime.jit import create_function_from_signature

        if "UPCAST" in kwargs:
            kwargs["UPCAST"] = False  # the interpreter's bfloat16 upcast never runs on CUDA
        binder = create_function_from_signature(fn.signature, fn.params, self.backend)
        _, specialization, options = binder(*args, **dict(kwargs, debug=False))
        key = (fn.fn.__name__, str(specialization),
               json.dumps({k: kwargs[k] for k in sorted(kwargs)}, default=str))
        if key not in self.seen:
            self.seen[key] = self.step
            self.launches[key] = (fn, args, kwargs)

    def fresh(self, step: str) -> list[tuple]:
        return [key for key, first in self.seen.items() if first == step]


@contextlib.contextmanager
def recording():
    """Every Triton launch recorded (``Recorder``), none run; the top-k chooser times each
    path (as on a GPU's first call) with a timer that only calls it."""
    from triton.runtime.jit import JITFunction

    from mita import model

    recorder = Recorder()
    saved = (JITFunction.run, choose.CHOOSER.timer, dict(choose.CHOOSER.decisions),
             os.environ.get("TRITON_INTERPRET"))
    JITFunction.run = lambda fn, *a, **kw: recorder.run(fn, *a, **kw)
    choose.CHOOSER.timer = lambda call: (call(), 0.0)[1]
    choose.CHOOSER.decisions.clear()
    # the Triton path refuses CPU tensors unless the interpreter is named; the kernels were
    # defined before this, so they stay compiled (recorded) ones
    os.environ["TRITON_INTERPRET"] = "1"
    logging.getLogger(choose.__name__).disabled = True  # the torch path fails on meta: quiet
    # the model's mask check reads the mask's values (none on meta) and launches nothing
    check, model.check_padding_mask = model.check_padding_mask, lambda *args: None
    try:
        yield recorder
    finally:
        JITFunction.run, choose.CHOOSER.timer = saved[0], saved[1]
        model.check_padding_mask = check
        choose.CHOOSER.decisions.clear()
        choose.CHOOSER.decisions.update(saved[2])
        choose.CHOOSER.dropped.clear()
        logging.getLogger(choose.__name__).disabled = False
        if saved[3] is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = saved[3]


def empty(*shape, dtype=torch.bfloat16):
    return torch.empty(*shape, dtype=dtype, device=META)


def mask_of(B: int, N: int):
    return torch.zeros(B, N, dtype=torch.bool, device=META)


def forward(model, B: int, N: int, masked: bool) -> None:
    ids = torch.ones(B, N, dtype=torch.long, device=META)
    model(ids, mask_of(B, N) if masked else None)


def mita_step() -> None:
    """``benchmarks/gpu_mita.py``: the whole model and one layer at each speed N, the checks."""
    from benchmarks import gpu_mita_checks as C
    from benchmarks.gpu_mita import FIXED_SETTING, SPEED_NS, build
    from mita import attention as A
    from mita.config import clamp_topk
    from mita.cost import fig5_setting
    from mita.model import set_mita_backend

    for n in SPEED_NS:  # whole model, then one layer at Fig. 5's (m, k) and the fixed one
        model = build(n, "mita", META, torch.bfloat16)
        set_mita_backend(model, "triton")
        forward(model, 1, n, False)
        q, k, v = (empty(1, 2, n, 64) for _ in range(3))
        for m, kk in (fig5_setting(n), FIXED_SETTING):
            A.mita_attention(q, k, v, num_landmarks=m, topk=kk, backend="triton")
    for dtype in C.CHECK_DTYPES:  # check_reference
        for B, H, N, d, m, kk, s, masked in C.REFERENCE_CASES:
            q, k, v = (empty(B, H, N, d, dtype=dtype) for _ in range(3))
            A.mita_attention(q, k, v, num_landmarks=m, topk=kk, route_topk=s,
                             key_padding_mask=mask_of(B, N) if masked else None,
                             backend="triton", check_mask=False)
            C.fused_decisions(q, k, v, m, clamp_topk(kk, N), s, mask_of(B, N) if masked
                              else None)
    for dtype in C.ROUTING_DTYPES:  # check_routing: the kernels called directly
        for B, H, N, d, m, kk in C.ROUTING_CASES:
            q, k = empty(B, H, N, d, dtype=dtype), empty(B, H, N, d, dtype=dtype)
            landmarks = empty(B, H, m, d, dtype=torch.float32)
            routing.landmark_topk(landmarks, k, kk, d ** -0.5, mask_of(B, N))
            topk.threshold_topk(landmarks, k, kk, d ** -0.5, mask_of(B, N))
            routing.route_shared(q, landmarks, empty(B, H, m, d, dtype=torch.float32),
                                 torch.ones(B, m, dtype=torch.bool, device=META), d ** -0.5)
    n, m, kk = C.TORCH_PATH_SHAPE  # check_torch_path
    for s in (1, 2):
        q, k, v = (empty(2, 2, n, 64, dtype=torch.float32) for _ in range(3))
        A.mita_attention(q, k, v, num_landmarks=m, topk=kk, route_topk=s,
                         key_padding_mask=mask_of(2, n), backend="triton", check_mask=False)
    # check_model: the 3-layer model at the first speed N, bfloat16 (a speed row's)


def training_step() -> None:
    """``benchmarks/gpu_training.py``: the forward of the training path (route, dispatch table,
    fused attention writing the log-sum-exp; top-k and pooling run in PyTorch there) on meta
    tensors, and each launch of the backward's plan (``triton_backward.backward_plan``, on
    small CPU tensors: its index sort and counts need values; shapes do not change what
    compiles — N, m and the tile count are unspecialised)."""
    from benchmarks.gpu_training import FIXED, checks_shape
    from mita import joint
    from mita.cost import fig5_setting
    from mita.kernels import tile_table

    cases = [(dtype, s, True) for dtype in (torch.float32, torch.bfloat16) for s in (1, 2)]
    cases += [(torch.bfloat16, 1, False)]  # the timed layer
    n_check, m_check = checks_shape(False)
    for dtype, s, masked in cases:
        settings = [(m_check, m_check)] if masked else [fig5_setting(n) for n in
                                                        (16_384, 65_536, 262_144)] + [
            (FIXED, FIXED)]
        for m, kk in dict.fromkeys(settings):
            B = 2 if masked else 1
            q, k, v = (empty(B, 2, n_check, 64, dtype=dtype) for _ in range(3))
            joint._triton_forward(q, empty(B, 2, m, 64, dtype=torch.float32),
                                  empty(B, 2, m, 64, dtype=dtype), k, v,
                                  torch.zeros(B, 2, m, kk, dtype=torch.long, device=META),
                                  torch.ones(B, m, dtype=torch.bool, device=META),
                                  mask_of(B, n_check) if masked else None, s, 0.125)
        for deterministic in ((True, False) if masked else (True,)):
            N, m = 64, 4
            q, k, v = (torch.randn(B, 2, N, 64).to(dtype) for _ in range(3))
            valid = torch.ones(B, N, dtype=torch.bool)
            plan = triton_backward.backward_plan(
                v, q, torch.randn(B, 2, m, 64), torch.randn(B, 2, m, 64), k, v, v,
                torch.randn(B, 2, N), torch.randint(0, N, (B, 2, m, 8)),
                torch.randint(0, m, (B, 2, N, s)), torch.ones(B, m, dtype=torch.bool),
                valid if masked else None, deterministic, interpreter=False)
            tile_table.run_tile_table(plan.tiles)
            for _, kernel, grid, args, meta in plan.launches:
                kernel[grid](*args, **meta)


def topk_step() -> None:
    """``benchmarks/gpu_topk.py``: the select and bitonic paths at each N, and their
    exactness check on integer inputs (d = 16)."""
    from benchmarks.gpu_topk import EXACT_MAX_N, NS, m_topk_at

    for n in NS:
        mk = m_topk_at(n)
        for N, d in ((min(n, EXACT_MAX_N), 16), (n, 64)):
            landmarks, k = empty(1, 2, mk, d, dtype=torch.float32), empty(1, 2, N, d)
            for path in (topk.threshold_topk, routing.landmark_topk):
                try:
                    path(landmarks, k, mk, d ** -0.5)
                except ValueError:  # the bitonic path's k ≤ 512
                    pass


def serving_step() -> None:
    """``benchmarks/gpu_serving.py``: the shipped checkpoint's MiTA model (bfloat16, and
    float32 in the checks) as the engine runs it — one forward per sequence (no mask), padded
    groups of the checks' 24 ListOps sequences (masked), the request cells at each N for
    batch 1 and 8 (8 equal lengths: one unpadded forward)."""
    from benchmarks.gpu_serving import BATCHES, CHECKPOINT, NS, OVERHEAD_NS
    from mita.data.listops import ListOpsConfig, encode, generate
    from mita.model import EncoderClassifier, ModelConfig, set_mita_backend
    from service.engine import length_groups

    cfg = ModelConfig(**json.loads((ROOT / CHECKPOINT / "config.json").read_text())["config"])
    lengths = [len(encode(t)) for t, _ in generate(24, seed=31_337,
                                                    cfg=ListOpsConfig(100, 600))]
    for dtype in (torch.float32, torch.bfloat16):
        model = EncoderClassifier(cfg).to(META, dtype).eval()
        set_mita_backend(model, "triton")
        for n in sorted(set(lengths)):
            forward(model, 1, n, False)
        for group in length_groups(lengths):
            n_max = max(lengths[i] for i in group)
            forward(model, len(group), n_max,
                    any(lengths[i] != n_max for i in group))
        if dtype == torch.bfloat16:
            for n in sorted(set(NS) | set(OVERHEAD_NS)):
                for b in BATCHES:
                    forward(model, b, n, False)


STEPS = {"mita": mita_step, "training": training_step, "topk": topk_step,
         "serving": serving_step}


def steps() -> list[str]:
    """The steps this host runs: serving needs pydantic (``gpu_check.sh`` skips it without)."""
    import importlib.util

    return [s for s in STEPS if s != "serving" or importlib.util.find_spec("pydantic")]


def record() -> Recorder:
    """A ``Recorder`` that has seen every step of ``steps()``, in order."""
    with recording() as recorder, torch.no_grad():
        for name in steps():
            recorder.step = name
            STEPS[name]()
    return recorder


def specialisations() -> dict[str, list[tuple]]:
    """Step name → the specialisations it compiles fresh, in ``gpu_check.sh``'s step order:
    ``(kernel, Triton's argument specialisation, constexprs and launch options)``."""
    recorder = record()
    return {name: recorder.fresh(name) for name in steps()}


def _compile_share(job: tuple[int, int, int]) -> tuple[int, float]:
    """Worker ``i`` of ``n``: record again (the same order in every process) and compile every
    n-th specialisation for sm_``capability`` into Triton's cache. Returns (compiles, CPU s)."""
    import time

    from mita.kernels.aot import compile_launch

    i, n, capability = job
    launches = list(record().launches.values())[i::n]
    t0 = time.process_time()
    for fn, args, meta in launches:
        compile_launch(fn, args, meta, capability)
    return len(launches), time.process_time() - t0


def warm(workers: int, capability: int) -> int:
    """Compile every listed specialisation in ``workers`` processes into Triton's cache
    (``TRITON_CACHE_DIR``), where the steps' own launches find them: ``triton.compile`` keys
    its cache by the same source, specialisation, options and target as a launch does."""
    import multiprocessing as mp
    import time
    from concurrent.futures import ProcessPoolExecutor

    t0 = time.perf_counter()
    with ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn")) as pool:
        done = list(pool.map(_compile_share, [(i, workers, capability)
                                              for i in range(workers)]))
    print(f"warm: {sum(n for n, _ in done)} specialisations compiled for sm_{capability} in "
          f"{time.perf_counter() - t0:.0f} s ({workers} processes, "
          f"{sum(cpu for _, cpu in done):.0f} s of CPU)")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--warm" in argv:
        import triton

        capability = (torch.cuda.get_device_capability() if torch.cuda.is_available()
                      else (9, 0))
        workers = int(os.environ.get("WARM_WORKERS", os.cpu_count() or 1))
        print(f"triton {triton.__version__}")
        return warm(workers, capability[0] * 10 + capability[1])
    status = 0
    skipped = [s for s in STEPS if s not in steps()]
    if skipped:
        print(f"{', '.join(skipped)}: skipped (no pydantic)")
    for name, keys in specialisations().items():
        over = len(keys) > BUDGET[name]
        status |= over
        kernels = sorted({k[0] for k in keys})
        print(f"{name}: {len(keys)} fresh compiles (budget {BUDGET[name]})"
              f"{' OVER BUDGET' if over else ''}; kernels: {', '.join(kernels)}")
        if "--list" in argv:
            for kernel, spec, meta in sorted(keys):
                print(f"  {kernel} {meta} {spec}")
    return status


if __name__ == "__main__":
    sys.exit(main())
