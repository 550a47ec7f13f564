"""The backward of MiTA's joint softmax (eqs. 11-12) as Triton kernels: the Triton half of
``mita.joint``'s ``joint_attention_backward`` (arXiv:2602.01219 §3.2).

As flash attention's backward: the forward kept the output O and each query's log-sum-exp
``lse`` over its m + s·k joint logits; here P = exp(ℓ − lse) is recomputed and, with
D = rowsum(dO ∘ O) (computed once, in fp32), dℓ = P ∘ (dO·Vᵀ − D). Five launches after the
dispatch table of the forward (``tile_table_plan``: each head's (query, expert) entries
sorted by expert):

``_shared_dq_kernel``   one program per block of queries: the shared branch's dq (all m
                        landmarks; each query counts them once, whatever s is). Stores dq.
``_shared_dkv_kernel``  one program per (block of landmarks, slice of the queries): the
                        landmarks' and shared values' gradients over that slice (flash
                        attention's dK/dV loop with the m landmarks as keys); the slices'
                        partial sums are added afterwards in a fixed order.
``_routed_dq_kernel``   one program per tile of one expert's entries: the routed logits'
                        dq, added to its query's row (s = 1: each query is in one tile, a plain
                        load-add-store); for s > 1 either per-slot rows summed afterwards
                        (``deterministic``) or fp32 atomics.
``_routed_dkv_kernel``  one program per (expert, block of its keys), looping over the
                        expert's entries: dK, dV of the expert's k keys. A key chosen by several
                        experts gets a row per expert: ``deterministic`` writes them to
                        per-expert rows and ``_key_sum_kernel`` adds them per key through the
                        inverse index (key → the (expert, slot) rows that chose it, built once
                        by a stable sort), in a fixed order; otherwise fp32 atomics into dK, dV.
``_key_sum_kernel``     (``deterministic`` only) one program per block of keys.

Nothing is saved from the forward beyond q, k, v, O, lse and the indices; gradients accumulate
in fp32 (products in the input dtype, as the forward). The key-padding mask and the empty
landmarks are runtime int8 vectors (no specialisation); the specialisations a GPU compiles are
dtype × ``BLOCK_D`` (× s = 1 or not and ``deterministic`` for the routed kernels),
``mita.kernels.aot`` compiles them all.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from .tile_table import run_tile_table, tile_table_plan
from .triton_common import as_int8, block_d_for, dot, interpreter_upcast, key_valid_vector
from .triton_fused import dispatch_tile

# Queries of the shared branch's dk/dv loop per program: the slice count is cdiv(N, this).
SHARED_SLICE = 4096


def _blocks(dtype: torch.dtype, block_d: int, kind: str) -> tuple[int, int, int, int]:
    """``(BLOCK_M, BLOCK_N, num_warps, num_stages)`` of the backward kernels of ``kind``:
    ``"shared_dq"`` / ``"routed_dq"`` (a [BLOCK_M, BLOCK_D] accumulator) or ``"dkv"``
    (``_shared_dkv_kernel``, ``_routed_dkv_kernel``: two [BLOCK_N, BLOCK_D] accumulators
    beside the [BLOCK_N, BLOCK_D] keys and values they hold); BLOCK_M rows (queries /
    entries) and BLOCK_N columns (landmarks / keys) per step. Chosen so that no specialisation
    spills on sm_80 or sm_90 (``python -m mita.kernels.aot --table``; the spills of the
    alternatives tried, per thread):

    - float32 (IEEE FMA loops), one stage: with two, ptxas held the dkv kernels to 32
      registers at BLOCK_D ≥ 64 and spilled 2-5.7 KB. dq 16 × 32 (16 columns at BLOCK_D ≥ 64),
      8 warps (4 warps: 4 bytes at BLOCK_D 128); dkv 16 × 16, 4 warps (8 warps or 32 columns:
      4-8 bytes).
    - 16-bit: shared dq 64 × 64 (32 columns at BLOCK_D 128), 4 warps, 2 stages (16 × 32: 28
      bytes at BLOCK_D 128 on sm_90); routed dq 16 × 32, 4 warps, 2 stages — it also adds its
      rows to dq (atomically for s > 1 without ``deterministic``): 64 rows spilled 16-556
      bytes on sm_80, 32 rows 4-16 bytes; dkv 64 × 32, 4 warps, one stage (64 columns or two
      stages: 16-108 bytes at BLOCK_D ≥ 64)."""
    if dtype == torch.float32:
        if kind == "dkv":
            return 16, 16, 4, 1
        return 16, (32 if block_d <= 32 else 16), 8, 1
    if kind == "dkv":
        return 64, 32, 4, 1
    if kind == "shared_dq":
        return 64, (64 if block_d <= 64 else 32), 4, 2
    return 16, 32, 4, 2


@triton.jit
def _probabilities(logits, lse, ok):
    """P = exp(ℓ − lse) where ``ok`` (a [rows, cols] mask), 0 elsewhere."""
    return tl.where(ok, tl.exp(logits - lse[:, None]), 0.0)


# shape integers unspecialised: one compile serves every N, m (as the forward kernels)
@triton.jit(do_not_specialize=["H", "N", "M"])
def _shared_dq_kernel(
    Q, DO, LSE, DELTA, SK, SV, LANDMARK_VALID, KEY_VALID, DQ,
    H, N, M, D, DV,
    IEEE: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # Grid (cdiv(N, BLOCK_M), B·H); every tensor contiguous. dq = Σ_i dℓ_i · (c·q̃_i).
    bh = tl.program_id(1).to(tl.int64)
    b = bh // H
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rm = rows < N
    rv = rm & (tl.load(KEY_VALID + b * N + rows, mask=rm, other=0) != 0)
    dd = tl.arange(0, BLOCK_D)
    dm = dd < D
    dvm = dd < DV
    row = bh * N + rows
    q = tl.load(Q + row[:, None] * D + dd[None, :], mask=rm[:, None] & dm[None, :], other=0.0)
    do = tl.load(DO + row[:, None] * DV + dd[None, :], mask=rm[:, None] & dvm[None, :],
                 other=0.0)
    lse = tl.load(LSE + row, mask=rv, other=0.0)
    delta = tl.load(DELTA + row, mask=rv, other=0.0)
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    cols = tl.arange(0, BLOCK_N)
    for start in range(0, M, BLOCK_N):
        c = start + cols
        cm = c < M
        ok = rv[:, None] & (cm & (tl.load(LANDMARK_VALID + b * M + c, mask=cm, other=0) != 0))[
            None, :]
        sk = tl.load(SK + (bh * M + c)[:, None] * D + dd[None, :],
                     mask=cm[:, None] & dm[None, :], other=0.0)
        sv = tl.load(SV + (bh * M + c)[:, None] * DV + dd[None, :],
                     mask=cm[:, None] & dvm[None, :], other=0.0)
        p = _probabilities(dot(q, tl.trans(sk), IEEE, UPCAST), lse, ok)
        ds = p * (dot(do, tl.trans(sv), IEEE, UPCAST) - delta[:, None])
        dq += dot(ds.to(sk.dtype), sk, IEEE, UPCAST)
    tl.store(DQ + row[:, None] * D + dd[None, :], dq, mask=rm[:, None] & dm[None, :])


@triton.jit(do_not_specialize=["H", "N", "M", "SLICE"])
def _shared_dkv_kernel(
    Q, DO, LSE, DELTA, SK, SV, LANDMARK_VALID, KEY_VALID, DSK, DSV,
    H, N, M, D, DV, SLICE,
    IEEE: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # Grid (cdiv(M, BLOCK_N) · slices, B·H): landmarks c of one block against the queries of
    # one slice; partial sums to DSK, DSV (slices, B·H, M, ·), fp32.
    bh = tl.program_id(1).to(tl.int64)
    b = bh // H
    blocks = tl.cdiv(M, BLOCK_N)
    slice_id = tl.program_id(0) // blocks
    c = (tl.program_id(0) % blocks) * BLOCK_N + tl.arange(0, BLOCK_N)
    cm = c < M
    cok = cm & (tl.load(LANDMARK_VALID + b * M + c, mask=cm, other=0) != 0)
    dd = tl.arange(0, BLOCK_D)
    dm = dd < D
    dvm = dd < DV
    sk = tl.load(SK + (bh * M + c)[:, None] * D + dd[None, :], mask=cm[:, None] & dm[None, :],
                 other=0.0)
    sv = tl.load(SV + (bh * M + c)[:, None] * DV + dd[None, :],
                 mask=cm[:, None] & dvm[None, :], other=0.0)
    dsk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dsv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    rr = tl.arange(0, BLOCK_M)
    lo = slice_id * SLICE
    for start in range(lo, tl.minimum(lo + SLICE, N), BLOCK_M):
        rows = start + rr
        rm = rows < N
        rv = rm & (tl.load(KEY_VALID + b * N + rows, mask=rm, other=0) != 0)
        row = bh * N + rows
        q = tl.load(Q + row[:, None] * D + dd[None, :], mask=rm[:, None] & dm[None, :],
                    other=0.0)
        do = tl.load(DO + row[:, None] * DV + dd[None, :], mask=rm[:, None] & dvm[None, :],
                     other=0.0)
        lse = tl.load(LSE + row, mask=rv, other=0.0)
        delta = tl.load(DELTA + row, mask=rv, other=0.0)
        p = _probabilities(dot(q, tl.trans(sk), IEEE, UPCAST), lse, rv[:, None] & cok[None, :])
        dsv += dot(tl.trans(p).to(do.dtype), do, IEEE, UPCAST)
        ds = p * (dot(do, tl.trans(sv), IEEE, UPCAST) - delta[:, None])
        dsk += dot(tl.trans(ds).to(q.dtype), q, IEEE, UPCAST)
    base = (slice_id * tl.num_programs(1) + bh) * M + c
    tl.store(DSK + base[:, None] * D + dd[None, :], dsk, mask=cm[:, None] & dm[None, :])
    tl.store(DSV + base[:, None] * DV + dd[None, :], dsv, mask=cm[:, None] & dvm[None, :])


@triton.jit(do_not_specialize=["H", "N", "M", "TOPK", "T", "S"])
def _routed_dq_kernel(
    Q, K, V, DO, LSE, DELTA, IDX, LANDMARK_VALID, KEY_VALID, ORDER, TILE_E, TILE_LO, TILE_HI,
    DQ, H, N, M, TOPK, D, DV, T, S, scale,
    SINGLE_SLOT: tl.constexpr, DETERMINISTIC: tl.constexpr, IEEE: tl.constexpr,
    UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # Grid (T, B·H): one tile of the forward's dispatch table (one expert's entries
    # r = n·s + j), in rows of BLOCK_M entries.
    # SINGLE_SLOT: DQ (B, H, N, D) fp32, the shared branch's dq already in it (add to it).
    # Otherwise DETERMINISTIC: DQ is (B, H, N, S, D) fp32, one row per entry (stored);
    # else DQ is (B, H, N, D) fp32 and the rows are added atomically.
    tile = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    b = bh // H
    e = tl.load(TILE_E + bh * T + tile)
    if e < 0:
        return
    lo = tl.load(TILE_LO + bh * T + tile)
    hi = tl.load(TILE_HI + bh * T + tile)
    dd = tl.arange(0, BLOCK_D)
    dm = dd < D
    dvm = dd < DV
    expert_valid = tl.load(LANDMARK_VALID + b * M + e) != 0
    cols = tl.arange(0, BLOCK_N)
    for r0 in range(lo, hi, BLOCK_M):
        rows = r0 + tl.arange(0, BLOCK_M)
        in_tile = rows < hi
        entry = tl.load(ORDER + bh * N * S + rows, mask=in_tile, other=0)
        row = bh * N + (entry // S).to(tl.int64)
        q = tl.load(Q + row[:, None] * D + dd[None, :], mask=in_tile[:, None] & dm[None, :],
                    other=0.0)
        do = tl.load(DO + row[:, None] * DV + dd[None, :],
                     mask=in_tile[:, None] & dvm[None, :], other=0.0)
        lse = tl.load(LSE + row, mask=in_tile, other=0.0)
        delta = tl.load(DELTA + row, mask=in_tile, other=0.0)
        dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        for start in range(0, TOPK, BLOCK_N):
            c = start + cols
            cm = c < TOPK
            key = tl.load(IDX + (bh * M + e) * TOPK + c, mask=cm, other=0)
            ok = cm & expert_valid & (tl.load(KEY_VALID + b * N + key, mask=cm, other=0) != 0)
            kt = tl.load(K + (bh * N + key)[:, None] * D + dd[None, :],
                         mask=cm[:, None] & dm[None, :], other=0.0)
            vt = tl.load(V + (bh * N + key)[:, None] * DV + dd[None, :],
                         mask=cm[:, None] & dvm[None, :], other=0.0)
            p = _probabilities(dot(q, tl.trans(kt), IEEE, UPCAST) * scale, lse,
                               in_tile[:, None] & ok[None, :])
            ds = p * (dot(do, tl.trans(vt), IEEE, UPCAST) - delta[:, None])
            dq += dot(ds.to(kt.dtype), kt, IEEE, UPCAST)
        dq = dq * scale
        mask = in_tile[:, None] & dm[None, :]
        if SINGLE_SLOT:
            ptr = DQ + row[:, None] * D + dd[None, :]
            tl.store(ptr, tl.load(ptr, mask=mask, other=0.0) + dq, mask=mask)
        elif DETERMINISTIC:
            tl.store(DQ + (bh * N * S + entry)[:, None] * D + dd[None, :], dq, mask=mask)
        else:
            tl.atomic_add(DQ + row[:, None] * D + dd[None, :], dq, mask=mask, sem="relaxed")


@triton.jit(do_not_specialize=["H", "N", "M", "TOPK", "S"])
def _routed_dkv_kernel(
    Q, K, V, DO, LSE, DELTA, IDX, LANDMARK_VALID, KEY_VALID, ORDER, START, COUNT, DK, DV_OUT,
    H, N, M, TOPK, D, DV, S, scale,
    DETERMINISTIC: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # Grid (M · cdiv(TOPK, BLOCK_N), B·H): keys c of expert e against all its entries
    # ORDER[START[e] : START[e] + COUNT[e]]. DETERMINISTIC: DK, DV_OUT (B, H, M, TOPK, ·) fp32
    # per-expert rows (stored); else (B, H, N, ·) fp32, added atomically at the keys.
    bh = tl.program_id(1).to(tl.int64)
    b = bh // H
    blocks = tl.cdiv(TOPK, BLOCK_N)
    e = tl.program_id(0) // blocks
    c = (tl.program_id(0) % blocks) * BLOCK_N + tl.arange(0, BLOCK_N)
    cm = c < TOPK
    key = tl.load(IDX + (bh * M + e) * TOPK + c, mask=cm, other=0)
    expert_valid = tl.load(LANDMARK_VALID + b * M + e) != 0
    ok = cm & expert_valid & (tl.load(KEY_VALID + b * N + key, mask=cm, other=0) != 0)
    dd = tl.arange(0, BLOCK_D)
    dm = dd < D
    dvm = dd < DV
    kt = tl.load(K + (bh * N + key)[:, None] * D + dd[None, :], mask=cm[:, None] & dm[None, :],
                 other=0.0)
    vt = tl.load(V + (bh * N + key)[:, None] * DV + dd[None, :],
                 mask=cm[:, None] & dvm[None, :], other=0.0)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    lo = tl.load(START + bh * M + e)
    hi = lo + tl.load(COUNT + bh * M + e)
    rr = tl.arange(0, BLOCK_M)
    for start in range(lo, hi, BLOCK_M):
        rows = start + rr
        rm = rows < hi
        entry = tl.load(ORDER + bh * N * S + rows, mask=rm, other=0)
        row = bh * N + (entry // S).to(tl.int64)
        q = tl.load(Q + row[:, None] * D + dd[None, :], mask=rm[:, None] & dm[None, :],
                    other=0.0)
        do = tl.load(DO + row[:, None] * DV + dd[None, :], mask=rm[:, None] & dvm[None, :],
                     other=0.0)
        lse = tl.load(LSE + row, mask=rm, other=0.0)
        delta = tl.load(DELTA + row, mask=rm, other=0.0)
        p = _probabilities(dot(q, tl.trans(kt), IEEE, UPCAST) * scale, lse,
                           rm[:, None] & ok[None, :])
        dv += dot(tl.trans(p).to(do.dtype), do, IEEE, UPCAST)
        ds = p * (dot(do, tl.trans(vt), IEEE, UPCAST) - delta[:, None])
        dk += dot(tl.trans(ds).to(q.dtype), q, IEEE, UPCAST)
    dk = dk * scale
    if DETERMINISTIC:
        slot = (bh * M + e) * TOPK + c
        tl.store(DK + slot[:, None] * D + dd[None, :], dk, mask=cm[:, None] & dm[None, :])
        tl.store(DV_OUT + slot[:, None] * DV + dd[None, :], dv, mask=cm[:, None] & dvm[None, :])
    else:
        at = (bh * N + key)[:, None]
        tl.atomic_add(DK + at * D + dd[None, :], dk, mask=cm[:, None] & dm[None, :],
                      sem="relaxed")
        tl.atomic_add(DV_OUT + at * DV + dd[None, :], dv, mask=cm[:, None] & dvm[None, :],
                      sem="relaxed")


@triton.jit(do_not_specialize=["ROWS"])
def _key_sum_kernel(
    PTR, PICKS, EXPERT_DK, EXPERT_DV, DK, DV_OUT, ROWS, D, DV,
    BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # Grid (cdiv(ROWS, BLOCK_K),): keys r of the flattened (B·H·N) rows; PICKS[PTR[r]:PTR[r+1]]
    # are the per-expert rows (B·H·M·TOPK order) that chose key r, ascending: summed in that
    # order, so every run gives the same bits.
    r = tl.program_id(0) * BLOCK_K + tl.arange(0, BLOCK_K)
    rm = r < ROWS
    lo = tl.load(PTR + r, mask=rm, other=0)
    n = tl.load(PTR + r + 1, mask=rm, other=0) - lo
    dd = tl.arange(0, BLOCK_D)
    dm = dd < D
    dvm = dd < DV
    dk = tl.zeros([BLOCK_K, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_K, BLOCK_D], tl.float32)
    for t in range(0, tl.max(n, 0)):
        has = rm & (t < n)
        src = tl.load(PICKS + lo + t, mask=has, other=0)
        dk += tl.load(EXPERT_DK + src[:, None] * D + dd[None, :], mask=has[:, None] & dm[None, :],
                      other=0.0)
        dv += tl.load(EXPERT_DV + src[:, None] * DV + dd[None, :],
                      mask=has[:, None] & dvm[None, :], other=0.0)
    tl.store(DK + r[:, None] * D + dd[None, :], dk, mask=rm[:, None] & dm[None, :])
    tl.store(DV_OUT + r[:, None] * DV + dd[None, :], dv, mask=rm[:, None] & dvm[None, :])


@dataclass
class BackwardPlan:
    """The launches of one backward, in order: ``tiles`` (the dispatch table's, as the
    forward) then ``launches`` ``[(name, kernel, grid, args, meta)]``, and the buffers the
    epilogue reads. ``mita.kernels.aot`` compiles each launch's (args, meta)."""

    tiles: list
    launches: list
    dq: Tensor
    dq_slots: Tensor | None
    dsk: Tensor
    dsv: Tensor
    dk: Tensor
    dv: Tensor


