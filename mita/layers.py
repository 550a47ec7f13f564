"""Multi-head attention modules: ``DenseAttention`` and ``MiTAAttention`` share their parameters
(``qkv``, ``out_proj``), so one state_dict serves both (the paper's swap without training)."""

from __future__ import annotations

from torch import Tensor, nn

from .attention import dense_attention, mita_attention
from .config import ModelConfig, check_backend
from .hooks import NULL_HOOK, StageHook


class _MultiHeadAttention(nn.Module):
    """Shared projections of ``DenseAttention`` and ``MiTAAttention``: the two have identical
    parameter names and shapes (``qkv``: dim → 3·dim, ``out_proj``: dim → dim), so one
    state_dict loads into both."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.num_heads = cfg.num_heads  # ModelConfig checked that it divides dim
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim)
        self.out_proj = nn.Linear(cfg.dim, cfg.dim)

    def forward(self, x: Tensor, key_padding_mask: Tensor | None = None,
                hook: StageHook = NULL_HOOK, check_mask: bool = True) -> Tensor:
        """``x`` ``(B, N, dim)`` → ``(B, N, dim)``; stages ``qkv_proj``, attention's stages,
        ``out_proj``. ``check_mask=False``: the caller checked ``key_padding_mask`` already
        (``EncoderClassifier``, once per forward)."""
        B, N, dim = x.shape
        with hook.stage("qkv_proj"):
            q, k, v = self.qkv(x).view(B, N, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4)
        o = self.attend(q, k, v, key_padding_mask, hook, check_mask)
        with hook.stage("out_proj"):
            return self.out_proj(o.transpose(1, 2).reshape(B, N, dim))

    def attend(self, q, k, v, key_padding_mask, hook, check_mask):
        raise NotImplementedError


class DenseAttention(_MultiHeadAttention):
    """Multi-head dense attention; reports its SDPA call as stage ``attention``."""

    def attend(self, q, k, v, key_padding_mask, hook, check_mask):
        with hook.stage("attention"):
            return dense_attention(q, k, v, key_padding_mask, check_mask)


class MiTAAttention(_MultiHeadAttention):
    """Multi-head MiTA attention (``mita_attention``) with the same parameters as
    ``DenseAttention``; m, k, s, ``shared_scale`` and ``landmark_grid`` come from the
    (already validated) ``ModelConfig``. ``backend`` as in ``mita_attention`` (``"auto"``:
    the fused Triton kernel on CUDA, the compiled kernels or PyTorch stages on CPU). Raises
    ValueError for an unknown backend."""

    def __init__(self, cfg: ModelConfig, backend: str = "auto"):
        super().__init__(cfg)
        check_backend(backend)
        self.cfg = cfg
        self.backend = backend  # plain attribute: the profiler switches it per run

    def attend(self, q, k, v, key_padding_mask, hook, check_mask):
        c = self.cfg
        return mita_attention(q, k, v, num_landmarks=c.num_landmarks, topk=c.topk,
                              route_topk=c.route_topk, key_padding_mask=key_padding_mask,
                              landmark_grid=c.landmark_grid, shared_scale=c.shared_scale,
                              backend=self.backend, hook=hook, check_mask=check_mask)
