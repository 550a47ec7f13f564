"""MiTA attention, the long-sequence classifier, its data and training."""

from .attention import dense_attention, mita_attention
from .config import ModelConfig
from .cost import dense_flops, mita_flops, mita_stage_flops
from .hooks import MITA_STAGES, MODEL_STAGES, NULL_HOOK, StageHook
from .layers import DenseAttention, MiTAAttention

__all__ = [
    "DenseAttention", "MiTAAttention", "ModelConfig", "dense_attention", "dense_flops",
    "mita_attention", "mita_flops", "mita_stage_flops", "MITA_STAGES", "MODEL_STAGES",
    "NULL_HOOK", "StageHook",
]