def backward_plan(grad_out: Tensor, q: Tensor, shared_keys: Tensor, shared_values: Tensor,
                  k: Tensor, v: Tensor, out: Tensor, lse: Tensor, expert_index: Tensor,
                  experts: Tensor, landmark_valid: Tensor, query_valid: Tensor | None,
                  deterministic: bool = True, interpreter: bool | None = None) -> BackwardPlan:
    """Buffers and launches of ``joint_backward_triton`` (no launch happens here; works on CPU
    tensors, so ``mita.kernels.aot`` plans the CUDA launches with ``interpreter=False``).
    Arguments as ``joint_backward_triton``, with ``shared_keys`` = landmarks · c in q's
    dtype."""
    B, H, N, d = q.shape
    m, topk = expert_index.shape[2], expert_index.shape[3]
    s, dv_dim = experts.shape[-1], v.shape[-1]
    dev, dtype = q.device, q.dtype
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    do = grad_out.to(dtype).contiguous()
    sk = shared_keys.to(dtype).contiguous()
    sv = shared_values.to(dtype).contiguous()
    lse = lse.float().contiguous()
    delta = (grad_out.float() * out.float()).sum(-1).contiguous()  # D, fp32
    index = expert_index.contiguous()
    key_valid = key_valid_vector(None if query_valid is None else ~query_valid, B, N, dev)
    lm_valid = as_int8(landmark_valid)
    block_d = block_d_for(d, dv_dim)
    sizes = {kind: _blocks(dtype, block_d, kind) for kind in ("shared_dq", "routed_dq", "dkv")}
    # The forward's dispatch tile (its specialisations of the scan are the forward's); the
    # routed dq kernel takes each tile in rows of its own BLOCK_M.
    block_m = dispatch_tile(dtype, block_d, s == 1)
    upcast = interpreter_upcast(q, interpreter)

    def meta(kind, **more):
        bm, bn, warps, stages = sizes[kind]
        return dict(IEEE=dtype == torch.float32, UPCAST=upcast, BLOCK_D=block_d, BLOCK_M=bm,
                    BLOCK_N=bn, num_warps=warps, num_stages=stages, **more)
    tiles, (order, tile_e, tile_lo, tile_hi) = tile_table_plan(
        experts, None if query_valid is None else key_valid, m, block_m)
    T = tile_e.shape[1]
    f32 = dict(dtype=torch.float32, device=dev)
    launches = []
    dq = torch.zeros(B, H, N, d, **f32)
    launches.append(("shared_dq", _shared_dq_kernel,
                     (triton.cdiv(N, sizes["shared_dq"][0]), B * H),
                     (q, do, lse, delta, sk, sv, lm_valid, key_valid, dq, H, N, m, d, dv_dim),
                     meta("shared_dq")))
    slices = triton.cdiv(N, SHARED_SLICE)
    dsk = torch.empty(slices, B * H, m, d, **f32)
    dsv = torch.empty(slices, B * H, m, dv_dim, **f32)
    launches.append(("shared_dkv", _shared_dkv_kernel,
                     (triton.cdiv(m, sizes["dkv"][1]) * slices, B * H),
                     (q, do, lse, delta, sk, sv, lm_valid, key_valid, dsk, dsv, H, N, m, d,
                      dv_dim, SHARED_SLICE), meta("dkv")))
    dq_slots = None
    if s > 1 and deterministic:
        dq_slots = torch.zeros(B, H, N, s, d, **f32)
    launches.append(("routed_dq", _routed_dq_kernel, (T, B * H),
                     (q, k, v, do, lse, delta, index, lm_valid, key_valid, order, tile_e,
                      tile_lo, tile_hi, dq if dq_slots is None else dq_slots, H, N, m, topk, d,
                      dv_dim, T, s, d ** -0.5),
                     # s = 1 never reads DETERMINISTIC: one specialisation, not two
                     meta("routed_dq", SINGLE_SLOT=s == 1,
                          DETERMINISTIC=deterministic or s == 1)))
    # Each expert's run of entries in ``order``: counts per (head, expert), valid queries only.
    valid = (torch.ones(B, N, dtype=torch.bool, device=dev) if query_valid is None
             else query_valid)
    group = (torch.arange(B * H, device=dev).view(B, H, 1, 1) * m + experts).reshape(-1)
    keep = valid[:, None, :, None].expand(B, H, N, s).reshape(-1)
    count = torch.bincount(group[keep], minlength=B * H * m).view(B * H, m)
    start = (count.cumsum(1) - count).contiguous()
    if deterministic:
        expert_dk = torch.empty(B, H, m, topk, d, **f32)
        expert_dv = torch.empty(B, H, m, topk, dv_dim, **f32)
        dk = torch.empty(B, H, N, d, **f32)
        dv = torch.empty(B, H, N, dv_dim, **f32)
    else:
        expert_dk = dk = torch.zeros(B, H, N, d, **f32)
        expert_dv = dv = torch.zeros(B, H, N, dv_dim, **f32)
    launches.append(("routed_dkv", _routed_dkv_kernel,
                     (m * triton.cdiv(topk, sizes["dkv"][1]), B * H),
                     (q, k, v, do, lse, delta, index, lm_valid, key_valid, order, start,
                      count.contiguous(), expert_dk, expert_dv, H, N, m, topk, d, dv_dim, s,
                      d ** -0.5), meta("dkv", DETERMINISTIC=deterministic)))
    if deterministic:
        # The inverse index: every (head, expert, slot) row sorted by the key it holds.
        keys = (index.view(B * H, m * topk)
                + torch.arange(B * H, device=dev)[:, None] * N).reshape(-1)
        sorted_keys, picks = torch.sort(keys, stable=True)
        ptr = torch.zeros(B * H * N + 1, dtype=torch.int64, device=dev)
        ptr[1:] = torch.bincount(sorted_keys, minlength=B * H * N).cumsum(0)
        # 2·BLOCK_K·BLOCK_D = 4,096 fp32 accumulators per program (32 registers per thread):
        # 64 keys at BLOCK_D 128 spilled 84-144 bytes
        block_k = 2048 // block_d
        launches.append(("key_sum", _key_sum_kernel, (triton.cdiv(B * H * N, block_k),),
                         (ptr, picks, expert_dk, expert_dv, dk, dv, B * H * N, d, dv_dim),
                         dict(BLOCK_K=block_k, BLOCK_D=block_d, num_warps=4, num_stages=1)))
    return BackwardPlan(tiles, launches, dq, dq_slots, dsk, dsv, dk, dv)


