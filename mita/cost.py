"""The analytic cost model of MiTA and dense attention (arXiv:2602.01219 §3.1-3.3): FLOPs per
head and sequence, by stage. The profiler divides measured time by these."""

from __future__ import annotations

import math

from .attention import clamp_topk


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
