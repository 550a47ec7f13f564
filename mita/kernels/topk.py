"""Exact top-k of the landmark scores by threshold and filter, split across N (eqs. 6-7).

``threshold_topk`` replaces the stages ``landmark_scores`` + ``topk`` on the Triton path
without the m × N score matrix and without sorting N. Public radix / threshold top-k kernels
for long rows (PyTorch's radix select, FlashInfer's filtered top-k, TensorRT-LLM's split-row
indexer top-k) never sort a row either; this design follows the same idea with a bound that
needs no histogram:

1. **Group max** (``_select_pass_kernel`` ``PHASE`` 0, grid (landmark blocks × C chunks of
   N, B·H)): a block of landmarks scores a chunk of keys tile by tile
   (``triton_common.score_keys``: the same order-preserving int32 keys as the bitonic kernel)
   and keeps, per column of the score tile, the running max and how many keys equal it.
   Chunk c holds the tiles c, c + C, c + 2C, … and key j of chunk c falls in group
   (c, j mod BLOCK_N), so neighbouring keys (pooled landmarks score a neighbourhood alike)
   land in different groups, and a row padded at its end still reaches every group. Each
   chunk's first tile is the **tie window**: its scores (keys 0 … G − 1 over all chunks) are
   kept for the select. The chunk-0 programs also zero the two counters per landmark the
   filter appends with.
2. **Threshold** (``_theta_kernel``, one program per landmark): θ = the largest t such that
   the groups whose max is ≥ t hold ≥ k keys equal to their max — a 32-step bisection over
   the int32 keys. The groups are disjoint, so at least k keys score ≥ θ: θ ≤ the k-th largest
   score, a guaranteed lower bound; counting the copies of a max makes θ the k-th score
   itself where repeated content puts many equal keys in one group.
3. **Filter** (``PHASE`` 1, grid as 1): the same scores again (same routine, same tiles:
   bit-identical); every key above θ goes to the first half of its landmark's buffer
   (``CAP`` slots), every key equal to θ to the second, each through one relaxed atomic
   counter, packed into one int64 whose order is (score descending, index ascending).
4. **Select** (``_select_kernel``, one program per 2,048 candidate slots: 8 landmarks of
   2 × 128 down to one of 2 × 4,096): sort both halves descending, keep k, sort their indices
   ascending — deterministic whatever order the atomics appended in. Where fewer than k keys
   lie above θ but more ties at θ reached it than their half holds (all-equal keys, a row
   with fewer than k real keys, mass ties), θ is the k-th score and the half holds some ties
   but not the lowest-index ones: the select takes the k − (keys above θ) lowest-index ties
   from the tie window instead, when it holds that many (then they are the lowest of all:
   every other key has a higher index; G ≥ 4k). Two kinds of landmark are left to the last
   launch: flag 2, ties past the window (the window holds too few of them); flag 1, more keys
   above θ than their half holds (strongly clustered scores, noisy repeated content).
5. **The exact fallback** (``bisect._bisect_topk_kernel``): programs with no flagged landmark
   return at once. Flag 2 takes one left-to-right pass from the known k-th score θ: every key
   above it and the first k − (keys above θ) keys equal to it (``triton_common.emit_topk``,
   the lowest-index tie rule). Flag 1 first finds the k-th score T by bisection over the
   32-bit keys (32 counting passes over N), then the same pass from T. No host
   synchronisation anywhere, so it runs inside a CUDA graph capture.

Cost: the score product twice (2·2·m·N·d FLOPs, tensor cores), one max per score, 32 passes
over m·G group maxima for θ, and a sort of ≤ 2·``CAP`` pairs per landmark; plus one more
product over N for the blocks holding a flag-2 landmark, 33 for a flag-1 one. Memory: 3·m·G
int32 group maxima, counts and window scores and 2·m·CAP int64 candidates per (batch, head).
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
SELECT_BLOCK_N = 32  # keys per 16-bit score tile = groups per chunk
SELECT_ELEMENTS = 2048  # candidates one select program sorts: 8 landmarks of 2 × 128 … 1
THETA_BLOCK = 1024  # group maxima per step of the θ bisection
WINDOW_ELEMENTS = 1024  # tie-window scores per step of a select program (only where ties
# overflowed their half): 128 keys × 8 landmarks … 1,024 keys × 1
SELECT = 3  # the select's place in threshold_topk_plans' launches (its FLAG is args[3])
MAX_SELECT_TOPK = 2048  # candidate buffers up to 4,096 int64 sorted by one program
TARGET_PROGRAMS = 264  # ≥ 2 programs per SM on a 132-SM H100 / H200
GROUPS_PER_K = 4  # G ≥ 4k groups: for continuous scores ~1.1-1.3k keys reach θ


def candidate_capacity(topk: int) -> int:
    """Candidate slots per landmark: twice k rounded up to a power of two (≥ 128)."""
    return max(128, 2 * triton.next_power_of_2(topk))


def select_warps(cap: int) -> int:
    """Warps of the select program sorting 2·``cap`` slots per landmark: 8 for 8,192 slots
    (k > 1,024), else 4 — the counts that compile without spills (8 warps spilled 16 B on
    sm_90 at 4,096 slots, 16 warps 8 B on sm_80; ``make kernels-table``)."""
    return 8 if 2 * cap >= 8192 else 4


def select_blocks(dtype: torch.dtype) -> tuple[int, int]:
    """``(BLOCK_L, BLOCK_N)`` of the group-max and filter kernels: landmarks × keys per score
    tile. 16-bit: 64 × 32 (tensor-core tiles; 64 × 64 held the filter at 218-222 registers,
    2 blocks per SM, where 64 × 32 compiles to 148 on sm_90 and 168 on sm_80: 3 blocks, and
    the group max to 94-96, 5 blocks on sm_90). float32: 16 × 16 — its IEEE products are FMA
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


