"""The CPU MiTA kernels (``cpu_mita.cpp``), compiled on first use with
``torch.utils.cpp_extension.load`` (needs a C++ compiler and ninja; about a minute once per
machine, then loaded from the build cache in ``$MITA_CPU_BUILD_DIR`` or
``~/.cache/mita-serve/cpu-kernels``).

``load()`` returns the extension module or None when it cannot be built (no compiler): MiTA
then runs its PyTorch stages and logs why once. ``mita_cpu`` is the launcher: MiTA's stages on
the loaded extension (``mita.attention`` calls it for ``backend="cpu"``/``"auto"`` on CPU).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from pathlib import Path

import torch
from torch import Tensor

from .. import attention as A
from ..hooks import StageHook

log = logging.getLogger(__name__)
_SOURCE = Path(__file__).with_name("cpu_mita.cpp")
_lock = threading.Lock()
_state: dict[str, object] = {}


def build_dir() -> Path:
    """Where the compiled extension is cached."""
    default = Path.home() / ".cache" / "mita-serve" / "cpu-kernels"
    return Path(os.environ.get("MITA_CPU_BUILD_DIR", default))


def _flags() -> list[str]:
    # ATen's Vectorized<float> picks its instruction set from CPU_CAPABILITY; match the
    # capability torch itself dispatches to on this machine (AVX-512 machines run AVX2 here).
    # -fopenmp: at::parallel_for is inline OpenMP; without it the kernels run on one thread
    # and BLAS, seeing no parallel region, threads every small product.
    cflags = ["-O3", "-fopenmp"]
    if torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512"):
        cflags += ["-mavx2", "-mfma", "-DCPU_CAPABILITY_AVX2", "-DCPU_CAPABILITY=AVX2"]
    return cflags


def load():
    """The compiled extension (functions ``landmark_pass``, ``route_shared``,
    ``routed_attention``), or None when it cannot be built here. Thread-safe; builds at most
    once per process (a file lock in the build directory serialises processes)."""
    with _lock:
        if "module" not in _state:
            _state["module"] = _build()
        return _state["module"]


def _build():
    from torch.utils import cpp_extension

    path = build_dir()
    if not any(path.glob("mita_cpu_kernels*.so")):  # the first build takes ~1 min on 2 cores
        print(f"mita: building the MiTA CPU kernels once for this machine (~1 min) in {path}",
              file=sys.stderr, flush=True)
    try:
        path.mkdir(parents=True, exist_ok=True)
        return cpp_extension.load("mita_cpu_kernels", [str(_SOURCE)], extra_cflags=_flags(),
                                  extra_ldflags=["-fopenmp"],
                                  build_directory=str(path), verbose=False)
    except Exception as exc:  # no compiler, no ninja, unwritable cache: fall back, say why
        log.warning("MiTA CPU kernels unavailable (%s: %s); using the PyTorch stages",
                    type(exc).__name__, exc)
        return None


def mita_cpu(ext, q: Tensor, k: Tensor, v: Tensor, m: int, topk: int, s: int,
             key_padding_mask: Tensor | None, landmark_grid: tuple[int, int] | None,
             shared_scale: str, hook: StageHook) -> Tensor:
    """``mita_attention`` on the compiled CPU kernels (``mita/kernels/cpu_mita.cpp``): the same
    eqs. 5-12, cache-blocked, float32/float64 q, k, v. Stage ``landmark_scores`` also does
    ``topk`` and ``shared_compress`` (one pass over the keys; the m × N scores are never
    stored). For s = 1, ``route`` also computes the shared half of the joint softmax from its
    q·q̃ products (the reuse the paper's cost model assumes) and ``attention`` gathers each
    expert's k raw pairs by index (no ``gather`` stage) and adds the routed half per tile of
    one expert's queries, merged by log-sum-exp. s > 1 runs ``route``, ``gather`` and
    ``attention`` as the PyTorch stages. Peak extra memory for s = 1, beyond q, k, v and the
    output: B·H·(m·(2·d + dv + k) + 3·N) elements (landmarks and their scaled copy, shared
    values, expert indices; per query its expert, shared-branch maximum and sum) plus per
    thread 256·(d + k + dv) + k·(d + dv) — linear in N, no N × m or N × k block."""
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    B, H, N, d = q.shape
    # True = a real token; it masks keys and, in self-attention, queries too.
    token_valid = None if key_padding_mask is None else ~key_padding_mask
    with hook.stage("pool"):
        landmarks, landmark_valid = A.pool(q, m, key_padding_mask, landmark_grid)
    with hook.stage("landmark_scores"):
        expert_index, shared_values = ext.landmark_pass(
            landmarks=landmarks * d ** -0.5, k=k, v=v, token_valid=token_valid, topk=topk)
    if s > 1:  # the PyTorch stages: per-slot partials merged by log-sum-exp
        with hook.stage("route"):
            experts = A.route(q, landmarks, s, landmark_valid)
        return A.gather_and_attend(q, k, v, landmarks, landmark_valid, shared_values,
                                   expert_index, experts, shared_scale, key_padding_mask, hook)
    with hook.stage("route"):
        experts, out, top, total = ext.route_shared(
            q=q, landmarks=landmarks, landmark_valid=landmark_valid, shared_values=shared_values,
            c_shared=A.shared_logit_scale(d, shared_scale), token_valid=token_valid)
    with hook.stage("attention"):  # gather is fused into this kernel
        ext.routed_attention(q=q, k=k, v=v, expert_index=expert_index,
                             landmark_valid=landmark_valid, token_valid=token_valid,
                             experts=experts, scale=d ** -0.5, acc=out, mx=top, sum=total)
    return out
