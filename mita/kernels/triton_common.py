"""What the Triton kernel files share: the dtypes they take, the jit helpers several kernels
call (the fp32-accumulating product, the order-preserving score keys of the top-k kernels and
their left-to-right emission), and the host-side checks and argument conversions of their
launchers. Kernel files import from here, never from each other's private names.

A module global read inside ``@triton.jit`` must be a ``tl.constexpr``: the GPU compiler
rejects plain globals (the interpreter does not); tests/kernels/test_kernel_compile.py compiles
every specialisation to catch that class.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from . import MAX_GRID_Y, MAX_HEAD_DIM

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# Running-max start: finite, so fully masked blocks give exp(-inf) = 0. A module global read
# inside @jit must be a tl.constexpr: the GPU compiler rejects plain globals (the interpreter
# does not), tests/kernels/test_kernel_compile.py compiles every specialisation to catch that class.
NEG_INIT = tl.constexpr(-1.0e30)
# Sort key of an out-of-range column: below every real key (a -inf score maps to
# 0x807FFFFF), so it is never chosen while k ≤ N real keys exist.
NO_KEY = tl.constexpr(-(2 ** 31))


@triton.jit
def dot(a, b, IEEE: tl.constexpr, UPCAST: tl.constexpr):
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
def load_rows(PTR, b, h, rows, rmask, dd, dmask, stride_b, stride_h, stride_r, stride_d):
    """The ``[len(rows), len(dd)]`` block of a ``(B, H, rows, d)`` tensor at batch ``b``, head
    ``h`` (the landmarks of a program), zero where ``rmask`` or ``dmask`` is False."""
    return tl.load(PTR + b * stride_b + h * stride_h + rows[:, None] * stride_r
                   + dd[None, :] * stride_d, mask=rmask[:, None] & dmask[None, :], other=0.0)


@triton.jit
def score_keys(lm, K, KEY_VALID, b, h, c, dd, dmask, N, stride_kb, stride_kh, stride_kn,
                stride_kd, scale, IEEE: tl.constexpr, UPCAST: tl.constexpr):
    """Scores of the landmarks ``lm`` against keys ``c`` as order-preserving int32 sort keys
    (the float32 bits, negatives flipped, so integer order = float order; -0.0 folded into
    +0.0; padded keys -inf; columns past N below every real key). Both passes call this on
    the same tiles, so they see bit-identical scores."""
    cm = c < N
    kt = tl.load(K + b * stride_kb + h * stride_kh + c[:, None].to(tl.int64) * stride_kn
                 + dd[None, :] * stride_kd, mask=cm[:, None] & dmask[None, :], other=0.0)
    s = dot(lm, tl.trans(kt), IEEE, UPCAST) * scale
    ok = tl.load(KEY_VALID + b * N + c, mask=cm, other=0) != 0
    s = tl.where(ok[None, :], s, float("-inf"))
    s = tl.where(s == 0.0, 0.0, s)  # one bit pattern for ±0.0 (a dot summed from +0.0
    # gives +0.0 anyway; kept so the keys' order never depends on it)
    bits = s.to(tl.int32, bitcast=True)
    key = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    return tl.where(cm[None, :], key, NO_KEY)


@triton.jit
def emit_topk(lm, K, KEY_VALID, out_row, kth, need, rmask, b, h, dd, dmask, N,
               TOPK, stride_kb, stride_kh, stride_kn, stride_kd, scale, IEEE: tl.constexpr,
               UPCAST: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_N: tl.constexpr):
    """Write each landmark's top-k given its k-th largest key ``kth`` and how many keys equal
    to it are taken (``need``): a left-to-right pass over the keys writes every key above
    ``kth`` and the first ``need`` keys equal to it to ``out_row`` (one pointer per landmark,
    contiguous k slots), so the indices come out ascending with the lowest-index tie rule.
    Stores are bounded by k (a landmark that would take more never writes past its row) and
    masked by ``rmask``. Returns how many keys each landmark took (k when the scores are the
    ones ``kth`` came from)."""
    cols = tl.arange(0, BLOCK_N)
    taken = tl.zeros([BLOCK_L], tl.int32)
    ties = tl.zeros([BLOCK_L], tl.int32)
    for start in range(0, N, BLOCK_N):
        c = start + cols
        key = score_keys(lm, K, KEY_VALID, b, h, c, dd, dmask, N, stride_kb, stride_kh,
                          stride_kn, stride_kd, scale, IEEE, UPCAST)
        eq = (key == kth[:, None]).to(tl.int32)
        eq_before = ties[:, None] + tl.cumsum(eq, 1) - eq
        sel = ((key > kth[:, None]) | ((eq != 0) & (eq_before < need[:, None]))).to(tl.int32)
        pos = taken[:, None] + tl.cumsum(sel, 1) - sel
        tl.store(out_row[:, None] + pos, c[None, :].to(tl.int64),
                 mask=(sel != 0) & (pos < TOPK) & rmask[:, None])
        taken += tl.sum(sel, 1)
        ties += tl.sum(eq, 1)
    return taken


def as_int8(flags: Tensor) -> Tensor:
    """A bool (or integer 0/1) flag tensor as contiguous int8 for a kernel: a bool tensor is
    reinterpreted (the same bytes, no launch), anything else converted."""
    flags = flags.contiguous()
    return flags.view(torch.int8) if flags.dtype == torch.bool else flags.to(torch.int8)


def check_grid(bh: int) -> None:
    """Raise ValueError when B·H passes CUDA's grid limit on the second axis."""
    if bh > MAX_GRID_Y:
        raise ValueError(f"batch × heads = {bh} is over CUDA's grid limit of {MAX_GRID_Y} "
                         "programs on the second axis; split the batch")


def key_valid_vector(key_padding_mask: Tensor | None, B: int, N: int, device) -> Tensor:
    """``(B, N)`` int8, 1 = a real key; all ones without a mask (a runtime vector, so a mask
    is not a compile-time specialisation)."""
    if key_padding_mask is None:
        return torch.ones(B, N, dtype=torch.int8, device=device)
    return (~key_padding_mask).view(torch.int8)  # the bool bytes as 0/1, no second launch


def block_d_for(*dims: int) -> int:
    """``BLOCK_D`` for head dims ``dims`` (d, dv): the largest rounded up to a power of two,
    at least 16 (``tl.dot``'s smallest inner size)."""
    return max(16, triton.next_power_of_2(max(dims)))


def interpreter_upcast(t: Tensor, interpreter: bool | None) -> bool:
    """The ``UPCAST`` constexpr of ``dot``: True only for bfloat16 under the CPU interpreter
    (``interpreter`` None: inferred from ``t``'s device; the ahead-of-time compile passes
    False)."""
    return t.dtype == torch.bfloat16 and (not t.is_cuda if interpreter is None else interpreter)


def check_inputs(q: Tensor, k: Tensor) -> None:
    """Refuse (ValueError) q, k ``(..., d)`` the Triton kernels cannot take: a dtype other
    than float16 / bfloat16 / float32, two dtypes, or d > ``MAX_HEAD_DIM``."""
    if q.dtype not in DTYPES or k.dtype != q.dtype:
        raise ValueError(f"Triton routing kernels take one of float16/bfloat16/float32, got "
                         f"{q.dtype}, {k.dtype}")
    if q.shape[-1] > MAX_HEAD_DIM:
        raise ValueError(f"Triton routing kernels take head dims up to {MAX_HEAD_DIM}, got "
                         f"{q.shape[-1]}")


