"""MiTA (Mixture-of-Top-k Attention) and dense attention on ``(B, H, N, d)`` tensors.

Source: Wen et al., *Mixture-of-Top-k Attention: Efficient Attention via Scalable Fast Weights*,
arXiv:2602.01219 v6, §3.1 (dense, eqs. 1-4) and §3.2 (MiTA, eqs. 5-12).

MiTA is written as seven stage functions named after the profiler's stages; ``mita_attention``
runs them in order, each inside ``hook.stage(name)``:

``pool``            average-pool the *queries* into m landmark queries q̃ (eq. 5)
``landmark_scores`` s_ij = q̃_i·k_j/√d for every key (eq. 6)
``topk``            the k best keys of each landmark form routed expert i (eq. 7)
``shared_compress`` ṽ_i = Σ_j softmax(s_i)_j v_j over all N values; shared key = q̃_i (eq. 8)
``route``           each query picks its top-s landmarks by q·q̃_i, no gate (eq. 9)
``gather``          the k raw (key, value) pairs of every expert (eq. 10)
``attention``       one softmax over the m shared + s·k routed entries (eqs. 11-12)

Conventions: ``key_padding_mask`` is ``(B, N)`` bool with ``True`` marking padding (as in
``torch.nn.MultiheadAttention``); it masks keys and, since this is self-attention, queries.
Outputs at padded query positions are zero. float16/bfloat16 inputs are computed in float32
and the output cast back.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .hooks import NULL_HOOK, StageHook

SHARED_SCALES = ("paper", "official")


def _valid_tokens(key_padding_mask: Tensor | None, B: int, N: int, device) -> Tensor:
    """``(B, N)`` bool, True where a token is real. Raises ValueError on a bad mask."""
    if key_padding_mask is None:
        return torch.ones(B, N, dtype=torch.bool, device=device)
    if key_padding_mask.dtype != torch.bool:
        raise ValueError(f"key_padding_mask must be bool, got {key_padding_mask.dtype}")
    if tuple(key_padding_mask.shape) != (B, N):
        raise ValueError(f"key_padding_mask must have shape {(B, N)}, "
                         f"got {tuple(key_padding_mask.shape)}")
    valid = ~key_padding_mask
    empty = (~valid.any(-1)).nonzero().flatten().tolist()
    if empty:
        raise ValueError(f"batch rows {empty} are all padding: nothing to attend to")
    return valid


def _topk_lowest_index(scores: Tensor, k: int) -> Tensor:
    """Indices of the k largest entries of ``scores`` along the last dim, ties broken by the
    lowest index, returned in ascending index order. ``(..., N) -> (..., k)`` int64.

    ``torch.topk`` leaves tie order unspecified (and it differs between CPU and CUDA), so when
    the k-th value is tied the selection is rebuilt exactly: everything above the k-th value,
    then the lowest-index entries equal to it.
    """
    top = scores.topk(k, dim=-1, sorted=False)
    kth = top.values.amin(-1, keepdim=True)
    equal = scores == kth
    if not bool((equal.sum(-1) > 1).any()):
        return top.indices.sort(-1).values
    above = scores > kth
    need = k - above.sum(-1, keepdim=True)
    chosen = above | (equal & (equal.cumsum(-1) <= need))
    slot = torch.where(chosen, chosen.cumsum(-1) - 1, k)
    N = scores.shape[-1]
    positions = torch.arange(N, device=scores.device).expand_as(scores)
    out = torch.zeros(*scores.shape[:-1], k + 1, dtype=torch.long, device=scores.device)
    return out.scatter_(-1, slot, positions)[..., :k]


def pool(q: Tensor, num_landmarks: int, key_padding_mask: Tensor | None = None,
         landmark_grid: tuple[int, int] | None = None) -> tuple[Tensor, Tensor]:
    """Stage ``pool`` (eq. 5): average-pool the queries into m landmark queries.

    1-D (``landmark_grid=None``): the L valid tokens of a row, in order, are cut into m
    contiguous segments; the token of rank r (0-based among valid tokens) goes to segment
    ⌊r·m/L⌋, so segment sizes differ by at most one and padding anywhere is skipped.
    2-D (``landmark_grid=(H, W)``, H·W = N, row-major tokens): adaptive average pooling of the
    H×W grid to p×p with p² = m, as the authors' code does (``adaptive_avg_pool2d`` windows),
    averaging valid tokens only.

    Args:
        q: ``(B, H, N, d)`` queries, floating point.
        num_landmarks: m ≥ 1 (a perfect square for 2-D pooling).
        key_padding_mask: optional ``(B, N)`` bool, True = padding.
        landmark_grid: optional ``(H, W)`` token grid.
    Returns:
        ``landmarks`` ``(B, H, m, d)`` (zero for empty landmarks) and ``landmark_valid``
        ``(B, m)`` bool — False for a landmark whose segment/window holds no valid token
        (happens when L < m); such landmarks are excluded from routing and the shared branch.
    Raises:
        ValueError: bad grid, m not a square for 2-D pooling, bad mask.
    """
    B, H, N, d = q.shape
    m = num_landmarks
    valid = _valid_tokens(key_padding_mask, B, N, q.device)
    if landmark_grid is None:
        rank = valid.long().cumsum(-1) - 1
        length = valid.sum(-1, keepdim=True)
        segment = torch.where(valid, torch.div(rank * m, length, rounding_mode="floor"), m)
        sums = q.new_zeros(B, H, m + 1, d)
        sums.scatter_add_(2, segment[:, None, :, None].expand(B, H, N, d), q)
        counts = q.new_zeros(B, m + 1).scatter_add_(1, segment, valid.to(q.dtype))
        counts, sums = counts[:, :m], sums[:, :, :m]
    else:
        gh, gw = landmark_grid
        if gh * gw != N:
            raise ValueError(f"landmark_grid {landmark_grid} has {gh * gw} cells but N = {N}")
        p = math.isqrt(m)
        if p * p != m:
            raise ValueError(f"2-D pooling needs num_landmarks to be a square, got {m}")
        w = valid.to(q.dtype)
        grid = (q * w[:, None, :, None]).transpose(2, 3).reshape(B * H, d, gh, gw)
        # Mean of (q·valid) over a window divided by mean of valid = mean over valid tokens.
        sums = F.adaptive_avg_pool2d(grid, p).reshape(B, H, d, m).transpose(2, 3)
        counts = F.adaptive_avg_pool2d(w.reshape(B, 1, gh, gw), p).reshape(B, m)
    landmark_valid = counts > 0
    landmarks = sums / counts.clamp_min(torch.finfo(q.dtype).tiny)[:, None, :, None]
    return landmarks, landmark_valid


def landmark_scores(landmarks: Tensor, k: Tensor,
                    key_padding_mask: Tensor | None = None) -> Tensor:
    """Stage ``landmark_scores`` (eq. 6): s_ij = q̃_i·k_j / √d.

    Args: ``landmarks`` ``(B, H, m, d)``, ``k`` ``(B, H, N, d)``, optional ``(B, N)`` mask.
    Returns: ``(B, H, m, N)`` scores, ``-inf`` at padded keys.
    """
    scores = landmarks @ k.transpose(-1, -2) * k.shape[-1] ** -0.5
    if key_padding_mask is not None:
        scores = scores.masked_fill(key_padding_mask[:, None, None, :], float("-inf"))
    return scores


def topk(scores: Tensor, k: int) -> Tensor:
    """Stage ``topk`` (eq. 7): indices of each landmark's k highest-scoring keys.

    Args: ``scores`` ``(B, H, m, N)`` from ``landmark_scores``; ``1 ≤ k ≤ N``.
    Returns: ``(B, H, m, k)`` int64 key indices in ascending order; ties broken by the lowest
    index. When a row has fewer than k valid keys, padded (``-inf``) keys fill the rest and are
    masked later by ``gather``'s validity output.
    """
    return _topk_lowest_index(scores, k)


def shared_compress(scores: Tensor, v: Tensor) -> Tensor:
    """Stage ``shared_compress`` (eq. 8): ṽ_i = Σ_j softmax(s_i)_j v_j over **all** N values.

    Args: ``scores`` ``(B, H, m, N)`` (padded keys ``-inf``), ``v`` ``(B, H, N, dv)``.
    Returns: ``(B, H, m, dv)`` shared values. The matching shared keys are the landmarks.
    """
    return torch.softmax(scores, dim=-1) @ v


def route(q: Tensor, landmarks: Tensor, route_topk: int,
          landmark_valid: Tensor) -> tuple[Tensor, Tensor]:
    """Stage ``route`` (eq. 9): each query picks its top-s experts by q·q̃_i (no gate).

    Args: ``q`` ``(B, H, N, d)``, ``landmarks`` ``(B, H, m, d)``, ``route_topk`` s ≤ m,
    ``landmark_valid`` ``(B, m)`` bool.
    Returns: ``affinity`` ``(B, H, N, m)`` = q·q̃ unscaled, ``-inf`` for empty landmarks (reused
    as the shared-branch logits), and ``experts`` ``(B, H, N, s)`` int64, ties → lowest index.
    """
    affinity = q @ landmarks.transpose(-1, -2)
    affinity = affinity.masked_fill(~landmark_valid[:, None, None, :], float("-inf"))
    return affinity, _topk_lowest_index(affinity, route_topk)


def gather(k: Tensor, v: Tensor, expert_index: Tensor,
           key_padding_mask: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """Stage ``gather`` (eq. 10): collect the k raw (key, value) pairs of every routed expert.

    Args: ``k`` ``(B, H, N, d)``, ``v`` ``(B, H, N, dv)``, ``expert_index`` ``(B, H, m, k)``
    from ``topk``, optional ``(B, N)`` mask.
    Returns: ``expert_keys`` ``(B, H, m, k, d)``, ``expert_values`` ``(B, H, m, k, dv)`` and
    ``expert_key_valid`` ``(B, H, m, k)`` bool (False where top-k had to take a padded key).
    Memory is m·k·(d + dv) per head — independent of which queries use the expert.
    """
    B, H, m, kk = expert_index.shape
    flat = expert_index.reshape(B, H, m * kk, 1)
    keys = k.gather(2, flat.expand(-1, -1, -1, k.shape[-1])).reshape(B, H, m, kk, -1)
    values = v.gather(2, flat.expand(-1, -1, -1, v.shape[-1])).reshape(B, H, m, kk, -1)
    if key_padding_mask is None:
        key_valid = torch.ones(B, H, m, kk, dtype=torch.bool, device=k.device)
    else:
        key_valid = ~key_padding_mask[:, None, :].expand(B, H, -1).gather(
            2, expert_index.reshape(B, H, m * kk)).reshape(B, H, m, kk)
    return keys, values, key_valid


def attention(q: Tensor, shared_values: Tensor, affinity: Tensor, experts: Tensor,
              expert_keys: Tensor, expert_values: Tensor, expert_key_valid: Tensor,
              shared_scale: str = "paper") -> Tensor:
    """Stage ``attention`` (eqs. 11-12): one joint softmax over m shared + s·k routed entries.

    For query q with experts e_1..e_s: K* = [q̃_1..q̃_m, K^(e_1), …, K^(e_s)],
    V* = [ṽ_1..ṽ_m, V^(e_1), …, V^(e_s)], o = V* softmax(ℓ) with shared logits q·q̃_i·c and
    routed logits q·k_j/√d. ``shared_scale="paper"`` uses c = 1/√d (eq. 11);
    ``"official"`` uses c = 1/d as the authors' code does (shared keys pre-scaled by d^-1/2,
    then scaled again in the kernel). Masked entries carry ``-inf`` logits.

    Computed expert-grouped, as MoE dispatch: the B·H·N·s (query, expert) pairs are sorted by
    expert and packed into blocks of C = ⌈N·s/m⌉ queries of one expert (an expert with more
    queries takes several blocks, so there are at most 2·B·H·m blocks); each block is one
    ``(C × d) @ (d × k)`` matrix product against its expert's keys, never a per-query copy of
    the keys. The shared block and the s routed blocks of a query are then merged exactly by
    their log-sum-exp, which equals one softmax over all m + s·k entries.
    Peak extra memory: O(B·H·(N·s·(k + d + dv) + N·m)) elements — linear in N.

    Args: ``q`` ``(B, H, N, d)``; ``shared_values`` ``(B, H, m, dv)``; ``affinity``
    ``(B, H, N, m)`` and ``experts`` ``(B, H, N, s)`` from ``route``; the three outputs of
    ``gather``.
    Returns: ``(B, H, N, dv)``.
    """
    B, H, N, d = q.shape
    m, kk, dv = expert_keys.shape[2], expert_keys.shape[3], expert_values.shape[-1]
    s = experts.shape[-1]
    BH = B * H
    scale = d ** -0.5
    neg_inf = float("-inf")

    # Shared branch, in query order: (max, sum of exp, unnormalised output) per query.
    shared_logits = affinity * (scale if shared_scale == "paper" else 1.0 / d)
    shared_max = shared_logits.amax(-1, keepdim=True)  # finite: every row has a live landmark
    shared_p = torch.exp(shared_logits - shared_max)
    shared_sum = shared_p.sum(-1, keepdim=True)
    shared_out = shared_p @ shared_values

    # Routed branch, expert-grouped. Entry r = ((b·H + h)·N + n)·s + j.
    group = (torch.arange(BH, device=q.device).view(B, H, 1, 1) * m + experts).reshape(-1)
    entry_ok = torch.isfinite(affinity.gather(-1, experts)).reshape(-1)  # empty landmark: -inf
    order = torch.argsort(group, stable=True)
    group_sorted = group[order]
    counts = torch.bincount(group, minlength=BH * m)
    cap = max(1, -(-N * s // m))
    blocks = (counts + cap - 1) // cap
    group_start = torch.cumsum(counts, 0) - counts
    block_start = torch.cumsum(blocks, 0) - blocks
    rank = torch.arange(order.numel(), device=q.device) - group_start[group_sorted]
    block_id = block_start[group_sorted] + torch.div(rank, cap, rounding_mode="floor")
    slot = rank % cap
    num_blocks = int(blocks.sum())
    block_group = torch.repeat_interleave(torch.arange(BH * m, device=q.device), blocks)

    query_row = torch.div(order, s, rounding_mode="floor")  # row of q.view(BH·N, d)
    q_blocks = q.new_zeros(num_blocks, cap, d).index_put(
        (block_id, slot), q.reshape(BH * N, d)[query_row])
    keys = expert_keys.reshape(BH * m, kk, d)[block_group]
    values = expert_values.reshape(BH * m, kk, dv)[block_group]
    key_ok = expert_key_valid.reshape(BH * m, kk)[block_group]
    logits = torch.bmm(q_blocks, keys.transpose(1, 2)) * scale
    logits = logits.masked_fill(~key_ok[:, None, :], neg_inf)
    block_max = logits.amax(-1, keepdim=True)
    block_max = torch.where(torch.isfinite(block_max), block_max, torch.zeros_like(block_max))
    p = torch.exp(logits - block_max)
    block_sum = p.sum(-1, keepdim=True)
    block_out = torch.bmm(p, values)

    # Back to entry order r, then to (B, H, N, s).
    def unpack(t: Tensor) -> Tensor:
        flat = t[block_id, slot]
        return flat.new_empty(flat.shape).index_copy(0, order, flat)

    ok = entry_ok.view(B, H, N, s, 1)
    routed_max = unpack(block_max).view(B, H, N, s, 1).masked_fill(~ok, neg_inf)
    routed_sum = unpack(block_sum).view(B, H, N, s, 1)
    routed_out = unpack(block_out).view(B, H, N, s, dv)

    # Log-sum-exp merge of the shared block and the s routed blocks = one joint softmax.
    top = torch.maximum(shared_max, routed_max.amax(-2))  # (B, H, N, 1)
    w_shared = torch.exp(shared_max - top)
    w_routed = torch.exp(routed_max - top[..., None])  # 0 for masked experts
    numer = w_shared * shared_out + (w_routed * routed_out).sum(-2)
    denom = w_shared * shared_sum + (w_routed * routed_sum).sum(-2)
    return numer / denom


_topk_stage = topk


def mita_attention(q: Tensor, k: Tensor, v: Tensor, *, num_landmarks: int, topk: int,
                   route_topk: int = 1, key_padding_mask: Tensor | None = None,
                   landmark_grid: tuple[int, int] | None = None, shared_scale: str = "paper",
                   hook: StageHook = NULL_HOOK) -> Tensor:
    """MiTA attention, eqs. 5-12 of arXiv:2602.01219 (§3.2), exactly.

    Args:
        q, k: ``(B, H, N, d)``; v: ``(B, H, N, dv)``; float16/bfloat16/float32/float64.
        num_landmarks: m ≥ 1 landmarks = routed experts. N < m is allowed: landmarks whose
            segment holds no valid token are empty and excluded (see ``pool``).
        topk: k ≥ 1 raw key/value pairs per routed expert; **clamped to N** when k > N (rows
            with fewer valid keys than k mask the padded picks).
        route_topk: s, experts per query, 1 ≤ s ≤ m. If a row has fewer non-empty landmarks
            than s, the extra picks are masked.
        key_padding_mask: optional ``(B, N)`` bool, True = padding. Padded keys are never
            weighted (shared or routed); padded queries are left out of landmark pooling and
            their outputs are zero.
        landmark_grid: None for 1-D contiguous pooling, ``(H, W)`` with H·W = N for 2-D.
        shared_scale: ``"paper"`` (shared logit q·q̃/√d) or ``"official"`` (q·q̃/d, as the
            authors' code).
        hook: stage hook; each stage runs inside ``hook.stage(name)``.
    Returns:
        ``(B, H, N, dv)`` in the input dtype.
    Raises:
        ValueError: shape mismatch, m/k/s < 1, s > m, unknown ``shared_scale``, bad grid,
            a bad mask or an all-padding row.
    """
    if q.dim() != 4 or k.shape != q.shape or v.dim() != 4 or v.shape[:3] != q.shape[:3]:
        raise ValueError(f"expected q, k (B, H, N, d) and v (B, H, N, dv) with equal B, H, N; "
                         f"got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    B, H, N, _ = q.shape
    if N == 0:
        raise ValueError("sequence length N must be ≥ 1")
    if num_landmarks < 1 or topk < 1 or route_topk < 1:
        raise ValueError(f"num_landmarks, topk and route_topk must be ≥ 1, got "
                         f"{num_landmarks}, {topk}, {route_topk}")
    if route_topk > num_landmarks:
        raise ValueError(f"route_topk s={route_topk} exceeds num_landmarks m={num_landmarks}")
    if shared_scale not in SHARED_SCALES:
        raise ValueError(f"shared_scale must be one of {SHARED_SCALES}, got {shared_scale!r}")
    valid = _valid_tokens(key_padding_mask, B, N, q.device)
    out_dtype = q.dtype
    if q.dtype in (torch.float16, torch.bfloat16):
        q, k, v = q.float(), k.float(), v.float()
    kk = min(topk, N)

    with hook.stage("pool"):
        landmarks, landmark_valid = pool(q, num_landmarks, key_padding_mask, landmark_grid)
    with hook.stage("landmark_scores"):
        scores = landmark_scores(landmarks, k, key_padding_mask)
    with hook.stage("topk"):
        expert_index = _topk_stage(scores, kk)
    with hook.stage("shared_compress"):
        shared_values = shared_compress(scores, v)
    del scores
    with hook.stage("route"):
        affinity, experts = route(q, landmarks, route_topk, landmark_valid)
    with hook.stage("gather"):
        expert_keys, expert_values, expert_key_valid = gather(k, v, expert_index,
                                                              key_padding_mask)
    with hook.stage("attention"):
        out = attention(q, shared_values, affinity, experts, expert_keys, expert_values,
                        expert_key_valid, shared_scale)
        if key_padding_mask is not None:
            out = out.masked_fill(~valid[:, None, :, None], 0.0)
    return out.to(out_dtype)


def dense_attention(q: Tensor, k: Tensor, v: Tensor,
                    key_padding_mask: Tensor | None = None) -> Tensor:
    """Dense softmax attention (§3.1, eqs. 1-4) via ``F.scaled_dot_product_attention``.

    Args: ``q``, ``k`` ``(B, H, N, d)``; ``v`` ``(B, H, N, dv)``; optional ``(B, N)`` bool
    mask, True = padding. Returns ``(B, H, N, dv)``; zero at padded query positions.
    Raises: ValueError on an all-padding row or a bad mask.
    """
    if key_padding_mask is None:
        return F.scaled_dot_product_attention(q, k, v)
    B, _, N, _ = q.shape
    valid = _valid_tokens(key_padding_mask, B, N, q.device)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=valid[:, None, None, :])
    return out.masked_fill(~valid[:, None, :, None], 0.0)


def mita_stage_flops(N: int, m: int, k: int, s: int = 1, d: int = 64) -> dict[str, int]:
    """Analytic FLOPs of one MiTA head on one sequence, by stage (§3.2 cost model).

    A multiply-add counts 2 FLOPs. Similarity scores: N·m landmark×key (``landmark_scores``),
    N·m query×landmark (``route``; reused as shared logits), N·s·k query×routed key
    (``attention``) — N(2m+sk) in all, as in the paper, times 2d. Value sums: m·N for
    ``shared_compress`` and N(m+sk) in ``attention``, times 2d. ``pool`` adds N·d.
    Not counted: softmax exponentials, top-k selection, gathers, memory traffic. k is clamped
    to N as in ``mita_attention``.
    """
    k = min(k, N)
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
    ``DenseAttention``."""

    def __init__(self, dim: int, num_heads: int, num_landmarks: int, topk: int,
                 route_topk: int = 1, shared_scale: str = "paper",
                 landmark_grid: tuple[int, int] | None = None):
        super().__init__(dim, num_heads)
        if shared_scale not in SHARED_SCALES:
            raise ValueError(f"shared_scale must be one of {SHARED_SCALES}, got {shared_scale!r}")
        if route_topk > num_landmarks:
            raise ValueError(f"route_topk s={route_topk} exceeds num_landmarks m={num_landmarks}")
        self.num_landmarks, self.topk, self.route_topk = num_landmarks, topk, route_topk
        self.shared_scale, self.landmark_grid = shared_scale, landmark_grid

    def attend(self, q, k, v, key_padding_mask, hook):
        return mita_attention(q, k, v, num_landmarks=self.num_landmarks, topk=self.topk,
                              route_topk=self.route_topk, key_padding_mask=key_padding_mask,
                              landmark_grid=self.landmark_grid,
                              shared_scale=self.shared_scale, hook=hook)
