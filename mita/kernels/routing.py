"""MiTA routing stages as Triton kernels (arXiv:2602.01219, eqs. 6, 7, 9, 11).

Two kernels replace the PyTorch routing stages on the fused path:

``landmark_topk`` — stages ``landmark_scores`` + ``topk`` (eqs. 6-7) in two streaming passes
over the keys; the m × N score matrix is never written. One program holds ``BLOCK_L``
landmarks of one (batch, head); scores come from ``tl.dot`` in the input dtype with fp32
accumulation, as order-preserving int32 keys (the float32 bits with negatives flipped).
Pass 1 keeps the ``K_PAD`` largest score values per landmark (``K_PAD`` = k rounded up to a
power of two) in registers, sorted: a super-tile of ``K_PAD`` keys that can change them is
sorted ascending (bitonic) and merged by the bitonic top-k step — elementwise max with the
descending list, then a bitonic merge (Shanbhag et al., "Efficient Top-K Query Processing on
Massively Parallel Hardware", SIGMOD 2018; ``tl.topk`` uses the same step); tiles that cannot
change any list are skipped. That gives the k-th largest score T and how many keys equal to T
the top-k takes. Pass 2 recomputes the same scores tile by tile (bit-identical: same code,
same tiles) and writes, left to right, every key above T and the first ``need`` keys equal to
T — the project's lowest-index tie rule, with the indices in ascending order and no sort of
indices. Cost: the score product twice (2·2·m·N·d FLOPs) plus the sorts; memory B·H·m·k
indices.

``route_shared`` — stage ``route`` for s = 1 fused with the shared half of the joint softmax
(eqs. 9, 11): one pass over the landmarks per tile of queries computes q·q̃_i once, takes the
argmax (lowest index on ties; empty landmarks never chosen) and folds c·q·q̃_i into an online
softmax over the shared values ṽ, as the CPU kernel ``route_shared`` does. It writes, per query,
the expert and the shared branch's (max, sum of exp, weighted values) in fp32;
``fused_attention`` starts each query's online softmax from them and adds the routed keys only.
This is the reuse the paper's cost model assumes (N·m query × landmark products, once).

Both take the key-padding mask as a runtime int8 vector (all ones when there is no mask), so
the specialisations a GPU compiles are dtype × ``BLOCK_D`` (× ``K_PAD`` for the top-k).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from . import MAX_HEAD_DIM
from .bisect import bisect_fallback
from .triton_common import (
    NEG_INIT,
    NO_KEY,
    as_int8,
    block_d_for,
    check_grid,
    check_inputs,
    dot,
    emit_topk,
    interpreter_upcast,
    key_valid_vector,
    load_rows,
    score_keys,
)

BLOCK_L = 16  # landmarks per top-k program (tl.dot needs ≥ 16 rows)
MIN_K_PAD = 64  # shortest running list; K_PAD // BLOCK_N score tiles form one merge
MAX_TOPK = 512  # K_PAD ≤ 512: two [16, 512] int64 lists per program already fill 128 KiB


def k_pad(k: int) -> int:
    """Running-list length for top-k: k rounded up to a power of two, at least one tile."""
    return max(MIN_K_PAD, triton.next_power_of_2(k))


def _topk_blocks(dtype: torch.dtype, kp: int) -> tuple[int, int]:
    """``(BLOCK_N, num_warps)`` of ``_landmark_topk_kernel`` for ``K_PAD`` = ``kp``: keys per
    score tile and warps, chosen so that no specialisation spills registers on sm_80 or sm_90
    (``python -m mita.kernels.aot --table``). 64-key tiles, with 8 warps from K_PAD 256 on,
    spilled where ptxas held registers to 128 or 168 (for occupancy): float32 at K_PAD 64,
    BLOCK_D 128 on sm_80 (4 bytes), 16-bit at K_PAD 128-256 on sm_90 (4-16 bytes); 16-key
    tiles for float32 at K_PAD 64, and 32-key tiles with 4 warps for 16-bit at K_PAD 128-256,
    do not. 8 warps at K_PAD 512 (two [16, 512] lists)."""
    if dtype == torch.float32:  # with the bounded second pass: 16 keys spilled 8 bytes at
        # K_PAD 64 (sm_80), 64 keys 8-12 bytes at K_PAD 128 (sm_90); 32 and 16 do not
        return {64: 32, 128: 16}.get(kp, 64), (8 if kp >= 256 else 4)
    return (32 if kp in (128, 256) else 64), (8 if kp == 512 else 4)


def _route_blocks(dtype: torch.dtype) -> tuple[int, int, int]:
    """``(BLOCK_M, BLOCK_N, num_stages)`` of ``_route_shared_kernel``: queries per program and
    landmarks per step. float32 (IEEE FMA loops, operands in registers): 16 × 32, 2 stages; its
    64 × 64 tiles spilled 12-22 KB (stores) per thread at BLOCK_D ≥ 64 and 404 bytes at 32.
    16-bit: 64 × 64, 3 stages, no spills (``python -m mita.kernels.aot --table``)."""
    return (16, 32, 2) if dtype == torch.float32 else (64, 64, 3)


# shape integers unspecialised: one compile serves every N, m, k (Triton would compile
# again for each value's == 1 and % 16 == 0, ~150 compiles of one GPU command run)
@triton.jit(do_not_specialize=["H", "N", "M", "TOPK"])
def _landmark_topk_kernel(
    LM, K, KEY_VALID, IDX, FLAG,
    stride_lb, stride_lh, stride_lm, stride_ld,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_ib, stride_ih, stride_im,
    H, N, M, TOPK, D, scale,
    IEEE: tl.constexpr, UPCAST: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_N: tl.constexpr,
    K_PAD: tl.constexpr, BLOCK_D: tl.constexpr,
):
    pid = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    b = bh // H
    h = bh % H
    lrows = pid * BLOCK_L + tl.arange(0, BLOCK_L)
    lmask = lrows < M
    dd = tl.arange(0, BLOCK_D)
    dmask = dd < D
    lm = load_rows(LM, b, h, lrows, lmask, dd, dmask, stride_lb, stride_lh, stride_lm,
                    stride_ld)
    cols = tl.arange(0, BLOCK_N)
    R: tl.constexpr = K_PAD // BLOCK_N
    part = tl.arange(0, R)

    # Pass 1: the K_PAD largest scores of each landmark (values only, with repeats), kept
    # sorted descending; a super-tile of K_PAD keys is merged only if it can change them.
    best = tl.full([BLOCK_L, K_PAD], NO_KEY, tl.int32)
    for start in range(0, N, K_PAD):
        tile = tl.full([BLOCK_L, R, BLOCK_N], NO_KEY, tl.int32)
        for j in range(R):  # a runtime loop: unrolled, all R key loads would be in flight
            key = score_keys(lm, K, KEY_VALID, b, h, start + j * BLOCK_N + cols, dd, dmask,
                              N, stride_kb, stride_kh, stride_kn, stride_kd, scale, IEEE,
                              UPCAST)
            tile = tl.where(part[None, :, None] == j, key[:, None, :], tile)
        tile = tl.reshape(tile, [BLOCK_L, K_PAD])
        if tl.max((tl.max(tile, 1) > tl.min(best, 1)).to(tl.int32), 0) > 0:
            tile = tl.sort(tile, dim=1)  # ascending
            best = tl.bitonic_merge(tl.maximum(best, tile), dim=1, descending=True)
    # The k-th largest score T; `need` of the keys equal to T are taken, lowest index first.
    rank = tl.arange(0, K_PAD)
    kth = tl.max(tl.where(rank[None, :] == TOPK - 1, best, NO_KEY), 1)
    need = TOPK - tl.sum((best > kth[:, None]).to(tl.int32), 1)

    # Pass 2: the same scores again, left to right: every key above T and the first `need`
    # keys equal to T, written in ascending index order.
    out_row = IDX + b * stride_ib + h * stride_ih + lrows * stride_im
    taken = emit_topk(lm, K, KEY_VALID, out_row, kth, need, lmask, b, h, dd, dmask, N, TOPK,
                       stride_kb, stride_kh, stride_kn, stride_kd, scale, IEEE, UPCAST,
                       BLOCK_L, BLOCK_N)
    # Exactly k taken unless pass 2's scores differ from pass 1's (they are computed by the
    # same code on the same tiles): such a landmark goes to the bisection fallback.
    tl.store(FLAG + bh * M + lrows, (taken != TOPK).to(tl.int8), mask=lmask)


# shape integers unspecialised, as above
@triton.jit(do_not_specialize=["H", "N", "M"])
def _route_shared_kernel(
    Q, LM, SV, LANDMARK_VALID, EXPERT, PART_M, PART_L, PART_ACC,
    stride_qb, stride_qh, stride_qn, stride_qd,
    stride_lb, stride_lh, stride_lm, stride_ld,
    stride_svb, stride_svh, stride_svm, stride_svd,
    H, N, M, D, DV, shared_scale,
    IEEE: tl.constexpr, UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    pid = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    b = bh // H
    h = bh % H
    rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = rows < N
    dd = tl.arange(0, BLOCK_D)
    dmask = dd < D
    dvmask = dd < DV
    q = tl.load(Q + b * stride_qb + h * stride_qh + rows[:, None].to(tl.int64) * stride_qn
                + dd[None, :] * stride_qd, mask=rmask[:, None] & dmask[None, :], other=0.0)
    best = tl.full([BLOCK_M], float("-inf"), tl.float32)
    arg = tl.zeros([BLOCK_M], tl.int32)
    m_i = tl.full([BLOCK_M], NEG_INIT, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    cols = tl.arange(0, BLOCK_N)
    for start in range(0, M, BLOCK_N):
        c = start + cols
        cm = c < M
        lm = tl.load(LM + b * stride_lb + h * stride_lh + c[:, None] * stride_lm
                     + dd[None, :] * stride_ld, mask=cm[:, None] & dmask[None, :], other=0.0)
        sv = tl.load(SV + b * stride_svb + h * stride_svh + c[:, None] * stride_svm
                     + dd[None, :] * stride_svd, mask=cm[:, None] & dvmask[None, :], other=0.0)
        lm_valid = (tl.load(LANDMARK_VALID + b * M + c, mask=cm, other=0) != 0) & cm
        aff = dot(q, tl.trans(lm), IEEE, UPCAST)
        aff = tl.where(lm_valid[None, :], aff, float("-inf"))
        # argmax with the lowest index on ties, across blocks: a later block wins only if
        # strictly greater
        blk_best = tl.max(aff, 1)
        blk_arg = tl.min(tl.where(aff == blk_best[:, None], c[None, :], 2 ** 30), 1)
        take = blk_best > best
        arg = tl.where(take, blk_arg, arg)
        best = tl.where(take, blk_best, best)
        logits = aff * shared_scale
        m_new = tl.maximum(m_i, tl.max(logits, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(logits - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + dot(p.to(sv.dtype), sv, IEEE, UPCAST)
        m_i = m_new
    tl.store(EXPERT + bh * N + rows, arg.to(tl.int64), mask=rmask)
    tl.store(PART_M + bh * N + rows, m_i, mask=rmask)
    tl.store(PART_L + bh * N + rows, l_i, mask=rmask)
    tl.store(PART_ACC + (bh * N + rows[:, None]) * DV + dd[None, :], acc,
             mask=rmask[:, None] & dvmask[None, :])


def landmark_topk_plan(landmarks: Tensor, k: Tensor, topk: int, scale: float,
                       key_padding_mask: Tensor | None = None,
                       interpreter: bool | None = None, key_valid: Tensor | None = None):
    """Validate ``landmark_topk``'s arguments and build its launch: ``(grid, args, meta, out)``
    (``mita.kernels.aot`` compiles the same args/meta ahead of time). Arguments and errors as
    ``landmark_topk``. Specialisations: dtype × ``BLOCK_D`` ∈ {64, 128} × ``K_PAD`` ∈
    {64, 128, 256, 512}; ``BLOCK_N`` and ``num_warps`` from dtype and ``K_PAD``
    (``_topk_blocks``)."""
    check_inputs(k, k)
    B, H, N, d = k.shape
    m = landmarks.shape[2]
    if tuple(landmarks.shape) != (B, H, m, d):
        raise ValueError(f"landmarks must be (B, H, m, d) = {(B, H, m, d)}, got "
                         f"{tuple(landmarks.shape)}")
    if not 1 <= topk <= min(N, MAX_TOPK):
        raise ValueError(f"landmark_topk needs 1 ≤ k ≤ min(N, {MAX_TOPK}), got k = {topk}, "
                         f"N = {N}")
    lm = landmarks.to(k.dtype)
    check_grid(B * H)
    # empty: every slot is written — by pass 2, or for a flagged landmark by the fallback
    out = torch.empty(B, H, m, topk, dtype=torch.int64, device=k.device)
    flag = torch.empty(B, H, m, dtype=torch.int8, device=k.device)
    kp = k_pad(topk)
    block_n, num_warps = _topk_blocks(k.dtype, kp)
    if key_valid is None:
        key_valid = key_valid_vector(key_padding_mask, B, N, k.device)
    args = (lm, k, key_valid, out, flag, *lm.stride(), *k.stride(), *out.stride()[:3],
            H, N, m, topk, d, float(scale))
    meta = dict(IEEE=k.dtype == torch.float32, UPCAST=interpreter_upcast(k, interpreter),
                BLOCK_L=BLOCK_L, BLOCK_N=block_n, K_PAD=kp,
                # 64 or 128: the score product is small next to the sort, and every BLOCK_D
                # is one more specialisation to compile (tests/kernels/test_kernel_compile.py)
                BLOCK_D=max(64, block_d_for(d)),
                num_warps=num_warps)
    return (triton.cdiv(m, BLOCK_L), B * H), args, meta, out


def landmark_topk(landmarks: Tensor, k: Tensor, topk: int, scale: float,
                  key_padding_mask: Tensor | None = None,
                  key_valid: Tensor | None = None) -> Tensor:
    """Stages ``landmark_scores`` + ``topk`` (eqs. 6-7) fused: each landmark's k best keys by
    s_ij = q̃_i·k_j/√d, without the m × N scores.

    Args:
        landmarks: ``(B, H, m, d)`` landmark queries q̃ from ``pool``; cast to k's dtype
            (products in the input dtype, fp32 accumulation — as flash attention).
        scale: the score scale, 1/√d (eq. 6), applied to the fp32 products.
        k: ``(B, H, N, d)`` float16 / bfloat16 / float32 keys, d ≤ 128.
        topk: 1 ≤ k ≤ min(N, 512).
        key_padding_mask: optional ``(B, N)`` bool, True = padding (score -inf).
        key_valid: optional ``(B, N)`` int8 (1 = a real key) built once per forward by the
            caller; replaces ``key_padding_mask`` when given.
    Returns:
        ``(B, H, m, k)`` int64 key indices in ascending order; ties broken by the lowest index
        (padded keys fill a row that has fewer than k real ones, lowest index first) — the
        contract of ``mita.stages.topk_tokens``. A landmark whose second pass did not take
        exactly k keys is redone by ``bisect._bisect_topk_kernel`` (a second launch that returns
        at once when no landmark is flagged; no host synchronisation).
    Raises:
        ValueError: dtype, shapes, d > 128, k outside [1, min(N, 512)], B·H > 65,535.
    """
    grid, args, meta, out = landmark_topk_plan(landmarks, k, topk, scale, key_padding_mask,
                                               key_valid=key_valid)
    _landmark_topk_kernel[grid](*args, **meta)
    bisect_fallback(*args[:3], args[4], out, topk, scale, meta["UPCAST"])
    return out


def route_shared_plan(q: Tensor, landmarks: Tensor, shared_values: Tensor,
                      landmark_valid: Tensor, shared_scale: float,
                      interpreter: bool | None = None):
    """Validate ``route_shared``'s arguments and build its launch: ``(grid, args, meta,
    outputs)``. Specialisations: dtype × ``BLOCK_D`` ∈ {16, 32, 64, 128}; tiles and
    ``num_stages`` from the dtype (``_route_blocks``)."""
    check_inputs(q, q)
    B, H, N, d = q.shape
    m, dv = landmarks.shape[2], shared_values.shape[-1]
    if tuple(landmarks.shape) != (B, H, m, d) or tuple(shared_values.shape[:3]) != (B, H, m):
        raise ValueError("landmarks / shared values must be (B, H, m, d) / (B, H, m, dv)")
    if dv > MAX_HEAD_DIM:
        raise ValueError(f"Triton routing kernels take head dims up to {MAX_HEAD_DIM}, got "
                         f"dv = {dv}")
    check_grid(B * H)
    lm = landmarks.to(q.dtype)
    sv = shared_values.to(q.dtype)
    f32 = dict(dtype=torch.float32, device=q.device)
    experts = torch.empty(B, H, N, 1, dtype=torch.int64, device=q.device)
    part_m, part_l = torch.empty(B, H, N, **f32), torch.empty(B, H, N, **f32)
    part_acc = torch.empty(B, H, N, dv, **f32)
    args = (q, lm, sv, as_int8(landmark_valid), experts, part_m, part_l,
            part_acc, *q.stride(), *lm.stride(), *sv.stride(), H, N, m, d, dv,
            float(shared_scale))
    block_m, block_n, num_stages = _route_blocks(q.dtype)
    meta = dict(IEEE=q.dtype == torch.float32, UPCAST=interpreter_upcast(q, interpreter),
                BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d_for(d, dv),
                num_stages=num_stages)
    return (triton.cdiv(N, block_m), B * H), args, meta, (experts, part_m, part_l, part_acc)


def route_shared(q: Tensor, landmarks: Tensor, shared_values: Tensor, landmark_valid: Tensor,
                 shared_scale: float) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Stage ``route`` for s = 1 (eq. 9) fused with the shared half of the joint softmax
    (eq. 11): q·q̃_i computed once per (query, landmark).

    Args:
        q: ``(B, H, N, d)`` float16 / bfloat16 / float32, d ≤ 128.
        landmarks: ``(B, H, m, d)`` unscaled landmark queries (cast to q's dtype).
        shared_values: ``(B, H, m, dv)`` from ``shared_compress`` (cast to q's dtype).
        landmark_valid: ``(B, m)`` bool (or int8 0/1); empty landmarks are never routed to
            and get no shared weight (at least one per row is valid).
        shared_scale: c of the shared logit c·q·q̃_i (1/√d paper, 1/d official).
    Returns:
        ``experts`` ``(B, H, N, 1)`` int64 (argmax of q·q̃_i, lowest index on ties) and the
        shared branch per query in fp32: running max ``(B, H, N)``, sum of exp ``(B, H, N)``,
        exp-weighted sum of ṽ ``(B, H, N, dv)`` — ``fused_attention(shared_partial=...)``
        continues the online softmax from them. Padded queries are routed like any other; the
        attention kernel drops them.
    Raises:
        ValueError: dtype, shapes, head dims over 128.
    """
    grid, args, meta, outputs = route_shared_plan(q, landmarks, shared_values, landmark_valid,
                                                  shared_scale)
    _route_shared_kernel[grid](*args, **meta)
    return outputs
