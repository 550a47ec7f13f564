"""MiTA's seven stages on ``(B, H, N, d)`` tensors, as PyTorch functions named after the
profiler's stages (the reference path, and the pieces the kernel launchers reuse).

Source: Wen et al., *Mixture-of-Top-k Attention: Efficient Attention via Scalable Fast Weights*,
arXiv:2602.01219 v6, §3.2 (eqs. 5-12).

``pool``            average-pool the *queries* into m landmark queries q̃ (eq. 5)
``landmark_scores`` s_ij = q̃_i·k_j/√d for every key (eq. 6)
``topk``            the k best keys of each landmark form routed expert i (eq. 7;
                    function ``topk_tokens``)
``shared_compress`` ṽ_i = Σ_j softmax(s_i)_j v_j over all N values; shared key = q̃_i (eq. 8)
``route``           each query picks its top-s landmarks by q·q̃_i, no gate (eq. 9)
``gather``          the k raw (key, value) pairs of every expert (eq. 10)
``attention``       one softmax over the m shared + s·k routed entries (eqs. 11-12)

Conventions as ``mita.attention`` (which checks the inputs once and calls these): ``k`` is
always the key tensor and ``topk`` the count k; ``key_padding_mask`` is ``(B, N)`` bool with
``True`` marking padding, already checked (``check_padding_mask``).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from .hooks import NULL_HOOK, StageHook
from .topk import topk_lowest_index

_CHUNK_ELEMENTS = 1 << 20  # float32 elements of one query chunk's N×m block (4 MiB)
_CHUNK_ELEMENTS_CUDA = 1 << 26  # 256 MiB on a GPU: fewer, larger launches


def check_padding_mask(key_padding_mask: Tensor | None, B: int, N: int) -> None:
    """The one check of a ``(B, N)`` bool key-padding mask (True = padding), made once per
    forward (``mita_attention`` for a direct call; ``EncoderClassifier.forward`` for the
    model's layers): dtype, shape, and no batch row all padding. The last asks the device
    (one host synchronisation on CUDA), so it is skipped inside a CUDA graph capture — the
    warm-up forwards before a capture checked the same mask. Raises ValueError."""
    if key_padding_mask is None:
        return
    if key_padding_mask.dtype != torch.bool:
        raise ValueError(f"key_padding_mask must be bool, got {key_padding_mask.dtype}")
    if tuple(key_padding_mask.shape) != (B, N):
        raise ValueError(f"key_padding_mask must have shape {(B, N)}, "
                         f"got {tuple(key_padding_mask.shape)}")
    if key_padding_mask.is_cuda and torch.cuda.is_current_stream_capturing():
        return
    empty = key_padding_mask.all(-1).nonzero().flatten().tolist()
    if empty:
        raise ValueError(f"batch rows {empty} are all padding: nothing to attend to")


def valid_tokens(key_padding_mask: Tensor | None, B: int, N: int, device) -> Tensor:
    """``(B, N)`` bool, True where a token is real (all True without a mask); the mask as
    ``check_padding_mask`` left it, not checked again."""
    if key_padding_mask is None:
        return torch.ones(B, N, dtype=torch.bool, device=device)
    return ~key_padding_mask


def pool(q: Tensor, num_landmarks: int, key_padding_mask: Tensor | None = None,
         landmark_grid: tuple[int, int] | None = None) -> tuple[Tensor, Tensor]:
    """Stage ``pool`` (eq. 5): average-pool the queries into m landmark queries.

    1-D (``landmark_grid=None``): the L valid tokens of a row, in order, are cut into m
    contiguous segments; the token of rank r (0-based among valid tokens) goes to segment
    ⌊r·m/L⌋, so segment sizes differ by at most one and padding anywhere is skipped.
    2-D (``landmark_grid=(H, W)``, H·W ≤ N): adaptive average pooling of the first H·W
    tokens, row-major, as an H×W grid to p×p with p² = m, as the authors' code does
    (``adaptive_avg_pool2d`` windows), averaging valid tokens only. Tokens after the grid
    (H·W < N) are queries and keys but pool into no landmark: the authors' DeiT code pools
    ``q[:, :-1]`` — the class token in the first cell, the last patch left out.

    Args:
        q: ``(B, H, N, d)`` queries, floating point.
        num_landmarks: m ≥ 1 (a perfect square for 2-D pooling).
        key_padding_mask: optional ``(B, N)`` bool, True = padding (``check_padding_mask``).
        landmark_grid: optional ``(H, W)`` token grid.
    Returns:
        ``landmarks`` ``(B, H, m, d)`` in q's dtype, float32 for 16-bit q (averaged in
        float32), zero for empty landmarks, and ``landmark_valid``
        ``(B, m)`` bool — False for a landmark whose segment/window holds no valid token
        (happens when L < m); such landmarks are excluded from routing and the shared branch.
    Raises:
        ValueError: a grid of more than N cells, m not a square for 2-D pooling.
    """
    B, H, N, d = q.shape
    m = num_landmarks
    valid = valid_tokens(key_padding_mask, B, N, q.device)
    dtype = torch.promote_types(q.dtype, torch.float32)  # 16-bit q: sums in float32
    if landmark_grid is None and key_padding_mask is None and N % m == 0:
        # Equal contiguous segments of N/m tokens: the general rule below, as one mean.
        landmarks = q.reshape(B, H, m, N // m, d).mean(3, dtype=dtype)
        return landmarks, torch.ones(B, m, dtype=torch.bool, device=q.device)
    if landmark_grid is None:
        rank = valid.long().cumsum(-1) - 1
        length = valid.sum(-1, keepdim=True)
        segment = torch.where(valid, torch.div(rank * m, length, rounding_mode="floor"), m)
        # index_add per batch row: a 1-D index instead of a (B, H, N, d) int64 one (1 GiB at
        # N = 1M).
        sums = torch.stack([q.new_zeros(H, m + 1, d, dtype=dtype).index_add(
            1, segment[b], q[b].to(dtype)) for b in range(B)])
        counts = q.new_zeros(B, m + 1, dtype=dtype).scatter_add_(1, segment, valid.to(dtype))
        counts, sums = counts[:, :m], sums[:, :, :m]
    else:
        gh, gw = landmark_grid
        cells = gh * gw
        if cells > N:
            raise ValueError(f"landmark_grid {landmark_grid} has {cells} cells but N = {N}")
        p = math.isqrt(m)
        if p * p != m:
            raise ValueError(f"2-D pooling needs num_landmarks to be a square, got {m}")
        w = valid[:, :cells].to(dtype)  # tokens past the grid pool into no landmark
        grid = (q[:, :, :cells].to(dtype) * w[:, None, :, None]).transpose(2, 3).reshape(
            B * H, d, gh, gw)
        # Mean of (q·valid) over a window divided by mean of valid = mean over valid tokens.
        sums = F.adaptive_avg_pool2d(grid, p).reshape(B, H, d, m).transpose(2, 3)
        counts = F.adaptive_avg_pool2d(w.reshape(B, 1, gh, gw), p).reshape(B, m)
    landmark_valid = counts > 0
    landmarks = sums / counts.clamp_min(torch.finfo(dtype).tiny)[:, None, :, None]
    return landmarks, landmark_valid


def landmark_scores(landmarks: Tensor, k: Tensor,
                    key_padding_mask: Tensor | None = None) -> Tensor:
    """Stage ``landmark_scores`` (eq. 6): s_ij = q̃_i·k_j / √d.

    Args: ``landmarks`` ``(B, H, m, d)``, ``k`` ``(B, H, N, d)``, optional ``(B, N)`` mask.
    Returns: ``(B, H, m, N)`` scores, ``-inf`` at padded keys.
    """
    scores = (landmarks * k.shape[-1] ** -0.5) @ k.transpose(-1, -2)  # scale the small side
    if key_padding_mask is not None:
        scores = scores.masked_fill(key_padding_mask[:, None, None, :], float("-inf"))
    return scores


def topk_tokens(scores: Tensor, topk: int) -> Tensor:
    """Stage ``topk`` (eq. 7): indices of each landmark's k = ``topk`` highest-scoring keys.

    Args: ``scores`` ``(B, H, m, N)`` from ``landmark_scores``; ``1 ≤ topk ≤ N``.
    Returns: ``(B, H, m, k)`` int64 key indices in ascending order; ties broken by the lowest
    index. When a row has fewer than k valid keys, padded (``-inf``) keys fill the rest and are
    masked later by ``gather``'s validity output.
    """
    return topk_lowest_index(scores, topk)


def shared_compress(scores: Tensor, v: Tensor) -> Tensor:
    """Stage ``shared_compress`` (eq. 8): ṽ_i = Σ_j softmax(s_i)_j v_j over **all** N values.

    Args: ``scores`` ``(B, H, m, N)`` (padded keys ``-inf``), ``v`` ``(B, H, N, dv)``.
    Returns: ``(B, H, m, dv)`` shared values. The matching shared keys are the landmarks.
    """
    return torch.softmax(scores, dim=-1) @ v


def shared_compress_sdpa(landmarks: Tensor, k: Tensor, v: Tensor,
                         key_padding_mask: Tensor | None = None) -> Tensor:
    """Stage ``shared_compress`` (eq. 8) as one fused attention call with the m landmarks as
    the queries: ṽ_i = Σ_j softmax(q̃_i·k_j/√d)_j v_j, the value ``shared_compress(
    landmark_scores(landmarks, k, mask), v)`` gives, without materialising the m × N weights
    (``F.scaled_dot_product_attention``: flash attention for 16-bit CUDA inputs; on the CPU its
    fused kernel or the math path).

    Args: ``landmarks`` ``(B, H, m, d)`` (cast to k's dtype: 16-bit products with fp32
    accumulation for 16-bit k, v), ``k`` ``(B, H, N, d)``, ``v`` ``(B, H, N, dv)``, optional
    ``(B, N)`` bool mask (True = padding; padded keys get no weight) — or that mask already as
    SDPA's additive bias, ``(B, 1, 1, N)`` in k's dtype, 0 / -inf (the Triton path builds it
    once; SDPA would turn a bool mask into it with a few launches of its own).
    Returns: ``(B, H, m, dv)`` in k's dtype.
    """
    mask = key_padding_mask
    if mask is not None and mask.dtype == torch.bool:
        mask = ~mask[:, None, None, :]
    return F.scaled_dot_product_attention(landmarks.to(k.dtype), k, v, attn_mask=mask)


def _query_chunk(n_cols: int, cuda: bool = False) -> int:
    """Queries per chunk so a (chunk × n_cols) float32 block stays near 4 MiB (256 MiB on
    CUDA, where each chunk costs kernel launches rather than cache misses)."""
    return max(256, (_CHUNK_ELEMENTS_CUDA if cuda else _CHUNK_ELEMENTS) // max(1, n_cols))


def route(q: Tensor, landmarks: Tensor, route_topk: int,
          landmark_valid: Tensor) -> Tensor:
    """Stage ``route`` (eq. 9): each query picks its top-s experts by q·q̃_i (no gate).

    Args: ``q`` ``(B, H, N, d)``, ``landmarks`` ``(B, H, m, d)``, ``route_topk`` s ≤ m,
    ``landmark_valid`` ``(B, m)`` bool (empty landmarks are never picked unless fewer than s
    are valid; ``attention`` then masks the extra picks).
    Returns: ``experts`` ``(B, H, N, s)`` int64; ties → lowest index. The N×m affinities are
    computed in query chunks and not kept (at N = 1M, m = 512 they would take 2 GiB per head);
    ``attention`` recomputes the ones it needs as shared logits.
    """
    B, H, N, _ = q.shape
    m = landmarks.shape[2]
    dead = ~landmark_valid[:, None, None, :]  # masked always: asking whether any is would
    # synchronise with the GPU once per layer
    out = torch.empty(B, H, N, route_topk, dtype=torch.long, device=q.device)
    lt = landmarks.transpose(-1, -2)
    chunk = _query_chunk(B * H * m, q.is_cuda)
    for start in range(0, N, chunk):
        aff = q[:, :, start:start + chunk].to(lt.dtype) @ lt
        aff = aff.masked_fill(dead, float("-inf"))
        if route_topk == 1:  # argmax returns the first maximum: the lowest-index tie rule
            out[:, :, start:start + aff.shape[2], 0] = aff.argmax(-1)
        else:
            out[:, :, start:start + aff.shape[2]] = topk_lowest_index(aff, route_topk)
    return out


def gather(k: Tensor, v: Tensor, expert_index: Tensor,
           key_padding_mask: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """Stage ``gather`` (eq. 10): collect the k raw (key, value) pairs of every routed expert.

    Args: ``k`` ``(B, H, N, d)``, ``v`` ``(B, H, N, dv)``, ``expert_index`` ``(B, H, m, k)``
    from ``topk``, optional ``(B, N)`` mask.
    Returns: ``expert_keys`` ``(B, H, m, k, d)``, ``expert_values`` ``(B, H, m, k, dv)`` and
    ``expert_key_valid`` ``(B, H, m, k)`` bool (False where top-k had to take a padded key).
    Memory is m·k·(d + dv) per head — independent of which queries use the expert.
    """
    B, H, m, topk = expert_index.shape
    N = k.shape[2]
    # One index_select over the (B·H·N) rows: an expanded (B, H, m·k, d) int64 index for
    # torch.gather would be d times larger than the rows it picks.
    rows = (expert_index.reshape(B * H, m * topk)
            + torch.arange(B * H, device=k.device)[:, None] * N).reshape(-1)
    keys = k.reshape(B * H * N, -1).index_select(0, rows).view(B, H, m, topk, -1)
    values = v.reshape(B * H * N, -1).index_select(0, rows).view(B, H, m, topk, -1)
    if key_padding_mask is None:
        key_valid = torch.ones(B, H, m, topk, dtype=torch.bool, device=k.device)
    else:
        key_valid = ~key_padding_mask[:, None, :].expand(B, H, -1).gather(
            2, expert_index.reshape(B, H, m * topk)).reshape(B, H, m, topk)
    return keys, values, key_valid


def _unsort(sorted_rows: Tensor, order: Tensor) -> Tensor:
    """Rows given in ``order``'s sorted sequence, put back at the positions ``order`` names."""
    return sorted_rows.new_empty(sorted_rows.shape).index_copy(0, order, sorted_rows)


