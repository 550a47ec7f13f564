"""The exact top-k fallback of both Triton top-k paths (the bitonic ``routing.landmark_topk``
and the threshold select ``topk.threshold_topk``): for the landmarks a path flagged 1, the
k-th score T by bisection over the 32-bit sort keys (32 counting passes over N); for those
flagged 2 (the threshold select's, whose k-th score θ it already knows), T = θ; then every
key above T and the first keys equal to T, written left to right in one pass
(``triton_common.emit_topk``): the lowest-index tie rule, indices ascending. Programs with no
flagged landmark return at once, so the launch is cheap when nothing overflowed; no host
synchronisation.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .triton_common import block_d_for, emit_topk, load_rows, score_keys

BISECT_BLOCK_L = 16  # landmarks per fallback program (tl.dot needs ≥ 16 rows)
# (float32, BLOCK_D) → (keys per score tile, warps): the shapes that compile without spills
# on sm_80 and sm_90 with N, m and k unspecialised (``make kernels-table``). ptxas caps these
# kernels near 128 registers and spilled 4-68 bytes in the others tried: 64-key tiles in
# 4 warps (16-bit at BLOCK_D 128, both dtypes at 64), 32-key tiles in 8 warps (float32 at
# BLOCK_D 128: 40 bytes on sm_80), 64-key tiles in 8 warps for float32 at BLOCK_D 128
# (68 bytes on sm_80 once N was unspecialised).
BISECT_TILES = {(False, 64): (64, 8), (False, 128): (32, 4), (True, 64): (32, 4),
                (True, 128): (32, 4)}


# shape integers unspecialised: one compile serves every N, m, k (Triton would compile
# again for each value's == 1 and % 16 == 0, ~150 compiles of one GPU command run)
@triton.jit(do_not_specialize=["H", "N", "M", "TOPK"])
def _bisect_topk_kernel(
    LM, K, KEY_VALID, FLAG, IDX, KTH, COUNT,
    stride_lb, stride_lh, stride_lm, stride_ld,
    stride_kb, stride_kh, stride_kn, stride_kd,
    H, N, M, TOPK, D, scale,
    IEEE: tl.constexpr, UPCAST: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    pid = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    b = bh // H
    h = bh % H
    lrows = pid * BLOCK_L + tl.arange(0, BLOCK_L)
    row = bh * M + lrows
    flag = tl.load(FLAG + row, mask=lrows < M, other=0)
    todo = (flag != 0) & (lrows < M)
    if tl.max(todo.to(tl.int32), 0) == 0:
        return
    known = todo & (flag == 2)  # the k-th key is KTH, with COUNT[2 · row] keys above it
    dd = tl.arange(0, BLOCK_D)
    dmask = dd < D
    lm = load_rows(LM, b, h, lrows, todo, dd, dmask, stride_lb, stride_lh, stride_lm,
                    stride_ld)
    cols = tl.arange(0, BLOCK_N)
    # The k-th largest key T = the largest t with count(key ≥ t) ≥ k: bisection over the
    # 2^32 int32 keys keeps count(≥ lo) ≥ k > count(≥ hi); 32 halvings leave hi = lo + 1.
    # A landmark flagged 2 starts at [T, T + 1) with count(key > T) known: a fixed point of
    # the halving (mid = T, taken as enough), and a block of such landmarks scores no key.
    lo = tl.where(known, tl.load(KTH + row, mask=known, other=0).to(tl.int64), -(2 ** 31))
    hi = tl.where(known, lo + 1, 2 ** 31)
    # count(key ≥ hi) = count(key > T) at the end
    above = tl.where(known, tl.load(COUNT + 2 * row, mask=known, other=0), 0)
    scored = tl.where(tl.max((todo & ~known).to(tl.int32), 0) != 0, N, 0)
    for _ in range(32):
        mid = lo + (hi - lo) // 2
        n = tl.zeros([BLOCK_L], tl.int32)
        for start in range(0, scored, BLOCK_N):
            c = start + cols
            key = score_keys(lm, K, KEY_VALID, b, h, c, dd, dmask, N, stride_kb, stride_kh,
                              stride_kn, stride_kd, scale, IEEE, UPCAST)
            hit = (key.to(tl.int64) >= mid[:, None]) & (c < N)[None, :]
            n += tl.sum(hit.to(tl.int32), 1)
        enough = (n >= TOPK) | known
        lo = tl.where(enough, mid, lo)
        hi = tl.where(enough, hi, mid)
        above = tl.where(enough, above, n)
    emit_topk(lm, K, KEY_VALID, IDX + row * TOPK, lo.to(tl.int32), TOPK - above, todo, b, h,
               dd, dmask, N, TOPK, stride_kb, stride_kh, stride_kn, stride_kd, scale, IEEE,
               UPCAST, BLOCK_L, BLOCK_N)


def bisect_plan(lm: Tensor, k: Tensor, key_valid: Tensor, flag: Tensor, out: Tensor,
                topk: int, scale: float, upcast: bool, kth: Tensor | None = None,
                count: Tensor | None = None):
    """The launch ``(kernel, grid, args, meta)`` of the exact fallback for the landmarks
    flagged in ``flag`` ``(B, H, m)`` int8 — 1: find the k-th score by bisection; 2: it is
    ``kth`` ``(B, H, m)`` int32 (a sort key, ``triton_common.score_keys``) with
    ``count[..., 0]`` (``count``: ``(B, H, m, 2)`` int32) keys above it — their top-k written
    into ``out`` ``(B, H, m, k)`` int64 (contiguous); ``lm`` ``(B, H, m, d)`` in k's dtype,
    ``key_valid`` ``(B, N)`` int8. Without ``kth`` and ``count`` no flag may be 2."""
    B, H, N, d = k.shape
    m = lm.shape[2]
    block_d = max(64, block_d_for(d))
    block_n, warps = BISECT_TILES[k.dtype == torch.float32, block_d]
    meta = dict(IEEE=k.dtype == torch.float32, UPCAST=upcast, BLOCK_L=BISECT_BLOCK_L,
                BLOCK_N=block_n, BLOCK_D=block_d, num_warps=warps)
    if kth is None:  # never read (no flag 2): int32 placeholders, the same specialisation,
        kth = count = torch.empty(4, dtype=torch.int32, device=k.device)  # no launch
    args = (lm, k, key_valid, flag, out, kth, count, *lm.stride(), *k.stride(), H, N, m, topk,
            d, float(scale))
    return _bisect_topk_kernel, (triton.cdiv(m, BISECT_BLOCK_L), B * H), args, meta


def bisect_fallback(lm: Tensor, k: Tensor, key_valid: Tensor, flag: Tensor, out: Tensor,
                    topk: int, scale: float, upcast: bool) -> None:
    """Launch ``bisect_plan``: redo the flagged landmarks' top-k exactly, in place."""
    kernel, grid, args, meta = bisect_plan(lm, k, key_valid, flag, out, topk, scale, upcast)
    kernel[grid](*args, **meta)
