"""Fused MiTA ``gather`` + ``attention`` as one Triton kernel (arXiv:2602.01219, eqs. 10-12).

The authors' code runs two flash-attn varlen calls (shared, routed) and merges them by
log-sum-exp. Here one kernel reads each (query, expert) entry's query once and streams both
key sets through one online (flash-style) softmax in fp32:

1. Dispatch, as in MoE: the N·s (query, expert) entries of each (batch, head) are sorted by
   expert id (``torch.sort``, stable). Each expert's run of entries is cut into tiles of
   ``BLOCK_M`` entries; a tile table (expert, first entry, end) is built on the device, so
   nothing synchronises with the host and the grid size is the bound cdiv(N·s, BLOCK_M) + m.
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

BLOCK_M = 64  # entries (queries) per tile; an expert holds ~N·s/m entries (256+ at N ≥ 16K)
BLOCK_N = 64  # keys per inner step (flash-attention-like tile for d ≤ 128)
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# Running-max start: finite, so fully masked blocks give exp(-inf) = 0. A module global read
# inside @jit must be a tl.constexpr: the GPU compiler rejects plain globals (the interpreter
# does not), tests/test_kernel_compile.py compiles every specialisation to catch that class.
_NEG_INIT = tl.constexpr(-1.0e30)


@triton.jit
def _dot(a, b, IEEE: tl.constexpr, UPCAST: tl.constexpr):
    """a @ b with fp32 accumulation. UPCAST only under the CPU interpreter for bfloat16, whose
    ``tl.dot`` multiplies raw bfloat16 bit patterns (triton-lang/triton#11584); the operands
    are still rounded to bfloat16 first, so the interpreter sees the same values a GPU does."""
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def _online_softmax(m_i, l_i, acc, logits, values, IEEE: tl.constexpr, UPCAST: tl.constexpr):
    """One flash-attention step: fold a block of logits (masked entries -inf) and its values
    into the running max ``m_i``, sum of exp ``l_i`` and weighted values ``acc`` (fp32).
    ``m_i`` starts finite, so an all-masked block adds exp(-inf) = 0."""
    m_new = tl.maximum(m_i, tl.max(logits, 1))
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(logits - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + _dot(p.to(values.dtype), values, IEEE, UPCAST)
    return m_new, l_i, acc


@triton.jit
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
        m_i = tl.load(PART_M + row, mask=in_tile, other=_NEG_INIT)
        l_i = tl.load(PART_L + row, mask=in_tile, other=0.0)
        acc = tl.load(SHARED_ACC + row[:, None] * DV + dvv[None, :],
                      mask=in_tile[:, None] & dvmask[None, :], other=0.0)
    else:
        m_i = tl.full([BLOCK_M], _NEG_INIT, tl.float32)
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
            logits = _dot(q, tl.trans(sk), IEEE, UPCAST)
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
        logits = _dot(q, tl.trans(kt), IEEE, UPCAST) * scale
        logits = tl.where(ok[None, :], logits, float("-inf"))
        m_i, l_i, acc = _online_softmax(m_i, l_i, acc, logits, vt, IEEE, UPCAST)

    if SINGLE_SLOT:
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


def _tile_table(experts: Tensor, key_padding_mask: Tensor | None, m: int, block_m: int):
    """Sort each (b, h)'s N·s entries by expert and cut each expert's run into tiles.

    Returns ``order`` ``(B·H, N·s)`` int32 (entry ids r = n·s + j in expert order) and
    ``tile_e``, ``tile_lo``, ``tile_hi`` ``(B·H, T)`` int32 with T = cdiv(N·s, block_m) + m;
    unused tiles have ``tile_e = -1``. Padded queries go to a dummy expert m that gets no tile.
    All on the device, no host synchronisation.
    """
    B, H, N, s = experts.shape
    flat = experts.reshape(B * H, N * s)
    if key_padding_mask is not None:
        pad = key_padding_mask.repeat_interleave(s, dim=1)  # (B, N·s)
        flat = flat.masked_fill(pad.repeat_interleave(H, dim=0), m)
    _, order = torch.sort(flat, dim=1, stable=True)
    counts = torch.zeros(B * H, m + 1, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(1, flat, torch.ones_like(flat))
    counts = counts[:, :m]
    seg_start = counts.cumsum(1) - counts
    tiles = (counts + block_m - 1) // block_m
    tile_end = tiles.cumsum(1)  # tiles of experts 0..e, inclusive
    T = triton.cdiv(N * s, block_m) + m
    t = torch.arange(T, device=flat.device).expand(B * H, T).contiguous()
    e = torch.searchsorted(tile_end, t, right=True)  # expert owning tile t (m: unused)
    used = e < m
    e_c = e.clamp(max=m - 1)
    first_tile = tile_end.gather(1, e_c) - tiles.gather(1, e_c)
    lo = seg_start.gather(1, e_c) + (t - first_tile) * block_m
    hi = seg_start.gather(1, e_c) + counts.gather(1, e_c)
    tile_e = torch.where(used, e, -1)
    return (order.to(torch.int32), tile_e.to(torch.int32), lo.to(torch.int32),
            torch.minimum(hi, lo + block_m).to(torch.int32))


@dataclass
class LaunchPlan:
    """Everything one ``_mita_fused_kernel`` launch needs: ``grid``, the positional ``args``
    and ``meta`` (the constexprs and ``num_stages``), plus the buffers the epilogue reads.
    ``fused_attention`` launches it; ``mita.kernels.aot`` (run by
    ``tests/test_kernel_compile.py``) compiles the same (args, meta) ahead of time for sm_80 /
    sm_90 through Triton's own launch-time specialisation."""

    grid: tuple[int, int]
    args: tuple
    meta: dict
    out: Tensor
    target: Tensor
    part_m: Tensor
    part_l: Tensor


def launch_plan(q: Tensor, k: Tensor, v: Tensor, shared_keys: Tensor, shared_values: Tensor,
                landmark_valid: Tensor, expert_index: Tensor, experts: Tensor,
                key_padding_mask: Tensor | None = None, out: Tensor | None = None,
                interpreter: bool | None = None,
                shared_partial: tuple[Tensor, Tensor, Tensor] | None = None) -> LaunchPlan:
    """Validate ``fused_attention``'s arguments and build its launch (tile table, buffers,
    kernel arguments, constexpr specialisation). Arguments, returns and errors as
    ``fused_attention``; works on CPU tensors (no launch happens here). ``interpreter``: plan
    for the CPU interpreter (default: when the tensors are on the CPU); ``False`` with CPU
    tensors gives exactly the plan of a CUDA launch (``mita.kernels.aot`` compiles that).

    The constexprs it can choose, and so the specialisations a GPU compiles: dtype
    (float16 / bfloat16 / float32, ``IEEE`` iff float32), ``SINGLE_SLOT`` (s = 1),
    ``HAS_MASK``, ``BLOCK_D`` ∈ {16, 32, 64, 128} (``max(d, dv)`` rounded up to a power of two);
    ``UPCAST`` only for bfloat16 on the CPU interpreter, never on CUDA; ``num_stages`` 2 for
    float32 with ``BLOCK_D`` = 128 (shared memory), else 3.
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
    if tuple(shared_keys.shape) != (B, H, m, d) or tuple(shared_values.shape) != (B, H, m, dv):
        raise ValueError("shared keys/values must be (B, H, m, d) / (B, H, m, dv)")
    if tuple(experts.shape[:3]) != (B, H, N):
        raise ValueError(f"experts must be (B, H, N, s), got {tuple(experts.shape)}")

    shared_keys = shared_keys.to(q.dtype)
    shared_values = shared_values.to(q.dtype)
    landmark_valid_i8 = landmark_valid.to(torch.int8).contiguous()
    key_valid = (~key_padding_mask).to(torch.int8).contiguous() \
        if key_padding_mask is not None else landmark_valid_i8  # unused placeholder: no mask
    order, tile_e, tile_lo, tile_hi = _tile_table(experts, key_padding_mask, m, BLOCK_M)
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
    args = (q, k, v, shared_keys, shared_values, expert_index, key_valid, landmark_valid_i8, order,
            tile_e, tile_lo, tile_hi, target, part_m, part_l, shared_acc,
            *q.stride(), *k.stride(), *v.stride(), *shared_keys.stride(),
            *shared_values.stride(), *expert_index.stride(), *out.stride(),
            H, N, m, topk, d, dv, T, s, d ** -0.5)
    block_d = max(16, triton.next_power_of_2(max(d, dv)))
    meta = dict(SINGLE_SLOT=s == 1, HAS_MASK=key_padding_mask is not None,
                IEEE=q.dtype == torch.float32,
                UPCAST=q.dtype == torch.bfloat16 and (
                    not q.is_cuda if interpreter is None else interpreter),
                BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_D=block_d,
                # float32 tiles of 128 columns, software-pipelined 3 deep, need 176 KiB of
                # shared memory: over sm_80's 163 KiB (the launch would fail). 2 stages: 112 KiB.
                num_stages=2 if q.element_size() * block_d >= 512 else 3)
    return LaunchPlan((T, B * H), args, meta, out, target, part_m, part_l)


def fused_attention(q: Tensor, k: Tensor, v: Tensor, shared_keys: Tensor,
                    shared_values: Tensor, landmark_valid: Tensor, expert_index: Tensor,
                    experts: Tensor, key_padding_mask: Tensor | None = None,
                    out: Tensor | None = None,
                    shared_partial: tuple[Tensor, Tensor, Tensor] | None = None) -> Tensor:
    """Fused stages ``gather`` + ``attention`` (eqs. 10-12) with one Triton kernel.

    Args:
        q, k: ``(B, H, N, d)``; v: ``(B, H, N, dv)``; float16, bfloat16 or float32 (one dtype);
            d, dv ≤ 128.
        shared_keys: ``(B, H, m, d)`` landmarks **already multiplied by the shared scale c**
            (1/√d paper, 1/d official); cast to q's dtype.
        shared_values: ``(B, H, m, dv)`` from ``shared_compress``; cast to q's dtype.
        landmark_valid: ``(B, m)`` bool, False for empty landmarks (masked everywhere).
        expert_index: ``(B, H, m, k)`` int key indices from ``topk``.
        experts: ``(B, H, N, s)`` int expert ids from ``route``.
        key_padding_mask: optional ``(B, N)`` bool, True = padding.
        out: optional ``(B, H, N, dv)`` output buffer in q's dtype (tests poison it first).
        shared_partial: s = 1 only, optional: the shared half of the joint softmax per query
            from ``routing.route_shared`` (max, sum of exp, weighted ṽ); computed here from
            ``shared_keys`` when not given.
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
                       experts, key_padding_mask, out, shared_partial=shared_partial)
    _mita_fused_kernel[plan.grid](*plan.args, **plan.meta)
    out = plan.out
    if not plan.meta["SINGLE_SLOT"]:
        # Slots with no valid key have max -1e30 and weight 0; slot 0 holds the shared keys,
        # so every real query has a finite top.
        top = plan.part_m.amax(-1, keepdim=True)
        w = torch.exp(plan.part_m - top)
        merged = (w[..., None] * plan.target).sum(-2) / (w * plan.part_l).sum(-1, keepdim=True)
        out.copy_(merged)
    if key_padding_mask is not None:
        out.masked_fill_(key_padding_mask[:, None, :, None], 0.0)
    return out