def attention(q: Tensor, landmarks: Tensor, landmark_valid: Tensor, shared_values: Tensor,
              experts: Tensor, expert_keys: Tensor, expert_values: Tensor,
              expert_key_valid: Tensor, shared_scale: str = "paper",
              key_padding_mask: Tensor | None = None, lse: Tensor | None = None) -> Tensor:
    """Stage ``attention`` (eqs. 11-12): one joint softmax over m shared + s·k routed entries.

    For query q with experts e_1..e_s: K* = [q̃_1..q̃_m, K^(e_1), …, K^(e_s)],
    V* = [ṽ_1..ṽ_m, V^(e_1), …, V^(e_s)], o = V* softmax(ℓ) with shared logits q·q̃_i·c and
    routed logits q·k_j/√d. ``shared_scale="paper"`` uses c = 1/√d (eq. 11);
    ``"official"`` uses c = 1/d as the authors' code does (shared keys pre-scaled by d^-1/2,
    then scaled again in the kernel). Empty landmarks and padded keys are masked.

    Computed expert-grouped, as MoE dispatch: for each head, the N·s (query, expert) pairs are
    sorted by expert and each expert's queries form one dense block against its keys — never
    a per-query copy of the keys. The shared logits q·q̃ are recomputed inside the blocks
    (2·N·m·d FLOPs beyond the paper's count, which reuses route's; storing the N×m
    affinities instead would take 2 GiB per head at N = 1M, m = 512).
    s = 1: each expert's block is ``(n_e × d) @ (d × (m + k))`` over [shared ; routed] keys,
    one softmax, one weighted sum — the joint softmax directly.
    s > 1: the shared block (query chunks) and the routed blocks (per expert) are reduced to
    (max, sum of exp, weighted values) and merged per query by log-sum-exp, which equals one
    softmax over all m + s·k entries.
    Peak extra memory per head: O(N·s·(dv + 2) + max_e n_e·(m + k)) — linear in N.

    Args: ``q`` ``(B, H, N, d)``; ``landmarks`` ``(B, H, m, d)`` and ``landmark_valid``
    ``(B, m)`` from ``pool``; ``shared_values`` ``(B, H, m, dv)``; ``experts``
    ``(B, H, N, s)`` from ``route``; the three outputs of ``gather``; optional ``lse``
    ``(B, H, N)`` in q's dtype, filled with each valid query's log-sum-exp of its m + s·k
    joint logits (what ``mita.joint``'s backward recomputes the probabilities from; padded
    queries' entries are left as they are). Asking for it does not change the output's bits.
    Returns: ``(B, H, N, dv)``.
    """
    B, H, N, d = q.shape
    m, dv = landmarks.shape[2], expert_values.shape[-1]
    s = experts.shape[-1]
    scale = d ** -0.5
    c_shared = shared_logit_scale(d, shared_scale)
    out = q.new_zeros(B, H, N, dv)  # padded queries' rows stay zero
    for b in range(B):
        row_valid = landmark_valid[b]
        all_valid = bool(row_valid.all())
        for h in range(H):
            qh = q[b, h]
            # Entries r = n·s + j sorted by expert; padded queries go to a dummy group m.
            flat = experts[b, h].reshape(-1)
            if key_padding_mask is not None:
                flat = flat.masked_fill(key_padding_mask[b].repeat_interleave(s), m)
            order = torch.argsort(flat, stable=True)
            counts = torch.bincount(flat, minlength=m + 1).tolist()
            rows = torch.div(order, s, rounding_mode="floor")
            lse_bh = None if lse is None else lse[b, h]
            if s == 1:
                _joint_blocks(qh, rows, counts, row_valid, all_valid,
                              landmarks[b, h] * c_shared, shared_values[b, h],
                              expert_keys[b, h] * scale, expert_values[b, h],
                              expert_key_valid[b, h], out[b, h], lse_bh)
            else:
                out[b, h] = _merged_blocks(qh, s, rows, order, counts, row_valid, all_valid,
                                           landmarks[b, h] * c_shared, shared_values[b, h],
                                           expert_keys[b, h] * scale, expert_values[b, h],
                                           expert_key_valid[b, h], lse_bh)
    return out


