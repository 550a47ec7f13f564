"""Multi-head attention modules: ``DenseAttention`` and ``MiTAAttention`` share their parameters
(``qkv``, ``out_proj``), so one state_dict serves both (the paper's swap without training)."""

from __future__ import annotations

from torch import Tensor, nn

from .attention import BACKENDS, SHARED_SCALES, dense_attention, mita_attention
from .hooks import NULL_HOOK, StageHook


class _MultiHeadAttention(nn.Module):
    """Shared projections of ``DenseAttention`` and ``MiTAAttention``: the two have identical
    parameter names and shapes (``qkv``: dim → 3·dim, ``out_proj``: dim → dim), so one
    state_dict loads into both."""

    def __init__(self, dim: int, num_heads: int):
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"dim {dim} is not divisible by num_heads {num_heads}")
        self.num_heads = num_heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out_proj = nn.Linear(dim, dim)

    def forward(self, x: Tensor, key_padding_mask: Tensor | None = None,
                hook: StageHook = NULL_HOOK) -> Tensor:
        """``x`` ``(B, N, dim)`` → ``(B, N, dim)``; stages ``qkv_proj``, attention's stages,
        ``out_proj``."""
        B, N, dim = x.shape
        with hook.stage("qkv_proj"):
            q, k, v = self.qkv(x).view(B, N, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4)
        o = self.attend(q, k, v, key_padding_mask, hook)
        with hook.stage("out_proj"):
            return self.out_proj(o.transpose(1, 2).reshape(B, N, dim))

    def attend(self, q, k, v, key_padding_mask, hook):
        raise NotImplementedError


class DenseAttention(_MultiHeadAttention):
    """Multi-head dense attention; reports its SDPA call as stage ``attention``."""

    def attend(self, q, k, v, key_padding_mask, hook):
        with hook.stage("attention"):
            return dense_attention(q, k, v, key_padding_mask)


class MiTAAttention(_MultiHeadAttention):
    """Multi-head MiTA attention (``mita_attention``) with the same parameters as
    ``DenseAttention``. ``backend`` as in ``mita_attention`` (``"auto"``: the fused Triton
    kernel on CUDA, PyTorch stages on CPU)."""

    def __init__(self, dim: int, num_heads: int, num_landmarks: int, topk: int,
                 route_topk: int = 1, shared_scale: str = "paper",
                 landmark_grid: tuple[int, int] | None = None, backend: str = "auto"):
        super().__init__(dim, num_heads)
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        if shared_scale not in SHARED_SCALES:
            raise ValueError(f"shared_scale must be one of {SHARED_SCALES}, got {shared_scale!r}")
        if route_topk > num_landmarks:
            raise ValueError(f"route_topk s={route_topk} exceeds num_landmarks m={num_landmarks}")
        self.num_landmarks, self.topk, self.route_topk = num_landmarks, topk, route_topk
        self.shared_scale, self.landmark_grid = shared_scale, landmark_grid
        self.backend = backend  # plain attribute: the profiler switches it per run

    def attend(self, q, k, v, key_padding_mask, hook):
        return mita_attention(q, k, v, num_landmarks=self.num_landmarks, topk=self.topk,
                              route_topk=self.route_topk, key_padding_mask=key_padding_mask,
                              landmark_grid=self.landmark_grid,
                              shared_scale=self.shared_scale, backend=self.backend,
                              hook=hook)
