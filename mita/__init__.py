"""MiTA attention, the long-sequence classifier, its data and training."""

from .attention import (
    DenseAttention,
    MiTAAttention,
    dense_attention,
    dense_flops,
    mita_attention,
    mita_flops,
    mita_stage_flops,
)
from .hooks import MITA_STAGES, MODEL_STAGES, NULL_HOOK, StageHook

__all__ = [
    "DenseAttention", "MiTAAttention", "dense_attention", "dense_flops", "mita_attention",
    "mita_flops", "mita_stage_flops", "MITA_STAGES", "MODEL_STAGES", "NULL_HOOK", "StageHook",
]