def _expert_segments(counts: list[int]):
    """(expert, slice into the expert-sorted entries) for every expert with entries."""
    start = 0
    for e, count in enumerate(counts):
        if count:
            yield e, slice(start, start + count)
            start += count


def _joint_blocks(qh, rows, counts, landmark_valid, all_valid, shared_keys, shared_values,
                  expert_keys, expert_values, expert_key_valid, out, lse=None) -> None:
    """s = 1: each expert's queries attend to [m shared ; k routed] in one block — a single
    matrix product, softmax and weighted sum per expert, written straight into ``out`` at the
    queries' rows (padded queries' rows are left as they are: zero). ``expert_keys`` are
    pre-scaled."""
    m = expert_keys.shape[0]
    # [shared ; routed] keys/values of every expert in one copy each (m·(m+k)·d), not one
    # concatenation per expert.
    keys = torch.cat([shared_keys.expand(m, -1, -1), expert_keys], 1)
    values = torch.cat([shared_values.expand(m, -1, -1), expert_values], 1)
    ok = torch.cat([landmark_valid.expand(m, -1), expert_key_valid & landmark_valid[:, None]], 1)
    ok_rows = ok.all(1).tolist() if all_valid else [False] * m
    for e, sl in _expert_segments(counts):
        if e == m:  # padded queries
            continue
        idx = rows[sl]
        logits = qh.index_select(0, idx) @ keys[e].T
        if not ok_rows[e]:
            logits = logits.masked_fill(~ok[e], float("-inf"))
        out.index_copy_(0, idx, torch.softmax(logits, -1) @ values[e])
        if lse is not None:
            lse.index_copy_(0, idx, torch.logsumexp(logits, -1))


