"""Exact top-k of the landmark scores by threshold and filter, split across N (eqs. 6-7).

``threshold_topk`` replaces the stages ``landmark_scores`` + ``topk`` on the Triton path
without the m × N score matrix and without sorting N. Public radix / threshold top-k kernels
for long rows (PyTorch's radix select, FlashInfer's filtered top-k, TensorRT-LLM's split-row
indexer top-k) never sort a row either; this design follows the same idea with a bound that
needs no histogram:

1. **Group max** (``_groupmax_kernel``, grid (landmark blocks × C chunks of N, B·H)): 64
   landmarks score a chunk of keys tile by tile (``triton_common.score_keys``: the same
   order-preserving int32 keys as the bitonic kernel) and keep an elementwise running max
   per column of the [64, 64] score tile. Chunk c holds the tiles c, c + C, c + 2C, … and key
   j of chunk c falls in group (c, j mod 64), so neighbouring keys (pooled landmarks score a
   neighbourhood alike) land in different groups, and a row padded at its end still reaches
   every group;
   the G = 64·C group maxima per landmark are written out. The chunk-0 programs also zero the
   candidate counters the filter appends with.
2. **Threshold**: θ = the k-th largest group max (one ``torch.topk`` over G values per
   landmark). The groups are disjoint, so the k largest group maxima are k distinct keys'
   scores: θ ≤ the k-th largest score, a guaranteed lower bound.
3. **Filter** (``_filter_kernel``, grid as 1): the same scores again (same code, same tiles:
   bit-identical), and every (score, index) with score ≥ θ appended to a per-landmark buffer
   of ``CAP`` slots through an atomic counter, packed into one int64 whose order is (score
   descending, index ascending).
4. **Select** (``_select_kernel``, one program per 2,048 candidate slots: 16 landmarks
   of 128 down to one of 4,096): sort the candidates (at most
   ``CAP``) descending, keep k, sort their indices ascending — the project's lowest-index tie
   rule, deterministic whatever order the atomics appended in. A landmark whose candidates
   overflowed ``CAP`` (mass ties at θ, as with small-integer inputs, or strongly clustered
   scores) is flagged and left to
5. **the exact fallback** (``_bisect_topk_kernel``): programs whose landmarks are all
   unflagged return at once; the others find the k-th score T by bisection over the 32-bit
   keys (32 counting passes over N) and write every key above T and the first keys equal to T,
   left to right (``triton_common.emit_topk``). No host synchronisation anywhere, so it runs inside
   a CUDA graph capture.

Cost: the score product twice (2·2·m·N·d FLOPs, tensor cores), one max per score, the
threshold's top-k over m·G values, and a sort of ≤ ``CAP`` pairs per landmark. Memory: m·G
int32 group maxima and m·CAP int64 candidates per (batch, head).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .bisect import bisect_plan
from .triton_common import (
    NO_KEY,
    block_d_for,
    check_grid,
    check_inputs,
    interpreter_upcast,
    key_valid_vector,
    load_rows,
    score_keys,
)

SELECT_BLOCK_L = 64  # landmarks per group-max / filter program (a tensor-core-sized tile)
SELECT_BLOCK_N = 64  # keys per score tile = groups per chunk
SELECT_ELEMENTS = 2048  # candidates one select program sorts: 16 landmarks of 128 … 1 of 2,048
MAX_SELECT_TOPK = 2048  # candidate buffers up to 4,096 int64 sorted by one program
TARGET_PROGRAMS = 264  # ≥ 2 programs per SM on a 132-SM H100 / H200
GROUPS_PER_K = 4  # G ≥ 4k groups: for continuous scores ~1.1-1.3k keys reach θ


def candidate_capacity(topk: int) -> int:
    """Candidate slots per landmark: twice k rounded up to a power of two (≥ 128)."""
    return max(128, 2 * triton.next_power_of_2(topk))


def select_blocks(dtype: torch.dtype) -> tuple[int, int]:
    """``(BLOCK_L, BLOCK_N)`` of the group-max and filter kernels: landmarks × keys per score
    tile. 16-bit: 64 × 64 (tensor-core tiles). float32: 16 × 16 — its IEEE products are FMA
    loops over registers, and 64 × 64 tiles spilled 7-27 KB per thread at BLOCK_D 128
    (``python -m mita.kernels.aot --table``)."""
    return (16, 16) if dtype == torch.float32 else (SELECT_BLOCK_L, SELECT_BLOCK_N)


def num_chunks(n: int, m: int, topk: int, bh: int, block_l: int = SELECT_BLOCK_L,
               block_n: int = SELECT_BLOCK_N) -> tuple[int, int]:
    """``(C, tiles per chunk)`` for N keys in tiles of ``block_n`` and ``block_l`` landmarks
    per program: enough chunks for ``TARGET_PROGRAMS`` programs and for ``GROUPS_PER_K``·k
    groups, at most one chunk per tile; every chunk holds at least one tile."""
    tiles = triton.cdiv(n, block_n)
    want = max(triton.cdiv(TARGET_PROGRAMS, triton.cdiv(m, block_l) * bh),
               triton.cdiv(GROUPS_PER_K * topk, block_n))
    per_chunk = triton.cdiv(tiles, min(tiles, want))
    return triton.cdiv(tiles, per_chunk), per_chunk


@triton.jit
def _groupmax_kernel(
    LM, K, KEY_VALID, GMAX, COUNT,
    stride_lb, stride_lh, stride_lm, stride_ld,
    stride_kb, stride_kh, stride_kn, stride_kd,
    H, N, M, D, C, TILES_PER_CHUNK, scale,
    IEEE: tl.constexpr, UPCAST: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    pid = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    b = bh // H
    h = bh % H
    lb = pid // C
    chunk = pid % C
    lrows = lb * BLOCK_L + tl.arange(0, BLOCK_L)
    lmask = lrows < M
    dd = tl.arange(0, BLOCK_D)
    dmask = dd < D
    lm = load_rows(LM, b, h, lrows, lmask, dd, dmask, stride_lb, stride_lh, stride_lm,
                    stride_ld)
    cols = tl.arange(0, BLOCK_N)
    best = tl.full([BLOCK_L, BLOCK_N], NO_KEY, tl.int32)
    # chunk c holds tiles c, c + C, c + 2C, …: a row's real keys (padding at its end, as the
    # service pads) reach every chunk, so every group, not only the first chunks'
    for t in range(TILES_PER_CHUNK):
        key = score_keys(lm, K, KEY_VALID, b, h, (chunk + t * C) * BLOCK_N + cols, dd, dmask, N,
                          stride_kb, stride_kh, stride_kn, stride_kd, scale, IEEE, UPCAST)
        best = tl.maximum(best, key)
    G = C * BLOCK_N
    row = bh * M + lrows
    tl.store(GMAX + row[:, None] * G + chunk * BLOCK_N + cols[None, :], best,
             mask=lmask[:, None])
    if chunk == 0:
        tl.store(COUNT + row, tl.zeros([BLOCK_L], tl.int32), mask=lmask)


@triton.jit
def _filter_kernel(
    LM, K, KEY_VALID, THETA, COUNT, CAND,
    stride_lb, stride_lh, stride_lm, stride_ld,
    stride_kb, stride_kh, stride_kn, stride_kd,
    H, N, M, D, C, TILES_PER_CHUNK, TOPK, CAP, scale,
    IEEE: tl.constexpr, UPCAST: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    pid = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    b = bh // H
    h = bh % H
    lb = pid // C
    chunk = pid % C
    lrows = lb * BLOCK_L + tl.arange(0, BLOCK_L)
    lmask = lrows < M
    dd = tl.arange(0, BLOCK_D)
    dmask = dd < D
    lm = load_rows(LM, b, h, lrows, lmask, dd, dmask, stride_lb, stride_lh, stride_lm,
                    stride_ld)
    row = bh * M + lrows
    # θ is the last of each row's k largest group maxima (torch.topk's sorted values)
    theta = tl.load(THETA + row * TOPK + TOPK - 1, mask=lmask, other=0)
    cols = tl.arange(0, BLOCK_N)
    for t in range(TILES_PER_CHUNK):  # the group max's tiles, in the same order
        c = (chunk + t * C) * BLOCK_N + cols
        key = score_keys(lm, K, KEY_VALID, b, h, c, dd, dmask, N, stride_kb, stride_kh,
                          stride_kn, stride_kd, scale, IEEE, UPCAST)
        sel = ((key >= theta[:, None]) & (c < N)[None, :] & lmask[:, None]).to(tl.int32)
        n = tl.sum(sel, 1)
        base = tl.atomic_add(COUNT + row, n, mask=lmask & (n > 0))
        pos = base[:, None] + tl.cumsum(sel, 1) - sel
        # (score descending, index ascending) as one signed int64: the score key in the
        # high half, 2^32 - 1 - index in the low half
        packed = key.to(tl.int64) * 4294967296 + (4294967295 - c[None, :].to(tl.int64))
        tl.store(CAND + row[:, None] * CAP + pos, packed, mask=(sel != 0) & (pos < CAP))


@triton.jit
def _select_kernel(COUNT, CAND, IDX, FLAG, R, TOPK, CAP: tl.constexpr, ROWS: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    live = rows < R
    count = tl.load(COUNT + rows, mask=live, other=0)
    # more candidates than slots, or fewer than k (only if the filter's scores differed from
    # the group max's, which the same code on the same tiles rules out): the fallback's
    overflow = (count > CAP) | (count < TOPK)
    slot = tl.arange(0, CAP)
    packed = tl.load(CAND + rows[:, None] * CAP + slot[None, :],
                     mask=live[:, None] & (slot[None, :] < count[:, None]), other=-(2 ** 63))
    packed = tl.sort(packed, dim=1, descending=True)
    index = (4294967295 - (packed & 4294967295)).to(tl.int32)
    # the k chosen, in ascending index order
    index = tl.sort(tl.where(slot[None, :] < TOPK, index, 2 ** 31 - 1), dim=1)
    written = tl.where(overflow, 0, TOPK)  # an overflowed landmark is the fallback's
    tl.store(IDX + rows[:, None] * TOPK + slot[None, :], index.to(tl.int64),
             mask=live[:, None] & (slot[None, :] < written[:, None]))
    tl.store(FLAG + rows, overflow.to(tl.int8), mask=live)


def threshold_topk_plans(landmarks: Tensor, k: Tensor, topk: int, scale: float,
                         key_padding_mask: Tensor | None = None,
                         interpreter: bool | None = None, key_valid: Tensor | None = None):
    """Validate ``threshold_topk``'s arguments and build its five launches, in order:
    ``[(kernel or None, grid, args, meta)]`` — ``None`` stands for the threshold's
    ``torch.topk`` (``args`` = its tensor and k, ``meta`` = where its values go) — and the
    output ``(B, H, m, k)`` int64. ``mita.kernels.aot`` compiles the same (args, meta) ahead
    of time. Arguments and errors as ``threshold_topk``. Specialisations: dtype × ``BLOCK_D``
    ∈ {64, 128} for group max, filter and fallback; (``CAP``, ``ROWS``) ∈ {(128, 16), (256, 8),
    (512, 4), (1024, 2), (2048, 1), (4096, 1)} for the select (``num_warps`` 8 from 2,048)."""
    check_inputs(k, k)
    B, H, N, d = k.shape
    m = landmarks.shape[2]
    if tuple(landmarks.shape) != (B, H, m, d):
        raise ValueError(f"landmarks must be (B, H, m, d) = {(B, H, m, d)}, got "
                         f"{tuple(landmarks.shape)}")
    if not 1 <= topk <= min(N, MAX_SELECT_TOPK):
        raise ValueError(f"threshold_topk needs 1 ≤ k ≤ min(N, {MAX_SELECT_TOPK}), got "
                         f"k = {topk}, N = {N}")
    check_grid(B * H)
    lm = landmarks.to(k.dtype)
    if key_valid is None:
        key_valid = key_valid_vector(key_padding_mask, B, N, k.device)
    block_l, block_n = select_blocks(k.dtype)
    C, per_chunk = num_chunks(N, m, topk, B * H, block_l, block_n)
    cap = candidate_capacity(topk)
    rows = max(1, SELECT_ELEMENTS // cap)  # landmarks per select program
    dev = k.device
    gmax = torch.empty(B, H, m, C * block_n, dtype=torch.int32, device=dev)
    count = torch.empty(B, H, m, dtype=torch.int32, device=dev)
    cand = torch.empty(B, H, m, cap, dtype=torch.int64, device=dev)
    out = torch.empty(B, H, m, topk, dtype=torch.int64, device=dev)
    flag = torch.empty(B, H, m, dtype=torch.int8, device=dev)
    theta = torch.empty(B, H, m, topk, dtype=torch.int32, device=dev)
    common = dict(IEEE=k.dtype == torch.float32, UPCAST=interpreter_upcast(k, interpreter),
                  BLOCK_N=block_n, BLOCK_D=max(64, block_d_for(d)))
    scored = (lm, k, key_valid)
    strides = (*lm.stride(), *k.stride())
    grid = (triton.cdiv(m, block_l) * C, B * H)
    launches = [
        (_groupmax_kernel, grid, (*scored, gmax, count, *strides, H, N, m, d, C, per_chunk,
                                  float(scale)), dict(common, BLOCK_L=block_l)),
        (None, None, (gmax, topk), theta),
        (_filter_kernel, grid, (*scored, theta, count, cand, *strides, H, N, m, d, C, per_chunk,
                                topk, cap, float(scale)), dict(common, BLOCK_L=block_l)),
        (_select_kernel, (triton.cdiv(B * H * m, rows),), (count, cand, out, flag, B * H * m,
                                                           topk),
         dict(CAP=cap, ROWS=rows, num_warps=8 if cap >= 2048 else 4)),
        bisect_plan(lm, k, key_valid, flag, out, topk, scale, common["UPCAST"]),
    ]
    return launches, out


def threshold_topk(landmarks: Tensor, k: Tensor, topk: int, scale: float,
                   key_padding_mask: Tensor | None = None,
                   key_valid: Tensor | None = None) -> Tensor:
    """Stages ``landmark_scores`` + ``topk`` (eqs. 6-7) by threshold and filter: each
    landmark's k best keys by s_ij = q̃_i·k_j/√d, exact, without the m × N scores.

    Args:
        landmarks: ``(B, H, m, d)`` landmark queries q̃ from ``pool``; cast to k's dtype
            (products in the input dtype, fp32 accumulation — as flash attention).
        k: ``(B, H, N, d)`` float16 / bfloat16 / float32 keys, d ≤ 128; B·H ≤ 65,535.
        topk: 1 ≤ k ≤ min(N, 2048).
        scale: the score scale, 1/√d (eq. 6), applied to the fp32 products.
        key_padding_mask: optional ``(B, N)`` bool, True = padding (score -inf).
        key_valid: optional ``(B, N)`` int8 (1 = a real key) built once per forward by the
            caller; replaces ``key_padding_mask`` when given.
    Returns:
        ``(B, H, m, k)`` int64 key indices in ascending order; ties broken by the lowest index
        (padded keys fill a row with fewer than k real ones, lowest index first) — the
        contract of ``mita.stages.topk_tokens`` and ``routing.landmark_topk``.
    Raises:
        ValueError: dtype, shapes, d > 128, k outside [1, min(N, 2048)], B·H > 65,535.
    """
    launches, out = threshold_topk_plans(landmarks, k, topk, scale, key_padding_mask,
                                         key_valid=key_valid)
    run_launches(launches)
    return out


def run_launches(launches) -> None:
    """Run ``threshold_topk_plans``' launches in order."""
    for kernel, grid, args, meta in launches:
        if kernel is None:
            torch.topk(args[0], args[1], dim=-1, out=(meta, torch.empty(
                meta.shape, dtype=torch.int64, device=meta.device)))
        else:
            kernel[grid](*args, **meta)


def overflow_flags(launches) -> Tensor:
    """``(B, H, m)`` int8 of a run of ``launches``: 1 where a landmark's candidates overflowed
    the buffer and the bisection fallback computed its top-k."""
    return launches[3][2][3]