def joint_backward_triton(grad_out: Tensor, q: Tensor, landmarks: Tensor, shared_values: Tensor,
                          k: Tensor, v: Tensor, out: Tensor, lse: Tensor, expert_index: Tensor,
                          experts: Tensor, landmark_valid: Tensor, query_valid: Tensor | None,
                          c_shared: float, deterministic: bool = True
                          ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The backward of ``mita.joint.joint_attention`` on the Triton kernels (CUDA, or the CPU
    interpreter under ``TRITON_INTERPRET=1``).

    Args: ``grad_out`` dO ``(B, H, N, dv)``; ``q``, ``k`` ``(B, H, N, d)``, ``v``
    ``(B, H, N, dv)`` float16/bfloat16/float32, one dtype, d, dv ≤ 128; ``landmarks``
    ``(B, H, m, d)`` (unscaled), ``shared_values`` ``(B, H, m, dv)``; the forward's ``out``
    and ``lse`` ``(B, H, N)``; ``expert_index`` ``(B, H, m, k)`` int64; ``experts``
    ``(B, H, N, s)`` int64; ``landmark_valid`` ``(B, m)`` bool; ``query_valid`` ``(B, N)``
    bool or None; ``c_shared`` the shared logit scale; ``deterministic``: per-expert and
    per-slot rows summed in a fixed order (the same bits on every run) instead of fp32 atomics
    (faster where many experts share keys, not reproducible bit for bit).
    Returns: dq, d(landmarks), d(shared_values), dk, dv in their inputs' dtypes (fp32 sums).
    """
    plan = backward_plan(grad_out, q, landmarks * c_shared, shared_values, k, v, out, lse,
                         expert_index, experts, landmark_valid, query_valid, deterministic)
    run_tile_table(plan.tiles)
    for _, kernel, grid, args, meta in plan.launches:
        kernel[grid](*args, **meta)
    dq = plan.dq if plan.dq_slots is None else plan.dq + plan.dq_slots.sum(3)
    d_landmarks = plan.dsk.sum(0).view_as(landmarks) * c_shared
    d_shared = plan.dsv.sum(0).view_as(shared_values)
    return (dq.to(q.dtype), d_landmarks.to(landmarks.dtype), d_shared.to(shared_values.dtype),
            plan.dk.to(k.dtype), plan.dv.to(v.dtype))
