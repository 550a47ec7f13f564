"""The CPU MiTA kernels (``cpu_mita.cpp``), compiled on first use with
``torch.utils.cpp_extension.load`` (needs a C++ compiler and ninja; about a minute once per
machine, then loaded from the build cache in ``$MITA_CPU_BUILD_DIR`` or
``~/.cache/mita-serve/cpu-kernels``).

``load()`` returns the extension module or None when it cannot be built (no compiler): MiTA
then runs its PyTorch stages and logs why once.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from pathlib import Path

import torch

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
