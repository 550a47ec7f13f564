"""MiTA as a Hugging Face transformers attention implementation (transformers ≥ 5).

transformers' models that dispatch attention through ``AttentionInterface`` (BERT, RoBERTa,
DistilBERT, ELECTRA, ModernBERT, ViT, DeiT, BEiT, DINOv2, …) call
``fn(module, query, key, value, attention_mask, dropout=, scaling=, **kw)`` with q, k, v
``(B, H, N, d)`` and take back ``(output (B, N, H, d), None)``. ``register()`` adds:

- ``"mita"``: ``mita_attention`` (§3.2, eqs. 5-12) with the setting in ``module.config.mita``
  (``PretrainedSetting``). Layers that pass ``sliding_window`` (ModernBERT's local layers,
  already linear in N) keep their windowed SDPA: MiTA replaces global attention only.
- ``"mita_dense"``: transformers' SDPA attention, unchanged, inside ``hook.stage("attention")``.

Both names are also registered with ``AttentionMaskInterface``: without that, transformers
drops the padding mask (None) for an implementation it does not know. For a plain
bidirectional mask the mask function hands the attention the ``(B, N)`` padding mask itself
(MiTA's ``key_padding_mask``, no N × N mask built); any other mask (sliding window, packed
sequences) is built as SDPA's boolean mask, which MiTA accepts only when it is a padding mask.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import math
from contextvars import ContextVar
from dataclasses import dataclass

import torch
from torch import Tensor

from ..attention import mita_attention
from ..config import check_backend, check_grid, check_setting
from ..hooks import NULL_HOOK, StageHook

# The product's attention names → transformers' ``attn_implementation`` names.
IMPLEMENTATIONS = {"mita": "mita", "dense": "mita_dense"}
# The key of the MiTA setting in a transformers config (and its config.json).
CONFIG_KEY = "mita"

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PretrainedSetting:
    """The MiTA setting of a transformers model, kept in ``config.mita``.

    ``num_landmarks`` m, ``topk`` k, ``route_topk`` s, ``shared_scale`` as in
    ``mita_attention``; ``landmark_grid`` None (1-D pooling of the token sequence, for text)
    or ``(H, W)``: 2-D pooling over the **first** H·W tokens in row-major order — for a ViT
    (class token first, then the patches) that is the authors' DeiT code: the class token takes
    the grid's first cell, the patches follow shifted by one, and the last N − H·W patches are
    queries and keys but pool into no landmark. ``backend`` as in ``mita_attention``.
    Raises ValueError naming a bad field.
    """

    num_landmarks: int = 16
    topk: int = 16
    route_topk: int = 1
    shared_scale: str = "paper"
    landmark_grid: tuple[int, int] | None = None
    backend: str = "auto"

    def __post_init__(self):
        check_setting(self.num_landmarks, self.topk, self.route_topk, self.shared_scale)
        check_backend(self.backend)
        if self.landmark_grid is not None:
            object.__setattr__(self, "landmark_grid",
                               check_grid(self.landmark_grid, self.num_landmarks))

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["landmark_grid"] = None if self.landmark_grid is None else list(self.landmark_grid)
        return d

    @classmethod
    def from_dict(cls, data: dict) -> PretrainedSetting:
        """Raises ValueError naming unknown fields or a bad value."""
        if not isinstance(data, dict):
            raise ValueError(f"the MiTA setting must be an object, got {data!r}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown MiTA setting field(s) {unknown}; known: {sorted(known)}")
        return cls(**data)


def setting_of(config) -> PretrainedSetting:
    """The ``PretrainedSetting`` in a transformers config's ``mita`` entry. Raises ValueError
    when there is none (``use_attention(model, "mita", setting)`` writes it) or it is bad."""
    data = getattr(config, CONFIG_KEY, None)
    if data is None:
        raise ValueError(f"{type(config).__name__} has no MiTA setting ('{CONFIG_KEY}'): "
                         "use mita.pretrained.use_attention(model, 'mita', setting)")
    return data if isinstance(data, PretrainedSetting) else PretrainedSetting.from_dict(data)


class _Forward:
    """What the attention calls of one forward share: the hook and a count of the calls (the
    layer index the stages are recorded under: an encoder calls its layers in order)."""

    __slots__ = ("hook", "calls")

    def __init__(self, hook: StageHook):
        self.hook, self.calls = hook, 0


_CURRENT: ContextVar[_Forward | None] = ContextVar("mita_pretrained_forward", default=None)


@contextlib.contextmanager
def stage_hook(hook: StageHook):
    """Within (this thread or task): the transformers model's MiTA and dense attention calls
    run their stages inside ``hook`` (a ``mita.timer.StageTimer``), the i-th attention call of
    the forward as layer i. One ``with`` per forward."""
    token = _CURRENT.set(_Forward(hook))
    try:
        yield
    finally:
        _CURRENT.reset(token)


def _layer_hook():
    forward = _CURRENT.get()
    if forward is None:
        return NULL_HOOK, contextlib.nullcontext()
    index, forward.calls = forward.calls, forward.calls + 1
    return forward.hook, forward.hook.layer(index)


def key_padding_mask(attention_mask: Tensor | None, batch: int, n: int) -> Tensor | None:
    """MiTA's ``(B, N)`` key padding mask (True = padding) from what transformers passes:
    None; the ``(B, N)`` bool mask of ``_mask`` (True = attend); or a 4-D mask
    ``(B, 1 or H, N, N)`` that must be a pure padding mask (every query row the same, every
    head the same) — bool (True = attend) or additive float (0 = attend, ≤ dtype min / 2 =
    masked). Raises ValueError for anything else (a causal, windowed or biased mask)."""
    if attention_mask is None:
        return None
    mask = attention_mask
    if mask.dim() == 2:
        if mask.shape != (batch, n):
            raise ValueError(f"attention mask {tuple(mask.shape)} does not match the "
                             f"sequence ({batch}, {n})")
        return ~mask.bool()
    if mask.dim() != 4 or mask.shape[0] != batch or mask.shape[-1] != n:
        raise ValueError(f"MiTA takes a (B, N) padding mask or a 4-D padding mask; got "
                         f"{tuple(mask.shape)} for ({batch}, {n}) — an attention bias (e.g. "
                         "a relative position bias) cannot be added to MiTA's joint softmax")
    if mask.dtype != torch.bool:
        keep = mask > torch.finfo(mask.dtype).min / 2
        if bool((mask[keep] != 0).any()):
            raise ValueError("MiTA takes a padding mask, not an additive attention bias")
        mask = keep
    valid = mask[:, 0, -1, :]  # the last query row: a padded query's row is still its keys'
    if not bool((mask == valid[:, None, None, :]).all()):
        raise ValueError("MiTA's attention here takes a padding mask only (every query sees "
                         "the same keys): a causal, sliding-window or packed-sequence mask "
                         "is not MiTA's joint softmax")
    return ~valid


def mita_attention_forward(module, query: Tensor, key: Tensor, value: Tensor,
                           attention_mask: Tensor | None, dropout: float = 0.0,
                           scaling: float | None = None, is_causal: bool | None = None,
                           sliding_window: int | None = None, **kwargs):
    """transformers' attention call (``AttentionInterface``) computed by ``mita_attention``
    with ``setting_of(module.config)``.

    Args: ``query``, ``key`` ``(B, H, N, d)``, ``value`` ``(B, H, N, dv)`` (key/value heads
    repeated when fewer, as grouped-query attention); ``attention_mask`` as
    ``key_padding_mask`` takes; ``scaling`` must be d^-1/2, the scale eqs. 6 and 11 use;
    ``sliding_window``: not None → transformers' SDPA with that window (ModernBERT's local
    layers). ``dropout`` is not applied: the joint softmax's probabilities are never
    materialised (logged once).
    Returns: ``(output (B, N, H, dv), None)`` in the input dtype.
    Raises: ValueError — a causal layer, cross-attention (query and key lengths differ),
    another scaling, a mask that is not a padding mask, an all-padding row, or a bad setting.
    """
    if sliding_window is not None:
        return dense_attention_forward(module, query, key, value, attention_mask,
                                       dropout=dropout, scaling=scaling, is_causal=is_causal,
                                       sliding_window=sliding_window, **kwargs)
    if getattr(module, "is_cross_attention", False) or "CrossAttention" in type(module).__name__:
        raise ValueError(f"MiTA is self-attention: {type(module).__name__} is a "
                         "cross-attention layer")
    if is_causal or getattr(module, "is_causal", False):
        raise ValueError(f"MiTA attention is bidirectional: {type(module).__name__} is a "
                         "causal (decoder) layer")
    B, H, N, d = query.shape
    if key.shape[2] != N:
        raise ValueError(f"MiTA is self-attention: {N} queries but {key.shape[2]} keys "
                         f"in {type(module).__name__}")
    if key.shape[1] != H:  # grouped-query attention: each key/value head serves H/Hkv heads
        key = key.repeat_interleave(H // key.shape[1], dim=1)
        value = value.repeat_interleave(H // value.shape[1], dim=1)
    if scaling is not None and not math.isclose(scaling, d ** -0.5, rel_tol=1e-6):
        raise ValueError(f"{type(module).__name__} scales logits by {scaling}, not d^-1/2 = "
                         f"{d ** -0.5:.6g}: MiTA's scores (eqs. 6, 11) use d^-1/2")
    if dropout:
        _warn_dropout()
    s = setting_of(module.config)
    mask = key_padding_mask(attention_mask, B, N)
    hook, layer = _layer_hook()
    with layer:
        out = mita_attention(query, key, value, num_landmarks=s.num_landmarks, topk=s.topk,
                             route_topk=s.route_topk, key_padding_mask=mask,
                             landmark_grid=s.landmark_grid, shared_scale=s.shared_scale,
                             backend=s.backend, hook=hook)
    return out.transpose(1, 2).contiguous(), None


@functools.cache
def _warn_dropout() -> None:
    log.warning("MiTA attention applies no attention dropout (the model's attention dropout "
                "is > 0 in training mode): its joint softmax's probabilities are never "
                "materialised")


def dense_attention_forward(module, query: Tensor, key: Tensor, value: Tensor,
                            attention_mask: Tensor | None, **kwargs):
    """transformers' own SDPA attention (``sdpa_attention_forward``) inside the stage hook's
    ``attention`` stage; a ``(B, N)`` padding mask (``_mask``) is broadcast to SDPA's
    ``(B, 1, 1, N)``. Returns and raises as transformers' SDPA attention."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if attention_mask is not None and attention_mask.dim() == 2:
        attention_mask = attention_mask.bool()[:, None, None, :]
    hook, layer = _layer_hook()
    with layer, hook.stage("attention"):
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def _mask(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0,
          kv_offset: int = 0, mask_function=None, attention_mask: Tensor | None = None,
          **kwargs):
    """The mask function of both implementations (``AttentionMaskInterface``): for a plain
    bidirectional mask, the ``(B, N)`` bool padding mask (True = attend), or None without
    padding; any other mask as SDPA's 4-D boolean mask (``sdpa_mask``)."""
    from transformers.masking_utils import bidirectional_mask_function, sdpa_mask

    plain = (mask_function is bidirectional_mask_function and q_offset == kv_offset == 0
             and q_length == kv_length)
    if plain and (attention_mask is None or attention_mask.shape == (batch_size, kv_length)):
        if attention_mask is None or bool(attention_mask.all()):
            return None
        return attention_mask.bool()
    return sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length,
                     q_offset=q_offset, kv_offset=kv_offset, mask_function=mask_function,
                     attention_mask=attention_mask, **kwargs)