def _merged_blocks(qh, s, rows, order, counts, landmark_valid, all_valid, shared_keys,
                   shared_values, expert_keys, expert_values, expert_key_valid,
                   lse=None) -> Tensor:
    """s > 1: a shared block per query chunk and a routed block per expert, each reduced to
    (max, sum of exp, weighted values), merged by log-sum-exp per query across the shared
    block and its s routed blocks. ``expert_keys`` are pre-scaled."""
    N = qh.shape[0]
    m, dv = shared_keys.shape[0], expert_values.shape[-1]
    neg_inf = float("-inf")
    sh_max, sh_sum, sh_out = [], [], []
    chunk = _query_chunk(m)
    for start in range(0, N, chunk):
        logits = qh[start:start + chunk] @ shared_keys.T
        if not all_valid:
            logits = logits.masked_fill(~landmark_valid, neg_inf)
        mx = logits.amax(-1, keepdim=True)  # finite: a row has ≥ 1 valid landmark
        p = torch.exp(logits - mx)
        sh_max.append(mx)
        sh_sum.append(p.sum(-1, keepdim=True))
        sh_out.append(p @ shared_values)
    sh_max, sh_sum, sh_out = torch.cat(sh_max), torch.cat(sh_sum), torch.cat(sh_out)
    valid_list = landmark_valid.tolist()
    pieces: list[tuple[Tensor, Tensor, Tensor]] = []
    for e, sl in _expert_segments(counts):
        count = sl.stop - sl.start
        if e == m or not valid_list[e]:  # padding, or an empty landmark: no weight
            pieces.append((qh.new_full((count, 1), neg_inf), qh.new_zeros(count, 1),
                           qh.new_zeros(count, dv)))
            continue
        logits = qh.index_select(0, rows[sl]) @ expert_keys[e].T
        ok = expert_key_valid[e]
        if not bool(ok.all()):
            logits = logits.masked_fill(~ok, neg_inf)
        mx = logits.amax(-1, keepdim=True)
        p = torch.exp(logits - mx)
        pieces.append((mx, p.sum(-1, keepdim=True), p @ expert_values[e]))
    rt_max, rt_sum, rt_out = (_unsort(torch.cat(col), order).view(N, s, -1)
                              for col in zip(*pieces, strict=True))
    top = torch.maximum(sh_max, rt_max.amax(1))
    w_sh = torch.exp(sh_max - top)
    w_rt = torch.exp(rt_max - top[:, None])  # 0 for masked experts
    total = w_sh * sh_sum + (w_rt * rt_sum).sum(1)
    if lse is not None:  # padded queries' rows too: the caller masks them
        lse.copy_((top + total.log()).squeeze(-1))
    return (w_sh * sh_out + (w_rt * rt_out).sum(1)) / total


