"""The exact top-k fallback of both Triton top-k paths (the bitonic ``routing.landmark_topk``
and the threshold select ``topk.threshold_topk``): for the landmarks a path flagged, the k-th
score T by bisection over the 32-bit sort keys (32 counting passes over N), then every key
above T and the first keys equal to T, written left to right (``triton_common.emit_topk``):
the lowest-index tie rule, indices ascending. Programs with no flagged landmark return at
once, so the launch is cheap when nothing overflowed; no host synchronisation.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .triton_common import block_d_for, emit_topk, load_rows, score_keys

BISECT_BLOCK_L = 16  # landmarks per fallback program (tl.dot needs ≥ 16 rows)
BISECT_BLOCK_N = 64  # keys per score tile


@triton.jit
def _bisect_topk_kernel(
    LM, K, KEY_VALID, FLAG, IDX,
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
    todo = (tl.load(FLAG + row, mask=lrows < M, other=0) != 0) & (lrows < M)
    if tl.max(todo.to(tl.int32), 0) == 0:
        return
    dd = tl.arange(0, BLOCK_D)
    dmask = dd < D
    lm = load_rows(LM, b, h, lrows, todo, dd, dmask, stride_lb, stride_lh, stride_lm,
                    stride_ld)
    cols = tl.arange(0, BLOCK_N)
    # The k-th largest key T = the largest t with count(key ≥ t) ≥ k: bisection over the
    # 2^32 int32 keys keeps count(≥ lo) ≥ k > count(≥ hi); 32 halvings leave hi = lo + 1.
    lo = tl.full([BLOCK_L], -(2 ** 31), tl.int64)
    hi = tl.full([BLOCK_L], 2 ** 31, tl.int64)
    above = tl.zeros([BLOCK_L], tl.int32)  # count(key ≥ hi) = count(key > T) at the end
    for _ in range(32):
        mid = lo + (hi - lo) // 2
        n = tl.zeros([BLOCK_L], tl.int32)
        for start in range(0, N, BLOCK_N):
            c = start + cols
            key = score_keys(lm, K, KEY_VALID, b, h, c, dd, dmask, N, stride_kb, stride_kh,
                              stride_kn, stride_kd, scale, IEEE, UPCAST)
            hit = (key.to(tl.int64) >= mid[:, None]) & (c < N)[None, :]
            n += tl.sum(hit.to(tl.int32), 1)
        enough = n >= TOPK
        lo = tl.where(enough, mid, lo)
        hi = tl.where(enough, hi, mid)
        above = tl.where(enough, above, n)
    emit_topk(lm, K, KEY_VALID, IDX + row * TOPK, lo.to(tl.int32), TOPK - above, todo, b, h,
               dd, dmask, N, TOPK, stride_kb, stride_kh, stride_kn, stride_kd, scale, IEEE,
               UPCAST, BLOCK_L, BLOCK_N)


def bisect_plan(lm: Tensor, k: Tensor, key_valid: Tensor, flag: Tensor, out: Tensor,
                topk: int, scale: float, upcast: bool):
    """The launch ``(kernel, grid, args, meta)`` of the exact fallback for the landmarks
    flagged in ``flag`` ``(B, H, m)`` int8: their top-k by bisection, written into ``out``
    ``(B, H, m, k)`` int64 (contiguous); ``lm`` ``(B, H, m, d)`` in k's dtype, ``key_valid``
    ``(B, N)`` int8."""
    B, H, N, d = k.shape
    m = lm.shape[2]
    block_d = max(64, block_d_for(d))
    # 16-bit at BLOCK_D 128 spilled 4 bytes on sm_80 with 64-key tiles; 32 do not
    block_n = 32 if k.dtype != torch.float32 and block_d == 128 else BISECT_BLOCK_N
    meta = dict(IEEE=k.dtype == torch.float32, UPCAST=upcast, BLOCK_L=BISECT_BLOCK_L,
                BLOCK_N=block_n, BLOCK_D=block_d)
    args = (lm, k, key_valid, flag, out, *lm.stride(), *k.stride(), H, N, m, topk, d,
            float(scale))
    return _bisect_topk_kernel, (triton.cdiv(m, BISECT_BLOCK_L), B * H), args, meta


def bisect_fallback(lm: Tensor, k: Tensor, key_valid: Tensor, flag: Tensor, out: Tensor,
                    topk: int, scale: float, upcast: bool) -> None:
    """Launch ``bisect_plan``: redo the flagged landmarks' top-k exactly, in place."""
    kernel, grid, args, meta = bisect_plan(lm, k, key_valid, flag, out, topk, scale, upcast)
    kernel[grid](*args, **meta)