# shape integers unspecialised: one compile serves every N, m, k (Triton would compile
# again for each value's == 1 and % 16 == 0, ~150 compiles of one GPU command run)
@triton.jit(do_not_specialize=["H", "N", "M", "C", "TILES_PER_CHUNK", "TOPK", "CAP"])
def _select_pass_kernel(
    LM, K, KEY_VALID, GMAX, GCNT, THETA, COUNT, CAND, WINDOW,
    stride_lb, stride_lh, stride_lm, stride_ld,
    stride_kb, stride_kh, stride_kn, stride_kd,
    H, N, M, D, C, TILES_PER_CHUNK, TOPK, CAP, scale,
    PHASE: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr, BLOCK_L: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # One function for the two passes that score keys (group max, filter), so their
    # [BLOCK_L, BLOCK_N] score tiles come from one routine with one tile shape and one warp
    # layout: the filter sees the group max's scores bit for bit.
    pid = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    b = bh // H
    h = bh % H
    lb = pid // C
    chunk = pid % C
    lrows = lb * BLOCK_L + tl.arange(0, BLOCK_L)
    lmask = lrows < M
    row = bh * M + lrows
    cols = tl.arange(0, BLOCK_N)
    dd = tl.arange(0, BLOCK_D)
    dmask = dd < D
    if PHASE == 0:
        # group max: per column of the score tile, the running max and how many keys of the
        # group equal it (so θ can count ties: repeated content puts copies in one group)
        lm = load_rows(LM, b, h, lrows, lmask, dd, dmask, stride_lb, stride_lh, stride_lm,
                        stride_ld)
        # chunk c holds tiles c, c + C, c + 2C, …: a row's real keys (padding at its end, as
        # the service pads) reach every chunk, so every group, not only the first chunks'.
        # The first tile (every chunk has one) is peeled: its scores are also the tie window,
        # keys 0 … G - 1, the select's source of lowest-index ties at θ
        best = score_keys(lm, K, KEY_VALID, b, h, chunk * BLOCK_N + cols, dd, dmask, N,
                          stride_kb, stride_kh, stride_kn, stride_kd, scale, IEEE, UPCAST)
        same = tl.full([BLOCK_L, BLOCK_N], 1, tl.int32)
        tl.store(WINDOW + row[:, None] * (C * BLOCK_N) + chunk * BLOCK_N + cols[None, :], best,
                 mask=lmask[:, None])
        for t in range(1, TILES_PER_CHUNK):
            key = score_keys(lm, K, KEY_VALID, b, h, (chunk + t * C) * BLOCK_N + cols, dd,
                              dmask, N, stride_kb, stride_kh, stride_kn, stride_kd, scale,
                              IEEE, UPCAST)
            same = tl.where(key > best, 1, tl.where(key == best, same + 1, same))
            best = tl.maximum(best, key)
        G = C * BLOCK_N
        at = row[:, None] * G + chunk * BLOCK_N + cols[None, :]
        tl.store(GMAX + at, best, mask=lmask[:, None])
        tl.store(GCNT + at, same, mask=lmask[:, None])
        if chunk == 0:
            tl.store(COUNT + 2 * row, tl.zeros([BLOCK_L], tl.int32), mask=lmask)
            tl.store(COUNT + 2 * row + 1, tl.zeros([BLOCK_L], tl.int32), mask=lmask)
    else:
        # filter: every key above θ and every key at θ, each appended to its own half of the
        # landmark's buffer through a relaxed per-key atomic (about 1 key in 4,000 passes; the
        # order within a half does not matter, the select sorts), no fence, no scan
        lm = load_rows(LM, b, h, lrows, lmask, dd, dmask, stride_lb, stride_lh, stride_lm,
                        stride_ld)
        theta = tl.load(THETA + row, mask=lmask, other=0)
        for t in range(TILES_PER_CHUNK):  # the group max's tiles, in the same order
            c = (chunk + t * C) * BLOCK_N + cols
            key = score_keys(lm, K, KEY_VALID, b, h, c, dd, dmask, N, stride_kb, stride_kh,
                              stride_kn, stride_kd, scale, IEEE, UPCAST)
            live = lmask[:, None] & (c < N)[None, :]
            tie = (key == theta[:, None]) & live
            hit = (key > theta[:, None]) & live | tie
            half = tie.to(tl.int64)
            pos = tl.atomic_add(COUNT + 2 * row[:, None] + half, 1, mask=hit, sem="relaxed")
            # (score descending, index ascending) as one signed int64: the score key in the
            # high half, 2^32 - 1 - index in the low half
            packed = key.to(tl.int64) * 4294967296 + (4294967295 - c[None, :].to(tl.int64))
            tl.store(CAND + (2 * row[:, None] + half) * CAP + pos, packed,
                     mask=hit & (pos < CAP))


# shape integers unspecialised, as above
@triton.jit(do_not_specialize=["G", "TOPK"])
def _theta_kernel(GMAX, GCNT, THETA, G, TOPK, BLOCK_G: tl.constexpr):
    # θ = the largest t with Σ over groups of max ≥ t of (keys equal to that max) ≥ k: at
    # least k keys score ≥ θ, so θ ≤ the k-th score (a lower bound), and θ is the k-th score
    # itself when a group's copies of one key reach k. Bisection over the 2^32 int32 keys.
    row = tl.program_id(0).to(tl.int64)
    g = tl.arange(0, BLOCK_G)
    lo = tl.full([1], -(2 ** 31), tl.int64)
    hi = tl.full([1], 2 ** 31, tl.int64)
    for _ in range(32):
        mid = lo + (hi - lo) // 2
        n = tl.zeros([1], tl.int32)
        for start in range(0, G, BLOCK_G):
            live = start + g < G
            best = tl.load(GMAX + row * G + start + g, mask=live, other=NO_KEY)
            same = tl.load(GCNT + row * G + start + g, mask=live, other=0)
            n += tl.sum(tl.where(best.to(tl.int64) >= mid, same, 0), 0)
        enough = n >= TOPK
        lo = tl.where(enough, mid, lo)
        hi = tl.where(enough, hi, mid)
    tl.store(THETA + row + tl.arange(0, 1), lo.to(tl.int32))


# shape integers unspecialised, as above
@triton.jit(do_not_specialize=["R", "TOPK", "G"])
def _select_kernel(COUNT, CAND, IDX, FLAG, THETA, WINDOW, R, TOPK, G, CAP: tl.constexpr,
                   ROWS: tl.constexpr, WIN_BLOCK: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    live = rows < R
    n_gt = tl.load(COUNT + 2 * rows, mask=live, other=0)
    n_eq = tl.load(COUNT + 2 * rows + 1, mask=live, other=0)
    # flag 1, the bisection: more keys above θ than their half holds, or (only if the passes'
    # scores differed, which one scoring routine rules out) fewer than k keys at or above θ
    bisect = (n_gt > CAP) | (n_gt + n_eq < TOPK)
    # θ is the k-th score and its ties overflowed their half (repeated content, all-equal
    # keys, a row with fewer than k real keys): the half holds some ties, not the lowest-index
    # ones. The k - n_gt lowest-index ties come from the tie window (the group max's scores
    # of keys 0 … G - 1, G ≥ 4k) when it holds that many — then they are the lowest of all, since
    # every other tie has a higher index; else flag 2, one pass from θ in the fallback launch.
    ties = (n_gt < TOPK) & (n_eq > CAP) & ~bisect
    need = TOPK - n_gt
    if tl.max(ties.to(tl.int32), 0) > 0:
        theta = tl.load(THETA + rows, mask=live, other=0).to(tl.int64)
        seen = tl.zeros([ROWS], tl.int32)
        w = tl.arange(0, WIN_BLOCK)
        for start in range(0, G, WIN_BLOCK):
            cols = start + w
            key = tl.load(WINDOW + rows[:, None] * G + cols[None, :],
                          mask=ties[:, None] & (cols < G)[None, :], other=NO_KEY)
            # keys past N score NO_KEY, below any θ (θ ≥ the padded keys' score)
            tie = (key == theta[:, None].to(tl.int32)).to(tl.int32)
            rank = seen[:, None] + tl.cumsum(tie, 1)  # 1 for the lowest-index tie
            take = (tie != 0) & (rank <= need[:, None])
            packed = theta[:, None] * 4294967296 + (4294967295 - cols[None, :].to(tl.int64))
            tl.store(CAND + (2 * rows[:, None] + 1) * CAP + rank - 1, packed, mask=take)
            seen += tl.sum(tie, 1)
        windowed = ties & (seen >= need)
        n_eq = tl.where(windowed, need, n_eq)
        ties = ties & ~windowed
        tl.debug_barrier()  # the tie half just written is read back below by other threads
    slot = tl.arange(0, 2 * CAP)
    above = slot < CAP
    valid = tl.where(above[None, :], slot[None, :] < n_gt[:, None],
                     slot[None, :] - CAP < tl.minimum(n_eq, CAP)[:, None])
    packed = tl.load(CAND + rows[:, None] * (2 * CAP) + slot[None, :],
                     mask=live[:, None] & valid, other=-(2 ** 63))
    packed = tl.sort(packed, dim=1, descending=True)
    index = (4294967295 - (packed & 4294967295)).to(tl.int32)
    # the k chosen, in ascending index order
    index = tl.sort(tl.where(slot[None, :] < TOPK, index, 2 ** 31 - 1), dim=1)
    written = tl.where(bisect | ties, 0, TOPK)  # a flagged landmark is the fallback's
    tl.store(IDX + rows[:, None] * TOPK + slot[None, :], index.to(tl.int64),
             mask=live[:, None] & (slot[None, :] < written[:, None]))
    tl.store(FLAG + rows, tl.where(bisect, 1, tl.where(ties, 2, 0)).to(tl.int8), mask=live)


def threshold_topk_plans(landmarks: Tensor, k: Tensor, topk: int, scale: float,
                         key_padding_mask: Tensor | None = None,
                         interpreter: bool | None = None, key_valid: Tensor | None = None):
    """Validate ``threshold_topk``'s arguments and build its five launches, in order — group
    max, θ, filter, select, fallback — as ``[(kernel, grid, args, meta)]``, and the
    output ``(B, H, m, k)`` int64. ``mita.kernels.aot`` compiles the same (args, meta) ahead
    of time. Arguments and errors as ``threshold_topk``. Specialisations: dtype × ``BLOCK_D``
    ∈ {64, 128} × ``PHASE`` ∈ {0, 1} for the scoring passes, dtype × ``BLOCK_D`` for the
    fallback, one θ kernel, and (``CAP``, ``ROWS``) ∈ {(128, 8), (256, 4), (512, 2),
    (1024, 1), (2048, 1), (4096, 1)} for the select (``num_warps``: ``select_warps``)."""
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
    rows = max(1, SELECT_ELEMENTS // (2 * cap))  # landmarks per select program
    dev = k.device
    G = C * block_n
    gmax = torch.empty(B, H, m, G, dtype=torch.int32, device=dev)
    gcnt = torch.empty(B, H, m, G, dtype=torch.int32, device=dev)
    count = torch.empty(B, H, m, 2, dtype=torch.int32, device=dev)  # keys above θ, at θ
    cand = torch.empty(B, H, m, 2, cap, dtype=torch.int64, device=dev)
    out = torch.empty(B, H, m, topk, dtype=torch.int64, device=dev)
    flag = torch.empty(B, H, m, dtype=torch.int8, device=dev)
    theta = torch.empty(B, H, m, dtype=torch.int32, device=dev)
    window = torch.empty(B, H, m, G, dtype=torch.int32, device=dev)  # scores of keys < G
    common = dict(IEEE=k.dtype == torch.float32, UPCAST=interpreter_upcast(k, interpreter),
                  BLOCK_N=block_n, BLOCK_D=max(64, block_d_for(d)))
    strides = (*lm.stride(), *k.stride())
    scored = (lm, k, key_valid, gmax, gcnt, theta, count, cand, window, *strides, H, N, m, d)
    grid = (triton.cdiv(m, block_l) * C, B * H)
    tail = (topk, cap, float(scale))
    launches = [
        (_select_pass_kernel, grid, (*scored, C, per_chunk, *tail),
         dict(common, BLOCK_L=block_l, PHASE=0)),
        (_theta_kernel, (B * H * m,), (gmax, gcnt, theta, G, topk), dict(BLOCK_G=THETA_BLOCK)),
        (_select_pass_kernel, grid, (*scored, C, per_chunk, *tail),
         dict(common, BLOCK_L=block_l, PHASE=1)),
        (_select_kernel, (triton.cdiv(B * H * m, rows),),
         (count, cand, out, flag, theta, window, B * H * m, topk, G),
         dict(CAP=cap, ROWS=rows, WIN_BLOCK=WINDOW_ELEMENTS // rows,
              num_warps=select_warps(cap))),
        bisect_plan(lm, k, key_valid, flag, out, topk, scale, common["UPCAST"], kth=theta,
                    count=count),
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
        kernel[grid](*args, **meta)


def overflow_flags(launches) -> Tensor:
    """``(B, H, m)`` int8 of a run of ``launches``: 0 where the select wrote a landmark's top-k
    from its candidates, 2 where the fallback launch took one pass from θ (ties at θ
    overflowed), 1 where it ran the bisection (keys above θ overflowed)."""
    return launches[SELECT][2][3]
