"""MiTA kernels: ``fused_attention`` (Triton, GPU) and ``cpu`` (compiled C++ CPU kernels).

Both are imported lazily by ``mita.attention``. The Triton module is imported only on first
access to ``fused_attention``: Triton reads ``TRITON_INTERPRET`` when a kernel is defined, so
importing ``mita.kernels.cpu`` must not define the Triton kernels early.
"""

__all__ = ["MAX_HEAD_DIM", "fused_attention"]

MAX_HEAD_DIM = 128  # the fused kernel's largest head dim (BLOCK_D ≤ 128; see mita_attention.py)


def __getattr__(name):
    if name == "fused_attention":
        from .mita_attention import fused_attention

        return fused_attention
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
