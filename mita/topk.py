"""Top-k with the lowest-index tie rule, the selection MiTA's ``topk`` and ``route`` stages use
(eqs. 7 and 9): ``torch.topk`` leaves the order of ties unspecified, and it differs between
CPU and CUDA; these helpers make the chosen set a function of the scores alone."""

from __future__ import annotations

import torch
from torch import Tensor

_KEYED_TOPK_ELEMENTS = 1 << 24  # float32 scores up to which top-k runs on 64-bit keys (no sync)


def topk_lowest_index(scores: Tensor, topk: int) -> Tensor:
    """Indices of the k = ``topk`` largest entries of ``scores`` along the last dim, ties broken
    by the lowest index, returned in ascending index order. ``(..., N) -> (..., k)`` int64.

    ``torch.topk`` leaves tie order unspecified (and it differs between CPU and CUDA). Only a
    tie across the boundary — the k-th and (k+1)-th largest values equal — makes the choice
    ambiguous; then the selection is rebuilt exactly: everything above the k-th value, then
    the lowest-index entries equal to it.
    """
    N = scores.shape[-1]
    if topk >= N:
        return torch.arange(N, device=scores.device).expand(*scores.shape[:-1], N)
    # On CUDA (and the meta device, which stands in for it) the keyed path spares the host
    # synchronisation of the tie check below; on the CPU, where there is none to spare, it is
    # 3-4x slower than torch.topk (int64 keys at (B, H, m, N) = (16, 2, 128, 2048): 175 ms
    # against 47 ms on 2 threads). Same indices.
    if (scores.device.type != "cpu" and scores.dtype == torch.float32
            and scores.numel() <= _KEYED_TOPK_ELEMENTS):
        return _topk_by_key(scores, topk)
    top = scores.topk(topk + 1, dim=-1, sorted=True)
    kth = top.values[..., topk - 1: topk]
    tied = (kth == top.values[..., topk:]).flatten().nonzero().flatten()
    out = top.indices[..., :topk].sort(-1).values
    if tied.numel():  # rebuild only the tied rows: the exact path needs O(rows × N) memory
        rows = scores.reshape(-1, N)[tied]
        flat = out.reshape(-1, topk)
        flat[tied] = _exact_topk_rows(rows, kth.reshape(-1, 1)[tied], topk)
        out = flat.view(out.shape)
    return out


def _topk_by_key(scores: Tensor, topk: int) -> Tensor:
    """``topk_lowest_index`` for float32 scores with one ``topk`` and no host
    synchronisation (the tie check above asks the device whether any row is tied): each score
    and its index become one int64 key — the float's bits made order-preserving as a signed
    integer in the high half, 2^32 − 1 − index in the low half — so the key order is (value
    descending, index ascending), the lowest-index tie rule. −0.0 is folded into +0.0 first
    (equal floats, different bits). 8 bytes per score: used up to ``_KEYED_TOPK_ELEMENTS``."""
    bits = (scores + 0.0).view(torch.int32).to(torch.int64)
    ordered = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    index = torch.arange(scores.shape[-1], device=scores.device, dtype=torch.int64)
    key = ordered * (1 << 32) + ((1 << 32) - 1 - index)
    top = key.topk(topk, dim=-1, sorted=False).values
    return ((1 << 32) - 1 - (top & 0xFFFFFFFF)).sort(-1).values


def _exact_topk_rows(rows: Tensor, kth: Tensor, topk: int) -> Tensor:
    """``(R, N)`` rows with their k-th largest values ``(R, 1)`` (k = ``topk``): everything
    above kth, then the lowest-index entries equal to it; ``(R, k)`` indices in ascending
    order."""
    above = rows > kth
    need = topk - above.sum(-1, keepdim=True)
    equal = rows == kth
    chosen = above | (equal & (equal.cumsum(-1) <= need))
    slot = torch.where(chosen, chosen.cumsum(-1) - 1, topk)
    positions = torch.arange(rows.shape[-1], device=rows.device).expand_as(rows)
    out = torch.zeros(rows.shape[0], topk + 1, dtype=torch.long, device=rows.device)
    return out.scatter_(-1, slot, positions)[:, :topk]