def gather_and_attend(q, k, v, landmarks, landmark_valid, shared_values, expert_index, experts,
                      shared_scale, key_padding_mask, hook) -> Tensor:
    """The PyTorch stages ``gather`` (eq. 10) and ``attention`` (eqs. 11-12), each inside
    ``hook.stage``: the tensors of ``routing_stages`` (shapes there) and q, k ``(B, H, N, d)``,
    v ``(B, H, N, dv)``. Returns ``(B, H, N, dv)`` in q's dtype, zero at padded queries. Also
    the CPU launcher's path for s > 1."""
    with hook.stage("gather"):
        expert_keys, expert_values, expert_key_valid = gather(k, v, expert_index,
                                                              key_padding_mask)
    with hook.stage("attention"):
        out = attention(q, landmarks, landmark_valid, shared_values, experts, expert_keys,
                        expert_values, expert_key_valid, shared_scale, key_padding_mask)
        if key_padding_mask is not None:
            out = out.masked_fill(key_padding_mask[:, None, :, None], 0.0)
    return out


def routing_stages(q: Tensor, k: Tensor, v: Tensor, num_landmarks: int, topk: int,
                   route_topk: int = 1, key_padding_mask: Tensor | None = None,
                   landmark_grid: tuple[int, int] | None = None,
                   hook: StageHook = NULL_HOOK
                   ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Stages ``pool`` … ``route`` (eqs. 5-9), each inside ``hook.stage(name)``: everything
    ``attention`` (or the fused kernel) needs besides q, k, v.

    Args: as ``mita_attention`` (which checks them), with ``topk`` already ≤ N.
    Returns: ``landmarks`` ``(B, H, m, d)``, ``landmark_valid`` ``(B, m)`` bool,
    ``expert_index`` ``(B, H, m, k)`` int64, ``shared_values`` ``(B, H, m, dv)``,
    ``experts`` ``(B, H, N, s)`` int64. The ``(B, H, m, N)`` scores are freed on return.
    """
    with hook.stage("pool"):
        landmarks, landmark_valid = pool(q, num_landmarks, key_padding_mask, landmark_grid)
    with hook.stage("landmark_scores"):
        scores = landmark_scores(landmarks, k, key_padding_mask)
    with hook.stage("topk"):
        expert_index = topk_tokens(scores, topk)
    with hook.stage("shared_compress"):
        shared_values = shared_compress(scores, v)
        del scores  # m × N: freed before route
    with hook.stage("route"):
        experts = route(q, landmarks, route_topk, landmark_valid)
    return landmarks, landmark_valid, expert_index, shared_values, experts


def shared_logit_scale(d: int, shared_scale: str) -> float:
    """c in the shared logit q·q̃·c: 1/√d for ``"paper"`` (eq. 11), 1/d for ``"official"``
    (the authors' code pre-scales q̃ by d^-1/2 and the kernel scales again)."""
    return d ** -0.5 if shared_scale == "paper" else 1.0 / d
