"""Stage ``pool`` (arXiv:2602.01219, eq. 5) as one Triton kernel, for 1-D pooling.

``mita.stages.pool`` on the device costs one mean in the unmasked N % m = 0 case but about
twenty small operations otherwise (ranks, segments, ``index_add`` per batch row, counts), and
the Triton path then needs the landmarks in the input dtype and the key-padding mask as an
int8 vector (the routing and attention kernels) and as an additive bias (SDPA). One launch of
``_pool_kernel`` writes all of them; a key-padding mask adds one ``cumsum`` before it.

Segments are ``mita.stages.pool``'s 1-D rule: the L valid tokens of a row, in order, are cut
into m contiguous segments, the token of valid rank r going to segment ⌊r·m/L⌋, i.e. landmark
i averages the valid ranks [⌈i·L/m⌉, ⌈(i+1)·L/m⌉). One program per (landmark, batch, head)
finds the positions of its first and one-past-last rank by binary search on the running count
of padding (``cumsum`` of the mask) and sums its valid tokens in fp32 (block by block, so the
rounding is not ``pool``'s; the test tolerances cover it). The programs of head 0 also write
the key vectors of the positions [⌈i·N/m⌉, ⌈(i+1)·N/m⌉) (every position once).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from . import MAX_HEAD_DIM
from .triton_common import DTYPES, block_d_for, key_valid_vector

POOL_BLOCK_N = 64  # tokens per step


@triton.jit
def _rank_position(PAD_CUM, N, r):
    """Position of the valid token of rank r (0-based) in a row whose running padding count
    is ``PAD_CUM`` (N if r ≥ the row's valid tokens): the first n with n + 1 - PAD_CUM[n] > r,
    by binary search (the valid count up to n is non-decreasing)."""
    lo = r * 0
    hi = lo + N
    while lo < hi:
        mid = (lo + hi) // 2
        above = mid + 1 - tl.load(PAD_CUM + mid) > r
        lo = tl.where(above, lo, mid + 1)
        hi = tl.where(above, mid, hi)
    return lo


# shape integers unspecialised: one compile serves every N, m, k (Triton would compile
# again for each value's == 1 and % 16 == 0, ~150 compiles of one GPU command run)
@triton.jit(do_not_specialize=["H", "N", "M"])
def _pool_kernel(
    Q, KEY_PAD, PAD_CUM, LM, LM_IN, LM_VALID, KEY_VALID, KEY_BIAS,
    stride_qb, stride_qh, stride_qn, stride_qd,
    H, N, M, D,
    HAS_MASK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    i = tl.program_id(0).to(tl.int64)
    bh = tl.program_id(1).to(tl.int64)
    b = bh // H
    h = bh % H
    if HAS_MASK:
        length = N - tl.load(PAD_CUM + b * N + N - 1)
    else:
        length = i * 0 + N
    r_lo = (i * length + M - 1) // M
    r_hi = ((i + 1) * length + M - 1) // M
    if HAS_MASK:
        p_lo = _rank_position(PAD_CUM + b * N, N, r_lo)
        p_hi = _rank_position(PAD_CUM + b * N, N, r_hi)
    else:
        p_lo = r_lo
        p_hi = r_hi

    dd = tl.arange(0, BLOCK_D)
    dmask = dd < D
    cols = tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_D], tl.float32)
    for start in range(p_lo, p_hi, BLOCK_N):
        n = start + cols
        ok = n < p_hi
        if HAS_MASK:
            ok = ok & (tl.load(KEY_PAD + b * N + n, mask=ok, other=1) == 0)
        x = tl.load(Q + b * stride_qb + h * stride_qh + n[:, None] * stride_qn
                    + dd[None, :] * stride_qd, mask=ok[:, None] & dmask[None, :], other=0.0)
        acc += tl.sum(x.to(tl.float32), 0)
    count = r_hi - r_lo
    lm = acc / tl.maximum(count, 1).to(tl.float32)  # an empty landmark stays zero
    row = (bh * M + i) * D + dd
    tl.store(LM + row, lm, mask=dmask)
    if LM_IN.dtype.element_ty == tl.bfloat16:
        # round to nearest even by integer arithmetic, as torch's cast: the CPU interpreter
        # truncates fp32 → bfloat16 (a GPU rounds), so its tests would see other landmarks
        bits = lm.to(tl.int32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        lm_in = (bits >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)
    else:
        lm_in = lm.to(LM_IN.dtype.element_ty)
    tl.store(LM_IN + row, lm_in, mask=dmask)

    if h == 0:
        tl.store(LM_VALID + b * M + i, (count > 0).to(tl.int8))
        k_hi = ((i + 1) * N + M - 1) // M
        for start in range((i * N + M - 1) // M, k_hi, BLOCK_N):
            n = start + cols
            ok = n < k_hi
            if HAS_MASK:
                pad = tl.load(KEY_PAD + b * N + n, mask=ok, other=0)
                tl.store(KEY_VALID + b * N + n, (pad == 0).to(tl.int8), mask=ok)
                bias = tl.where(pad != 0, float("-inf"), 0.0)
                tl.store(KEY_BIAS + b * N + n, bias.to(KEY_BIAS.dtype.element_ty), mask=ok)
            else:
                tl.store(KEY_VALID + b * N + n, tl.full([BLOCK_N], 1, tl.int8), mask=ok)


def pool_plan(q: Tensor, num_landmarks: int, key_padding_mask: Tensor | None = None):
    """Validate ``pool_landmarks``' arguments and build its launch: ``(grid, args, meta,
    outputs)`` (``mita.kernels.aot`` compiles the same args/meta ahead of time); ``outputs``
    as ``pool_landmarks`` returns them. The mask's ``cumsum`` runs here (one launch; none
    without a mask). Specialisations: dtype × ``BLOCK_D`` ∈ {64, 128} × ``HAS_MASK``."""
    if q.dtype not in DTYPES:
        raise ValueError(f"the Triton pool takes float16/bfloat16/float32, got {q.dtype}")
    B, H, N, d = q.shape
    m = num_landmarks
    if d > MAX_HEAD_DIM:
        raise ValueError(f"the Triton pool takes head dims up to {MAX_HEAD_DIM}, got {d}")
    if m < 1:
        raise ValueError(f"num_landmarks must be ≥ 1, got {m}")
    if key_padding_mask is not None and (key_padding_mask.dtype != torch.bool
                                         or tuple(key_padding_mask.shape) != (B, N)):
        raise ValueError(f"key_padding_mask must be bool {(B, N)}, got "
                         f"{key_padding_mask.dtype} {tuple(key_padding_mask.shape)}")
    dev = q.device
    landmarks = torch.empty(B, H, m, d, dtype=torch.float32, device=dev)
    # float32 input: the landmarks are already in the input dtype (written twice, same values)
    landmarks_in = landmarks if q.dtype == torch.float32 else torch.empty_like(landmarks,
                                                                               dtype=q.dtype)
    landmark_valid = torch.empty(B, m, dtype=torch.bool, device=dev)
    key_valid = torch.empty(B, N, dtype=torch.int8, device=dev)
    if key_padding_mask is None:
        key_pad, pad_cum, key_bias = key_valid, key_valid, None  # unread placeholders
    else:
        key_pad = key_padding_mask.contiguous().view(torch.int8)  # bool as 0/1 bytes, no copy
        pad_cum = key_padding_mask.cumsum(-1)  # int64 running padding count
        key_bias = torch.empty(B, 1, 1, N, dtype=q.dtype, device=dev)
    args = (q, key_pad, pad_cum, landmarks, landmarks_in, landmark_valid.view(torch.int8),
            key_valid, landmarks_in if key_bias is None else key_bias, *q.stride(), H, N, m, d)
    meta = dict(HAS_MASK=key_padding_mask is not None, BLOCK_N=POOL_BLOCK_N,
                # 64 or 128: pooling reads each query once, and every BLOCK_D is one more
                # specialisation to compile (tests/kernels/test_kernel_compile.py)
                BLOCK_D=max(64, block_d_for(d)))
    return (m, B * H), args, meta, (landmarks, landmarks_in, landmark_valid, key_valid, key_bias)


def pool_landmarks(q: Tensor, num_landmarks: int, key_padding_mask: Tensor | None = None):
    """Stage ``pool`` (eq. 5, 1-D) with what the Triton path's kernels read, in one launch (two
    with a mask): the landmarks of ``mita.stages.pool`` (same segments, fp32 sums) and the
    key-padding mask in the forms the kernels and SDPA take.

    Args:
        q: ``(B, H, N, d)`` float16 / bfloat16 / float32 queries, d ≤ 128.
        num_landmarks: m ≥ 1 (N < m allowed: some landmarks are empty).
        key_padding_mask: optional ``(B, N)`` bool, True = padding (checked once per forward
            by ``stages.check_padding_mask``: no all-padding row).
    Returns:
        ``landmarks`` ``(B, H, m, d)`` float32 (zero where empty); the same in q's dtype
        (rounded once; the same tensor for float32 q); ``landmark_valid`` ``(B, m)`` bool;
        ``key_valid`` ``(B, N)`` int8, 1 = a real key (all ones without a mask); ``key_bias``
        ``(B, 1, 1, N)`` in q's dtype, 0 for a real key and -inf for padding (SDPA's additive
        mask), None without a mask.
    Raises:
        ValueError: dtype, d > 128, m < 1, a mask that is not bool ``(B, N)``.
    """
    grid, args, meta, outputs = pool_plan(q, num_landmarks, key_padding_mask)
    _pool_kernel[grid](*args, **meta)
    return outputs


def key_vectors(key_padding_mask: Tensor | None, B: int, N: int, dtype: torch.dtype, device):
    """``pool_landmarks``' ``key_valid`` and ``key_bias`` from PyTorch operations, for the
    2-D pooling the kernel does not do: ``(B, N)`` int8 (1 = real key) and ``(B, 1, 1, N)``
    0 / -inf in ``dtype`` (None without a mask)."""
    key_valid = key_valid_vector(key_padding_mask, B, N, device)
    if key_padding_mask is None:
        return key_valid, None
    bias = torch.zeros(B, 1, 1, N, dtype=dtype, device=device)
    return key_valid, bias.masked_fill_(key_padding_mask[:, None, None, :], float("-inf"))
