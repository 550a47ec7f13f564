"""A short demo: MiTA vs dense attention on one random (B=1, H=2, N=4096, d=32) input."""

from __future__ import annotations

import time

import torch

from . import dense_attention, dense_flops, mita_attention, mita_flops


def main() -> None:
    N, m, k, d = 4096, 32, 32, 32
    g = torch.Generator().manual_seed(0)
    q, k_, v = (torch.randn(1, 2, N, d, generator=g) for _ in range(3))
    t0 = time.perf_counter()
    dense = dense_attention(q, k_, v)
    t1 = time.perf_counter()
    mita = mita_attention(q, k_, v, num_landmarks=m, topk=k)
    t2 = time.perf_counter()
    cos = torch.nn.functional.cosine_similarity(dense.flatten(), mita.flatten(), dim=0)
    print(f"N={N} m={m} k={k} s=1 d={d} float32 cpu")
    print(f"dense {1e3 * (t1 - t0):.1f} ms, {2 * dense_flops(N, d) / 1e9:.2f} GFLOP")
    print(f"mita  {1e3 * (t2 - t1):.1f} ms, {2 * mita_flops(N, m, k, 1, d) / 1e9:.3f} GFLOP")
    print(f"cosine(dense, mita) on random inputs = {cos:.3f}")


if __name__ == "__main__":
    main()
