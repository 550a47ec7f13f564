"""The MoE dispatch table of the fused MiTA kernel (``triton_fused``): each (batch, head)'s
N·s (query, expert) entries grouped by expert and cut into tiles of BLOCK_M entries, on the
device — a counting sort split across N in three launches (count, scan, scatter), no serial
pass over N and no fence: the kernel boundaries order the relaxed atomics before their
readers."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

TILE_BLOCK = 256  # entries per program of the count and scatter kernels (≥ 132 programs
# from N·s = 16K on with B·H = 2: the 132 SMs of an H100 / H200 all take part)
TILE_BLOCK_E = 128  # experts per step of the scan


@triton.jit
def _entries(EXPERTS, KEY_VALID, H, N, S, HAS_MASK: tl.constexpr, BLOCK: tl.constexpr):
    """This program's BLOCK (query, expert) entries r = n·s + j of grid (cdiv(N·s, BLOCK),
    B·H): ``(bh, N·s, r, ok, expert)``, ``ok`` False past N·s and for padded queries (which
    get no slot, so no tile)."""
    bh = tl.program_id(1).to(tl.int64)
    NS = N * S
    r = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = r < NS
    if HAS_MASK:
        ok = ok & (tl.load(KEY_VALID + (bh // H) * N + r // S, mask=ok, other=0) != 0)
    return bh, NS, r, ok, tl.load(EXPERTS + bh * NS + r, mask=ok, other=0)


# shape integers unspecialised, as above
@triton.jit(do_not_specialize=["H", "N", "M"])
def _tile_count_kernel(
    EXPERTS, KEY_VALID, COUNT, SLOT, H, N, S, M,
    HAS_MASK: tl.constexpr, BLOCK: tl.constexpr,
):
    # Grid (cdiv(N·s, BLOCK), B·H). Each entry's slot within its expert from a relaxed atomic
    # cursor per expert (COUNT starts at zero). Which entry of an expert gets which slot is not
    # deterministic on a GPU, and need not be: an output row depends only on its own query,
    # its expert and the shared partial (rows of a tile never mix), so the outputs are
    # bit-identical whatever the order within an expert. The kernel boundary orders these
    # atomics before the scan reads COUNT: no fence is needed.
    bh, NS, r, ok, e = _entries(EXPERTS, KEY_VALID, H, N, S, HAS_MASK, BLOCK)
    slot = tl.atomic_add(COUNT + bh * M + e, 1, mask=ok, sem="relaxed")
    tl.store(SLOT + bh * NS + r, slot, mask=ok)


# shape integers unspecialised, as above
@triton.jit(do_not_specialize=["M", "T"])
def _tile_scan_kernel(
    COUNT, START, TILE_E, TILE_LO, TILE_HI, M, T,
    BLOCK_M: tl.constexpr, BLOCK: tl.constexpr, BLOCK_E: tl.constexpr,
):
    # One program per (batch, head), over the m experts only (never over N): experts in
    # order, each one's run of entries starts after the previous ones' and is cut into tiles
    # of BLOCK_M entries.
    bh = tl.program_id(0).to(tl.int64)
    exps = tl.arange(0, BLOCK_E)
    seg_base = 0
    tile_base = 0
    for e0 in range(0, M, BLOCK_E):
        ee = e0 + exps
        em = ee < M
        c = tl.load(COUNT + bh * M + ee, mask=em, other=0)
        tiles = (c + BLOCK_M - 1) // BLOCK_M
        start = seg_base + tl.cumsum(c, 0) - c
        first = tile_base + tl.cumsum(tiles, 0) - tiles
        tl.store(START + bh * M + ee, start, mask=em)
        for j in range(0, tl.max(tiles, 0)):
            has = j < tiles
            lo = start + j * BLOCK_M
            t = bh * T + first + j
            tl.store(TILE_E + t, ee, mask=has)
            tl.store(TILE_LO + t, lo, mask=has)
            tl.store(TILE_HI + t, tl.minimum(lo + BLOCK_M, start + c), mask=has)
        seg_base += tl.sum(c, 0)
        tile_base += tl.sum(tiles, 0)
    ent = tl.arange(0, BLOCK)
    for t0 in range(tile_base, T, BLOCK):  # the grid's spare tiles
        t = t0 + ent
        tl.store(TILE_E + bh * T + t, tl.full([BLOCK], -1, tl.int32), mask=t < T)


# shape integers unspecialised, as above
@triton.jit(do_not_specialize=["H", "N", "M"])
def _tile_scatter_kernel(
    EXPERTS, KEY_VALID, SLOT, START, ORDER, H, N, S, M,
    HAS_MASK: tl.constexpr, BLOCK: tl.constexpr,
):
    # Grid as the count's: each entry to its expert's run at its slot.
    bh, NS, r, ok, e = _entries(EXPERTS, KEY_VALID, H, N, S, HAS_MASK, BLOCK)
    slot = tl.load(SLOT + bh * NS + r, mask=ok, other=0)
    first = tl.load(START + bh * M + e, mask=ok, other=0)
    tl.store(ORDER + bh * NS + first + slot, r, mask=ok)


TILE_KERNELS = (_tile_count_kernel, _tile_scan_kernel, _tile_scatter_kernel)


def tile_table_plan(experts: Tensor, key_valid: Tensor | None, m: int, block_m: int = 64):
    """The tile table's three launches — a counting sort split across N: count (a relaxed
    atomic cursor per expert gives each entry its slot), scan (per (b, h), over the m
    experts: each expert's start and its tiles), scatter — grouping each (b, h)'s N·s
    (query, expert) entries by expert and cutting each expert's run into tiles of
    ``block_m`` entries, on the device (no host synchronisation). Returns
    ``([(kernel, grid, args, meta)] × 3, (order, tile_e, tile_lo, tile_hi))``; the count and
    scatter grids are (cdiv(N·s, ``TILE_BLOCK``), B·H), the scan's (B·H,).

    Args: ``experts`` ``(B, H, N, s)`` int64 expert ids in [0, m); ``key_valid`` ``(B, N)``
    int8 (1 = a real query) or None without padding; ``m`` experts; ``block_m`` entries per tile.
    Outputs (written by the launches): ``order`` ``(B·H, N·s)`` int32, the entry ids
    r = n·s + j grouped by expert (expert 0's first; any order within an expert), padded
    queries' entries left out (the slots past the real entries are not written);
    ``tile_e``, ``tile_lo``, ``tile_hi`` ``(B·H, T)`` int32 with T = cdiv(N·s, block_m) + m
    (an upper bound on the tiles: each expert's last tile may be partial): tile t holds the
    entries ``order[lo:hi]`` of expert ``tile_e``; unused tiles have ``tile_e = -1``.
    """
    B, H, N, s = experts.shape
    T = triton.cdiv(N * s, block_m) + m
    i32 = dict(dtype=torch.int32, device=experts.device)
    order, slot = torch.empty(B * H, N * s, **i32), torch.empty(B * H, N * s, **i32)
    count, start = torch.zeros(B * H, m, **i32), torch.empty(B * H, m, **i32)
    tile_e, tile_lo, tile_hi = (torch.empty(B * H, T, **i32) for _ in range(3))
    experts = experts.contiguous()
    valid = order if key_valid is None else key_valid  # unread without a mask
    per_entry = (triton.cdiv(N * s, TILE_BLOCK), B * H)
    masked = dict(HAS_MASK=key_valid is not None, BLOCK=TILE_BLOCK)
    launches = [
        (_tile_count_kernel, per_entry, (experts, valid, count, slot, H, N, s, m), masked),
        (_tile_scan_kernel, (B * H,), (count, start, tile_e, tile_lo, tile_hi, m, T),
         dict(BLOCK_M=block_m, BLOCK=TILE_BLOCK, BLOCK_E=TILE_BLOCK_E)),
        (_tile_scatter_kernel, per_entry, (experts, valid, slot, start, order, H, N, s, m),
         masked),
    ]
    return launches, (order, tile_e, tile_lo, tile_hi)


def run_tile_table(launches) -> None:
    """Run ``tile_table_plan``'s launches in order."""
    for kernel, grid, args, meta in launches:
        kernel[grid](*args, **meta)
