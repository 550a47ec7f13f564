"""GPU kernels for MiTA (Triton). Imported lazily by ``mita.attention``: Triton is needed only
when the fused path runs (CUDA tensors, or the CPU interpreter with ``TRITON_INTERPRET=1``)."""

from .mita_attention import fused_attention

__all__ = ["fused_attention"]
