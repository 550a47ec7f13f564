"""Multi-head attention modules: ``DenseAttention`` and ``MiTAAttention`` share their parameters
(``qkv``, ``out_proj``), so one state_dict serves both (the paper's swap without training).
``ATTENTION_MODULES`` maps each of ``config.ATTENTIONS`` to its module class: the one place the
model looks an attention up.

The modules call ``mita.attention``'s unchecking kernels (``mita_attention_unchecked``,
``dense_attention`` with ``check_mask=False``): the setting was checked once by
``ModelConfig``, the backend where it is set (``MiTAAttention.backend``) and the padding mask
once per forward (``EncoderClassifier.forward``), not again in every layer of every forward."""

from __future__ import annotations

from torch import Tensor, nn

from .attention import dense_attention, mita_attention_unchecked
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
    the fused Triton kernel on CUDA, the compiled kernels or PyTorch stages on CPU); it may be
    set again later (the profiler and the engine switch it per run, ``set_mita_backend``).
    Raises ValueError for an unknown backend, at construction or when set."""

    def __init__(self, cfg: ModelConfig, backend: str = "auto"):
        super().__init__(cfg)
        self.cfg = cfg
        self.backend = backend  # checked by the setter

    @property
    def backend(self) -> str:
        """The MiTA backend name (``config.BACKENDS``) every forward of this layer runs."""
        return self._backend

    @backend.setter
    def backend(self, backend: str) -> None:
        # The one check of the backend: attend() calls the unchecking mita_attention_unchecked, so a
        # bad name must be refused here, where it is set, not in the middle of a forward.
        check_backend(backend)
        self._backend = backend

    def attend(self, q, k, v, key_padding_mask, hook, check_mask):
        c = self.cfg
        # Shapes from qkv's view, setting from ModelConfig, backend from the setter: all
        # checked already, so the kernel without mita_attention's checks (same results).
        return mita_attention_unchecked(q, k, v, num_landmarks=c.num_landmarks, topk=c.topk,
                               route_topk=c.route_topk, key_padding_mask=key_padding_mask,
                               landmark_grid=c.landmark_grid, shared_scale=c.shared_scale,
                               backend=self._backend, hook=hook, check_mask=check_mask)


# Each name of config.ATTENTIONS → its module (EncoderClassifier's blocks look it up here;
# tests/no_ray/test_model_checks.py checks that the keys are ATTENTIONS).
ATTENTION_MODULES: dict[str, type[_MultiHeadAttention]] = {
    "dense": DenseAttention, "mita": MiTAAttention}
