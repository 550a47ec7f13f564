"""Fused MiTA ``gather`` + ``attention`` as one Triton kernel (arXiv:2602.01219, eqs. 10-12).

The authors' code runs two flash-attn varlen calls (shared, routed) and merges them by
log-sum-exp. Here one kernel reads each (query, expert) entry's query once and streams both
key sets through one online (flash-style) softmax in fp32:

1. Dispatch, as in MoE: the N·s (query, expert) entries of each (batch, head) are grouped by
   expert id (``tile_table_plan``: a counting sort split across N — count with a relaxed
   atomic cursor per expert, scan over the m experts, scatter). Each expert's run of entries
   is cut into tiles of ``BLOCK_M`` entries; the tile table (expert, first entry, end) is
   built on the device, so nothing synchronises with the host and the grid size is the bound
   cdiv(N·s, BLOCK_M) + m.
   Padded queries get no entry and no tile.
2. Kernel, one program per tile: load the tile's queries (gathered by query index), then
   - s = 1: start from the shared half of the joint softmax that ``routing.route_shared``
     computed per query (max, sum of exp, weighted ṽ: the m shared keys were scored there,
     once, with route's q·q̃ products); s > 1: the m shared keys/values (landmarks q̃
     pre-scaled by the shared scale c, ṽ), empty landmarks (``landmark_valid`` False) masked;
   - the expert's k routed keys/values **read by index from K and V** (``expert_index``), no
     gathered copy of K or V is written; keys that are padding masked;
   with running max / sum / weighted-value accumulators in fp32 (matrix products in the input
   dtype, accumulated in fp32; fp32 inputs use IEEE products, not TF32).
3. s = 1: the kernel normalises and writes the output row of each query in the original order.
   s > 1: **LSE merge of per-entry partials**: each entry writes its (max, sum of exp, weighted
   values) to slot j of its query; the shared keys are folded into slot 0 only, so the s slots
   together cover the m + s·k entries once; a short PyTorch epilogue merges the slots by
   log-sum-exp — exactly the joint softmax of eq. 12.

The stages before it run as ``triton_mita.mita_triton`` does: ``routing.landmark_topk``
(landmark scores + exact top-k, streamed, no m × N scores), ``shared_compress_sdpa`` (eq. 8 as
one SDPA call with the landmarks as queries) and ``routing.route_shared`` (s = 1).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from . import MAX_HEAD_DIM  # BLOCK_D ≤ 128: the tiles fit sm_80's registers and shared memory
from .tile_table import run_tile_table, tile_table_plan
from .triton_common import DTYPES, NEG_INIT, as_int8, block_d_for, dot, key_valid_vector


def _blocks(dtype: torch.dtype, block_d: int, single_slot: bool = True
            ) -> tuple[int, int, int, int]:
    """``(BLOCK_M, BLOCK_N, num_warps, num_stages)`` of ``_mita_fused_kernel``: BLOCK_M entries
    (queries) per tile — also the tile size of the dispatch table — and BLOCK_N keys per inner
    step, for q's dtype, ``BLOCK_D`` and s = 1 (``single_slot``) or not. Chosen so that no
    specialisation spills registers on sm_80 or sm_90 (``python -m mita.kernels.aot --table``,
    benchmarks/RESULTS.md):

    - float32: IEEE products (``input_precision="ieee"``; TF32 would miss the 1e-5 the float32
      path keeps) lower to FMA loops over operands held in registers. 64 × 64 tiles spilled
      13-49 KB (stores) / 19-88 KB (loads) per thread at BLOCK_D ≥ 64, where ptxas fell back to
      32 registers, and 52-384 bytes at 255 registers at BLOCK_D 16-32. 16 × 32 tiles, 4 warps,
      2 stages spill nothing at BLOCK_D 32-64; since s = 1 also stores the joint (max, sum of
      exp) for the backward, 16 × 16 at BLOCK_D 16 (16 × 32 spilled 8 bytes on sm_90) and
      16 × 16 with 8 warps at BLOCK_D 128 (4 warps spilled 4-12 bytes).
    - float16 / bfloat16 (tensor cores), 8 warps, 3 stages: s = 1, 128 rows — two warpgroups
      of Hopper's 64-row wgmma on disjoint rows; at 64 rows both warpgroups computed the same
      scores and softmax (about 40 % of the issue slots) — by 64 keys, 32 at BLOCK_D 128
      (64 spilled 56-80 bytes on sm_80 with the backward's stores). s > 1 keeps 64 × 64: at
      128 rows it spilled 16-132 bytes on sm_80 (BLOCK_D 16 and 128). With 4 warps at 64
      rows, BLOCK_D 128 used 255 registers and spilled up to 64 bytes, and at BLOCK_D 16-64
      ptxas held registers to 128 or 168 (for occupancy) and spilled 4-44 bytes.
    """
    if dtype == torch.float32:
        return 16, (32 if 16 < block_d <= 64 else 16), (4 if block_d <= 64 else 8), 2
    return (128 if single_slot else 64), (32 if single_slot and block_d > 64 else 64), 8, 3


def dispatch_tile(dtype: torch.dtype, block_d: int, single_slot: bool) -> int:
    """Entries per tile of the dispatch table ``fused_attention`` plans (its ``BLOCK_M``):
    the backward (``triton_backward``) cuts its tables the same way."""
    return _blocks(dtype, block_d, single_slot)[0]


@triton.jit
def _online_softmax(m_i, l_i, acc, logits, values, IEEE: tl.constexpr, UPCAST: tl.constexpr):
    """One flash-attention step: fold a block of logits (masked entries -inf) and its values
    into the running max ``m_i``, sum of exp ``l_i`` and weighted values ``acc`` (fp32).
    ``m_i`` starts finite, so an all-masked block adds exp(-inf) = 0."""
    m_new = tl.maximum(m_i, tl.max(logits, 1))
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(logits - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + dot(p.to(values.dtype), values, IEEE, UPCAST)
    return m_new, l_i, acc


# shape integers unspecialised: one compile serves every N, m, k (Triton would compile
# again for each value's == 1 and % 16 == 0, ~150 compiles of one GPU command run)
@triton.jit(do_not_specialize=["H", "N", "M", "TOPK", "T"])
def _mita_fused_kernel(
    Q, K, V, SK, SV, IDX, KEY_VALID, LANDMARK_VALID, ORDER, TILE_E, TILE_LO, TILE_HI,
    OUT, PART_M, PART_L, SHARED_ACC,
    stride_qb, stride_qh, stride_qn, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_skb, stride_skh, stride_skm, stride_skd,
    stride_svb, stride_svh, stride_svm, stride_svd,
    stride_ib, stride_ih, stride_im, stride_ik,
    stride_ob, stride_oh, stride_on, stride_od,
    H, N, M, TOPK, D, DV, T, S, scale,
    SINGLE_SLOT: tl.constexpr, HAS_MASK: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    tile = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)  # 64-bit offsets: B·H·N·d passes 2^31 at N = 1M
    b = bh // H
    h = bh % H
    e = tl.load(TILE_E + bh * T + tile)
    if e < 0:  # the grid is an upper bound on the tile count
        return
    lo = tl.load(TILE_LO + bh * T + tile)
    hi = tl.load(TILE_HI + bh * T + tile)

    rows = lo + tl.arange(0, BLOCK_M)
    in_tile = rows < hi
    entry = tl.load(ORDER + bh * N * S + rows, mask=in_tile, other=0)
    qi = (entry // S).to(tl.int64)
    slot = entry % S
    dd = tl.arange(0, BLOCK_D)
    dmask = dd < D
    dvv = tl.arange(0, BLOCK_D)
    dvmask = dvv < DV

    q = tl.load(Q + b * stride_qb + h * stride_qh + qi[:, None] * stride_qn
                + dd[None, :] * stride_qd, mask=in_tile[:, None] & dmask[None, :], other=0.0)

    cols = tl.arange(0, BLOCK_N)
    if SINGLE_SLOT:
        # The shared half was computed by route_shared (routing.py): continue from its
        # (max, sum of exp, weighted values) for this query.
        row = bh * N + qi
        m_i = tl.load(PART_M + row, mask=in_tile, other=NEG_INIT)
        l_i = tl.load(PART_L + row, mask=in_tile, other=0.0)
        acc = tl.load(SHARED_ACC + row[:, None] * DV + dvv[None, :],
                      mask=in_tile[:, None] & dvmask[None, :], other=0.0)
    else:
        m_i = tl.full([BLOCK_M], NEG_INIT, tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        # Shared keys: all m landmarks, for slot 0 only (each query counts them once).
        first = slot == 0
        for start in range(0, M, BLOCK_N):
            c = start + cols
            cm = c < M
            sk = tl.load(SK + b * stride_skb + h * stride_skh + c[:, None] * stride_skm
                         + dd[None, :] * stride_skd, mask=cm[:, None] & dmask[None, :],
                         other=0.0)
            sv = tl.load(SV + b * stride_svb + h * stride_svh + c[:, None] * stride_svm
                         + dvv[None, :] * stride_svd, mask=cm[:, None] & dvmask[None, :],
                         other=0.0)
            lm_valid = tl.load(LANDMARK_VALID + b * M + c, mask=cm, other=0) != 0
            logits = dot(q, tl.trans(sk), IEEE, UPCAST)
            logits = tl.where(first[:, None] & lm_valid[None, :], logits, float("-inf"))
            m_i, l_i, acc = _online_softmax(m_i, l_i, acc, logits, sv, IEEE, UPCAST)

    # Routed keys of expert e, read from K and V by index (eq. 10 without a copy).
    expert_valid = tl.load(LANDMARK_VALID + b * M + e) != 0
    idx_base = IDX + b * stride_ib + h * stride_ih + e * stride_im
    for start in range(0, TOPK, BLOCK_N):
        c = start + cols
        cm = c < TOPK
        key = tl.load(idx_base + c * stride_ik, mask=cm, other=0)
        ok = cm & expert_valid
        if HAS_MASK:
            ok = ok & (tl.load(KEY_VALID + b * N + key, mask=cm, other=0) != 0)
        kt = tl.load(K + b * stride_kb + h * stride_kh + key[:, None] * stride_kn
                     + dd[None, :] * stride_kd, mask=cm[:, None] & dmask[None, :], other=0.0)
        vt = tl.load(V + b * stride_vb + h * stride_vh + key[:, None] * stride_vn
                     + dvv[None, :] * stride_vd, mask=cm[:, None] & dvmask[None, :], other=0.0)
        logits = dot(q, tl.trans(kt), IEEE, UPCAST) * scale
        logits = tl.where(ok[None, :], logits, float("-inf"))
        m_i, l_i, acc = _online_softmax(m_i, l_i, acc, logits, vt, IEEE, UPCAST)

    if SINGLE_SLOT:
        # The joint softmax's (max, sum of exp) over the shared partial read above, for the
        # backward's log-sum-exp (mita/kernels/triton_backward.py); stored before the output so
        # that the maximum is dead by then (after it, 4-80 bytes spilled at BLOCK_D 128).
        tl.store(PART_M + row, m_i, mask=in_tile)
        tl.store(PART_L + row, l_i, mask=in_tile)
        o = acc / l_i[:, None]
        tl.store(OUT + b * stride_ob + h * stride_oh + qi[:, None] * stride_on
                 + dvv[None, :] * stride_od, o.to(OUT.dtype.element_ty),
                 mask=in_tile[:, None] & dvmask[None, :])
    else:
        # Partials laid out (B, H, N, S, DV) and (B, H, N, S), contiguous.
        part = (bh * N + qi) * S + slot
        tl.store(OUT + part[:, None] * DV + dvv[None, :], acc,
                 mask=in_tile[:, None] & dvmask[None, :])
        tl.store(PART_M + part, m_i, mask=in_tile)
        tl.store(PART_L + part, l_i, mask=in_tile)


@dataclass
class LaunchPlan:
    """Everything one ``_mita_fused_kernel`` launch needs: ``grid``, the positional ``args``
    and ``meta`` (the constexprs and ``num_stages``), plus the buffers the epilogue reads.
    ``tiles`` are the ``tile_table_plan`` launches ``[(kernel, grid, args, meta)]`` that must
    run first (they write the tile table ``args`` reads). ``fused_attention`` launches both;
    ``mita.kernels.aot`` (run by ``tests/kernels/test_kernel_compile.py``) compiles the same (args,
    meta) ahead of time for sm_80 / sm_90 through Triton's own launch-time specialisation."""

    grid: tuple[int, int]
    args: tuple
    meta: dict
    out: Tensor
    target: Tensor
    part_m: Tensor
    part_l: Tensor
    tiles: list


def launch_plan(q: Tensor, k: Tensor, v: Tensor, shared_keys: Tensor | None,
                shared_values: Tensor, landmark_valid: Tensor, expert_index: Tensor,
                experts: Tensor, key_padding_mask: Tensor | None = None,
                out: Tensor | None = None, interpreter: bool | None = None,
                shared_partial: tuple[Tensor, Tensor, Tensor] | None = None,
                key_valid: Tensor | None = None) -> LaunchPlan:
    """Validate ``fused_attention``'s arguments and build its launch (tile table, buffers,
    kernel arguments, constexpr specialisation). Arguments, returns and errors as
    ``fused_attention``; works on CPU tensors (no launch happens here). ``interpreter``: plan
    for the CPU interpreter (default: when the tensors are on the CPU); ``False`` with CPU
    tensors gives exactly the plan of a CUDA launch (``mita.kernels.aot`` compiles that).

    The constexprs it can choose, and so the specialisations a GPU compiles: dtype
    (float16 / bfloat16 / float32, ``IEEE`` iff float32), ``SINGLE_SLOT`` (s = 1),
    ``HAS_MASK``, ``BLOCK_D`` ∈ {16, 32, 64, 128} (``max(d, dv)`` rounded up to a power of two);
    ``UPCAST`` only for bfloat16 on the CPU interpreter, never on CUDA; ``BLOCK_M``,
    ``BLOCK_N``, ``num_warps``, ``num_stages`` from the dtype and ``BLOCK_D`` (``_blocks``).
    """
    if q.dtype not in DTYPES:
        raise ValueError(f"fused MiTA kernel takes float16/bfloat16/float32, got {q.dtype}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    B, H, N, d = q.shape
    m, topk = expert_index.shape[2], expert_index.shape[3]
    s = experts.shape[-1]
    dv = v.shape[-1]
    if k.shape != q.shape or v.shape[:3] != q.shape[:3]:
        raise ValueError(f"q, k, v shapes disagree: {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(v.shape)}")
    if max(d, dv) > MAX_HEAD_DIM:
        raise ValueError(f"the fused MiTA kernel takes head dims up to {MAX_HEAD_DIM}, got "
                         f"d = {d}, dv = {dv}; use backend='torch'")
    if shared_keys is None:
        if s != 1 or shared_partial is None:
            raise ValueError("shared_keys may be None only for s = 1 with shared_partial")
        shared_keys = shared_values  # unread: SINGLE_SLOT starts from the shared partial
    elif tuple(shared_keys.shape) != (B, H, m, d):
        raise ValueError("shared keys must be (B, H, m, d)")
    if tuple(shared_values.shape) != (B, H, m, dv):
        raise ValueError("shared values must be (B, H, m, dv)")
    if tuple(experts.shape[:3]) != (B, H, N):
        raise ValueError(f"experts must be (B, H, N, s), got {tuple(experts.shape)}")

    shared_keys = shared_keys.to(q.dtype)
    shared_values = shared_values.to(q.dtype)
    landmark_valid_i8 = as_int8(landmark_valid)
    if key_padding_mask is None:
        key_valid = None
    elif key_valid is None:
        key_valid = key_valid_vector(key_padding_mask, B, N, q.device)
    block_d = block_d_for(d, dv)
    block_m, block_n, num_warps, num_stages = _blocks(q.dtype, block_d, s == 1)
    tiles, (order, tile_e, tile_lo, tile_hi) = tile_table_plan(experts, key_valid, m, block_m)
    T = tile_e.shape[1]
    if out is None:
        out = q.new_empty(B, H, N, dv)
    elif tuple(out.shape) != (B, H, N, dv) or out.dtype != q.dtype:
        raise ValueError(f"out must be {(B, H, N, dv)} {q.dtype}")
    if s == 1:
        if shared_partial is None:
            raise ValueError("s = 1 needs shared_partial from routing.route_shared")
        part_m, part_l, shared_acc = (t.contiguous() for t in shared_partial)
        if (tuple(part_m.shape) != (B, H, N) or tuple(part_l.shape) != (B, H, N)
                or tuple(shared_acc.shape) != (B, H, N, dv)):
            raise ValueError("shared_partial must be (B, H, N), (B, H, N), (B, H, N, dv)")
        target = out
    else:
        target = torch.empty(B, H, N, s, dv, dtype=torch.float32, device=q.device)
        part_m = torch.empty(B, H, N, s, dtype=torch.float32, device=q.device)
        part_l = torch.empty(B, H, N, s, dtype=torch.float32, device=q.device)
        shared_acc = part_l  # unused for s > 1
    args = (q, k, v, shared_keys, shared_values, expert_index,
            landmark_valid_i8 if key_valid is None else key_valid,  # unread without a mask
            landmark_valid_i8, order, tile_e, tile_lo, tile_hi, target, part_m, part_l,
            shared_acc,
            *q.stride(), *k.stride(), *v.stride(), *shared_keys.stride(),
            *shared_values.stride(), *expert_index.stride(), *out.stride(),
            H, N, m, topk, d, dv, T, s, d ** -0.5)
    meta = dict(SINGLE_SLOT=s == 1, HAS_MASK=key_padding_mask is not None,
                IEEE=q.dtype == torch.float32,
                UPCAST=q.dtype == torch.bfloat16 and (
                    not q.is_cuda if interpreter is None else interpreter),
                BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d, num_warps=num_warps,
                num_stages=num_stages)
    return LaunchPlan((T, B * H), args, meta, out, target, part_m, part_l, tiles)


def fused_attention(q: Tensor, k: Tensor, v: Tensor, shared_keys: Tensor | None,
                    shared_values: Tensor, landmark_valid: Tensor, expert_index: Tensor,
                    experts: Tensor, key_padding_mask: Tensor | None = None,
                    out: Tensor | None = None,
                    shared_partial: tuple[Tensor, Tensor, Tensor] | None = None,
                    key_valid: Tensor | None = None, lse: Tensor | None = None) -> Tensor:
    """Fused stages ``gather`` + ``attention`` (eqs. 10-12): the tile table
    (``tile_table_plan``: count, scan, scatter) and one attention kernel (plus, with a mask,
    zeroing the padded rows; for s > 1 the merge of the slots).

    Args:
        q, k: ``(B, H, N, d)``; v: ``(B, H, N, dv)``; float16, bfloat16 or float32 (one dtype);
            d, dv ≤ 128.
        shared_keys: ``(B, H, m, d)`` landmarks **already multiplied by the shared scale c**
            (1/√d paper, 1/d official); cast to q's dtype. None for s = 1 with
            ``shared_partial`` (the kernel then reads no shared keys).
        shared_values: ``(B, H, m, dv)`` from ``shared_compress``; cast to q's dtype.
        landmark_valid: ``(B, m)`` bool (or int8 0/1), False for empty landmarks (masked
            everywhere).
        expert_index: ``(B, H, m, k)`` int key indices from ``topk``.
        experts: ``(B, H, N, s)`` int expert ids from ``route``.
        key_padding_mask: optional ``(B, N)`` bool, True = padding.
        out: optional ``(B, H, N, dv)`` output buffer in q's dtype (tests poison it first).
        shared_partial: s = 1 only, optional: the shared half of the joint softmax per query
            from ``routing.route_shared`` (max, sum of exp, weighted ṽ); computed here from
            ``shared_keys`` when not given. Its max and sum are **overwritten** with the joint
            softmax's (what ``lse`` is made of): pass a fresh one to each call.
        key_valid: optional ``(B, N)`` int8, 1 = a real key: ``key_padding_mask`` as the
            kernels read it (``pooling.pool_landmarks`` writes it), built here when not given.
        lse: optional ``(B, H, N)`` float32 buffer, filled at every valid query with the
            log-sum-exp of its m + s·k joint logits (padded queries' entries are left as
            they are): what the backward (``triton_backward``) recomputes P from. For s = 1
            the kernel writes the joint (max, sum of exp) over ``shared_partial``'s (which it
            reads first).
    Returns:
        ``(B, H, N, dv)`` in q's dtype; rows of padded queries are **zero**. Routed logits use
        1/√d. fp32 accumulation throughout.
    Raises:
        ValueError: unsupported dtype, mismatched shapes, a head dim over 128, or CPU tensors
        without ``TRITON_INTERPRET=1``.
    """
    if not q.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("the Triton MiTA kernel needs CUDA tensors (or TRITON_INTERPRET=1 "
                         "for the CPU interpreter); use backend='torch' on CPU")
    if experts.shape[-1] == 1 and shared_partial is None:
        from .routing import route_shared

        shared_partial = route_shared(q, shared_keys, shared_values, landmark_valid, 1.0)[1:]
    plan = launch_plan(q, k, v, shared_keys, shared_values, landmark_valid, expert_index,
                       experts, key_padding_mask, out, shared_partial=shared_partial,
                       key_valid=key_valid)
    run_tile_table(plan.tiles)
    _mita_fused_kernel[plan.grid](*plan.args, **plan.meta)
    out = plan.out
    if lse is not None and plan.meta["SINGLE_SLOT"]:
        # the kernel wrote the joint (max, sum of exp) over the shared partial it read
        valid = plan.part_m.new_ones(plan.part_m.shape, dtype=torch.bool)
        if key_padding_mask is not None:
            valid = ~key_padding_mask[:, None, :].expand_as(valid)
        lse.copy_(torch.where(valid, plan.part_m + plan.part_l.log(), lse))
    if not plan.meta["SINGLE_SLOT"]:
        # Slots with no valid key have max -1e30 and weight 0; slot 0 holds the shared keys,
        # so every real query has a finite top.
        top = plan.part_m.amax(-1, keepdim=True)
        w = torch.exp(plan.part_m - top)
        total = (w * plan.part_l).sum(-1, keepdim=True)
        out.copy_((w[..., None] * plan.target).sum(-2) / total)
        if lse is not None:
            valid = torch.ones_like(total[..., 0], dtype=torch.bool)
            if key_padding_mask is not None:
                valid = ~key_padding_mask[:, None, :].expand_as(valid)
            lse.copy_(torch.where(valid, (top + total.log())[..., 0], lse))
    if key_padding_mask is not None:
        out.masked_fill_(key_padding_mask[:, None, :, None], 0.0)
    return out
