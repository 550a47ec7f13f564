"""MiTA kernels: the Triton launcher ``triton_mita`` (GPU) and ``cpu`` (compiled C++ CPU kernels),
each beside its kernels, and the limits they share.

Both launchers are imported lazily by ``mita.attention`` (within ``mita``, the only module
above that imports this package's modules; the service reads the limits and the top-k
chooser's report). This file imports none of them: Triton reads ``TRITON_INTERPRET`` when
a kernel is defined, so importing ``mita.kernels`` or ``mita.kernels.cpu`` must not define the
Triton kernels early.
"""

import re

__all__ = ["MAX_GRID_Y", "MAX_HEAD_DIM", "TRITON_FLOOR", "triton_supported"]

MAX_GRID_Y = 65535  # CUDA's limit on a grid's second axis, where most kernels put B·H
MAX_HEAD_DIM = 128  # the fused kernel's largest head dim (BLOCK_D ≤ 128; see triton_fused.py)
# routing._landmark_topk_kernel calls tl.sort(dim=1) on a 2-D tensor and tl.bitonic_merge, which
# came with Triton 3.4 (triton-lang/triton#6461: the 3.3.1 wheel's standard.py has no
# bitonic_merge, 3.4.0's has it); topk's filter (_select_pass_kernel, PHASE 1) uses the old
# values tl.atomic_add returns, which reach every thread holding an element only since
# triton-lang/triton#7460 (fixing #7402: before it, threads but one read 0), after the 3.4.0
# release (triton-lang/triton#7957): so 3.5.
TRITON_FLOOR = (3, 5)


def triton_supported() -> str | None:
    """None when the installed Triton can run the Triton MiTA kernels, else the reason (not
    installed, or ``triton.__version__`` older than ``TRITON_FLOOR``). Reads the version only:
    the kernels are not imported (nor defined)."""
    try:
        import triton
    except ImportError:
        return "Triton is not installed"
    version = getattr(triton, "__version__", "")
    found = re.match(r"(\d+)\.(\d+)", version)
    floor = ".".join(map(str, TRITON_FLOOR))
    if found is None or (int(found[1]), int(found[2])) < TRITON_FLOOR:
        return (f"Triton {version or '(no version)'} is installed; the Triton MiTA kernels "
                f"need triton>={floor} (tl.bitonic_merge, atomic_add results)")
    return None