@functools.cache
def register() -> None:
    """Register ``"mita"`` and ``"mita_dense"`` with transformers' ``AttentionInterface`` and
    ``AttentionMaskInterface`` (once per process). Raises ImportError without transformers
    (``pip install 'mita-serve[pretrained]'``)."""
    try:
        from transformers import AttentionInterface, AttentionMaskInterface
    except ImportError as e:
        raise ImportError("MiTA in a transformers model needs the 'pretrained' extra: "
                          "pip install -e '.[pretrained]'") from e
    AttentionInterface.register(IMPLEMENTATIONS["mita"], mita_attention_forward)
    AttentionInterface.register(IMPLEMENTATIONS["dense"], dense_attention_forward)
    for name in IMPLEMENTATIONS.values():
        AttentionMaskInterface.register(name, _mask)


def use_attention(model, attention: str, setting: PretrainedSetting | None = None) -> None:
    """Switch a loaded transformers model to ``attention`` (``"mita"`` or ``"dense"``), the
    same weights (the paper's swap without training, §4.4). ``setting`` (MiTA) is written to
    ``model.config.mita``; without it the model's own setting stays (ValueError when it has
    none and ``attention`` is ``"mita"``).
    Raises ValueError for another attention name or a model class that does not dispatch
    attention through ``AttentionInterface`` (DeBERTa, Longformer, BigBird, …)."""
    if attention not in IMPLEMENTATIONS:
        raise ValueError(f"attention must be one of {sorted(IMPLEMENTATIONS)}, got "
                         f"{attention!r}")
    if not getattr(model, "_supports_attention_backend", False):
        raise ValueError(f"{type(model).__name__} does not dispatch its attention through "
                         "transformers' AttentionInterface, so MiTA cannot be put into it "
                         "(supported: BERT, RoBERTa, DistilBERT, ELECTRA, ModernBERT, ViT, "
                         "DeiT, BEiT, DINOv2 and the other families that do)")
    register()
    if setting is not None:
        setattr(model.config, CONFIG_KEY, setting.to_dict())
    if attention == "mita":
        setting_of(model.config)  # refused now, not in the middle of a forward
    model.set_attn_implementation(IMPLEMENTATIONS[attention])
