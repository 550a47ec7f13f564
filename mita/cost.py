"""The analytic cost model of MiTA and dense attention (arXiv:2602.01219 §3.1-3.3): FLOPs per
head and sequence, by stage; FLOPs of one classifier forward by stage; a labelled memory
estimate. The profiler divides measured time by these.

FLOPs count a multiply-add as 2 (§3.2 cost model: N(2m+sk) similarity scores for MiTA vs N²
for dense, times 2d, plus value sums). A forward's cost is computed on the padded batch shape
``(B, N)`` — the work the hardware does.
"""

from __future__ import annotations

import math

import torch

from .config import ModelConfig, clamp_topk


def mita_stage_flops(N: int, m: int, k: int, s: int = 1, d: int = 64) -> dict[str, int]:
    """Analytic FLOPs of one MiTA head on one sequence, by stage (§3.2 cost model).

    A multiply-add counts 2 FLOPs. Similarity scores: N·m landmark×key (``landmark_scores``),
    N·m query×landmark (``route``; the paper reuses them as shared logits — this
    implementation recomputes them inside ``attention``, 2·N·m·d FLOPs not counted here, to
    avoid storing N×m affinities), N·s·k query×routed key
    (``attention``) — N(2m+sk) in all, as in the paper, times 2d. Value sums: m·N for
    ``shared_compress`` and N(m+sk) in ``attention``, times 2d. ``pool`` adds N·d.
    Not counted: softmax exponentials, top-k selection, gathers, memory traffic. k is clamped
    to N as in ``mita_attention``.
    """
    k = clamp_topk(k, N)
    return {
        "pool": N * d,
        "landmark_scores": 2 * N * m * d,
        "topk": 0,
        "shared_compress": 2 * N * m * d,
        "route": 2 * N * m * d,
        "gather": 0,
        "attention": 2 * N * s * k * d + 2 * N * (m + s * k) * d,
    }


def mita_flops(N: int, m: int, k: int, s: int = 1, d: int = 64) -> int:
    """Total analytic FLOPs of one MiTA head on one sequence: ``sum(mita_stage_flops(...))``
    = 2dN(4m + 2sk) + Nd."""
    return sum(mita_stage_flops(N, m, k, s, d).values())


def dense_flops(N: int, d: int = 64) -> int:
    """Analytic FLOPs of one dense attention head on one sequence: N² scores and N² value
    multiply-adds, 4N²d (§3.1)."""
    return 4 * N * N * d


def fig5_setting(n: int) -> tuple[int, int]:
    """(m, k) of the paper's Fig. 5 setting for sequence length ``n``: m = k = the power of two
    nearest √(n/4), so m·k ≈ n/4 (at least 1). Raises ValueError for n < 1."""
    if n < 1:
        raise ValueError(f"sequence length must be ≥ 1, got {n}")
    side = max(1, 2 ** round(math.log2(math.sqrt(n / 4))))
    return side, side


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
