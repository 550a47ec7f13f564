"""Inputs and constants several test modules share (test modules never import each other)."""

from __future__ import annotations

import torch

from mita.data.listops import ListOpsConfig, generate

# float64 against the float64 loop reference: only summation order differs.
F64_TOL = 1e-10
# Stages the compiled CPU kernels report for s = 1: topk + shared_compress run inside
# landmark_scores, gather inside attention.
CPU_KERNEL_STAGES = ("pool", "landmark_scores", "route", "attention")
# Real ListOps sequences for the service tests (lengths 100-500, as the LRA-style data).
EXAMPLES = generate(12, seed=777_001, cfg=ListOpsConfig(100, 500))


def rand_qkv(B, H, N, d, seed, dv=None, dtype=torch.float64):
    """Fresh standard-normal q, k (B, H, N, d) and v (B, H, N, dv or d) from ``seed``."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, N, d, generator=g, dtype=dtype)
    k = torch.randn(B, H, N, d, generator=g, dtype=dtype)
    v = torch.randn(B, H, N, dv or d, generator=g, dtype=dtype)
    return q, k, v


def random_mask(B, N, seed, suffix=True):
    """Bool (B, N), True = padding; every row keeps at least one valid token."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros(B, N, dtype=torch.bool)
    for b in range(B):
        if suffix:
            length = int(torch.randint(1, N + 1, (1,), generator=g))
            mask[b, length:] = True
        else:
            mask[b] = torch.rand(N, generator=g) < 0.4
            mask[b, int(torch.randint(0, N, (1,), generator=g))] = False
    return mask
