"""Analytic cost of one classifier forward, by stage (FLOPs) and a labelled memory estimate.

FLOPs count a multiply-add as 2 and follow ``mita.attention.mita_stage_flops`` /
``dense_flops`` (§3.2 cost model: N(2m+sk) similarity scores for MiTA vs N² for dense, times
2d, plus value sums). Everything is computed on the padded batch shape ``(B, N)`` — the work
the hardware does.
"""

from __future__ import annotations

import torch

from mita.attention import clamp_topk
from mita.cost import dense_flops, mita_stage_flops
from mita.model import EncoderClassifier, ModelConfig

from .timer import ForwardProfile, StageTimer


def usable_device(device: str, tool: str) -> torch.device:
    """``device`` (``cpu``, ``cuda`` or ``cuda:N``) as a torch device that ``tool`` (the sweep,
    the advisor) can run on here. Raises ValueError naming the device: not a torch device, not
    cpu or cuda, or a CUDA device this torch does not see."""
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise ValueError(f"device {device!r} is not a torch device (cpu, cuda, cuda:N)"
                         ) from None
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device {device!r}: {tool} runs on cpu or cuda")
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if dev.type == "cuda" and (dev.index or 0) >= count:
        raise ValueError(f"device {device!r}: this torch ({torch.__version__}) sees {count} "
                         "CUDA device(s)")
    return dev


def model_stage_flops(cfg: ModelConfig, batch: int, n: int) -> dict[str, int]:
    """Analytic FLOPs per stage for a ``(batch, n)`` forward of a model with config ``cfg``.

    Stages: ``embed`` (position add), ``qkv_proj``, MiTA's seven stages or dense
    ``attention``, ``out_proj``, ``ffn``, ``head`` (mean pooling + linear); summed over layers.
    """
    dim, heads = cfg.dim, cfg.num_heads
    d = dim // heads
    per_layer = {"qkv_proj": 2 * n * dim * 3 * dim}
    if cfg.attention == "mita":
        for stage, f in mita_stage_flops(n, cfg.num_landmarks, cfg.topk, cfg.route_topk,
                                         d).items():
            per_layer[stage] = heads * f
    else:
        per_layer["attention"] = heads * dense_flops(n, d)
    per_layer["out_proj"] = 2 * n * dim * dim
    per_layer["ffn"] = 2 * 2 * n * dim * cfg.ffn_dim
    out = {"embed": batch * n * dim}
    out.update({s: batch * cfg.depth * f for s, f in per_layer.items()})
    out["head"] = batch * (n * dim + 2 * dim * cfg.num_classes)
    return out


def activation_bytes_estimate(cfg: ModelConfig, batch: int, n: int,
                              dtype: torch.dtype = torch.float32) -> int:
    """Analytic estimate (not a measurement) of peak activation bytes of one layer's forward:
    the hidden tensors (x, qkv, attention output, FFN hidden) plus the attention intermediates —
    MiTA: two m×N score tensors, N×m affinity and shared weights, the expert-grouped blocks
    (≤ 2·N·s rows of k logits, k weights, d query and dv output entries); dense: one N×N score
    matrix per head (an upper bound: fused SDPA kernels avoid it)."""
    dim, heads = cfg.dim, cfg.num_heads
    d = dim // heads
    hidden = n * (dim + 3 * dim + dim + cfg.ffn_dim)
    if cfg.attention == "mita":
        m, k, s = cfg.num_landmarks, clamp_topk(cfg.topk, n), cfg.route_topk
        attn = heads * (2 * m * n + 2 * n * m + 2 * n * s * (2 * k + 2 * d))
    else:
        attn = heads * n * n
    return batch * (hidden + attn) * torch.empty((), dtype=dtype).element_size()


def profile_forward(model: EncoderClassifier, ids: torch.Tensor,
                    key_padding_mask: torch.Tensor | None = None, replay=None
                    ) -> tuple[torch.Tensor, ForwardProfile]:
    """Run ``model(ids, key_padding_mask)`` under a fresh ``StageTimer`` on the ids' device.

    ``replay``: optional ``(ids, mask) -> logits | None`` tried first (``service.graphs``: a
    CUDA-graph replay, timed as a whole — its profile has no stages); None falls back to the
    hooked forward.
    Returns the logits ``(B, num_classes)`` and the ``ForwardProfile`` with analytic FLOPs and
    peak memory (CUDA: measured; CPU: ``activation_bytes_estimate``).
    """
    timer = StageTimer(ids.device)
    with torch.no_grad(), timer.forward():
        logits = None if replay is None else replay(ids, key_padding_mask)
        if logits is None:
            logits = model(ids, key_padding_mask, hook=timer)
    B, N = ids.shape
    dtype = next(model.parameters()).dtype
    profile = timer.result(flops=model_stage_flops(model.config, B, N),
                           activation_bytes=activation_bytes_estimate(model.config, B, N, dtype))
    return logits, profile
