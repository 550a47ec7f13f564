"""The threshold top-k (``mita.kernels.topk``) and the bitonic kernel's guards, on CPU under
``TRITON_INTERPRET=1``.

The reference is independent of the code under test: float64 scores of the inputs as the
kernels see them (landmarks rounded to the keys' dtype), each row ordered by (score
descending, index ascending) with ``numpy.lexsort``, the first k kept and sorted.

Tolerances, and why:
- Small-integer inputs with d = 16: every product and sum is an integer below 2^8 and the
  scale 1/√16 = 0.25 is a power of two, so every score is exact in float32 accumulation from
  float16 / bfloat16 / float32 operands: the indices must be equal, ties included.
- Normal inputs: the kernels' scores are fp32 accumulations of ~unit products over d = 32, good
  to ~1e-6; rows whose k-th and (k+1)-th float64 scores are more than 1e-4 apart cannot swap,
  so on those rows the indices must be equal (closer pairs may legitimately swap).
"""

from __future__ import annotations

import importlib

import numpy as np
import pytest
import torch

from .helpers import random_mask, run_smoke_here, triton_interpreter

pytestmark = pytest.mark.slow  # the Triton interpreter
# Set by tests for their test kernels (jit code reaches other modules as globals).
_common = None  # the interpreted mita.kernels.triton_common
_triton_sort = None  # Triton's own tl.sort


@pytest.fixture(scope="module")
def kernels():
    """``(routing, topk)`` defined under the interpreter (Triton decides at decoration)."""
    with triton_interpreter():
        yield (importlib.import_module("mita.kernels.routing"),
               importlib.import_module("mita.kernels.topk"))


def test_interpreter_sort_equals_tritons(kernels, fast_interpreter_sort):
    """The tests' numpy ``tl.sort`` (conftest) equals Triton's own on the interpreter, both
    directions, int64 with repeats and int32."""
    import triton
    import triton.language as tl

    @triton.jit
    def sort_rows(X, Y, Z, DESC: tl.constexpr):
        r = tl.arange(0, 4)
        c = tl.arange(0, 64)
        x = tl.load(X + r[:, None] * 64 + c[None, :])
        tl.store(Y + r[:, None] * 64 + c[None, :], tl.sort(x, dim=1, descending=DESC))
        tl.store(Z + r[:, None] * 64 + c[None, :], _triton_sort(x, dim=1, descending=DESC))

    globals()["_triton_sort"] = fast_interpreter_sort
    g = torch.Generator().manual_seed(2)
    for dtype in (torch.int64, torch.int32):
        x = torch.randint(-9, 9, (4, 64), generator=g, dtype=dtype)
        for desc in (False, True):
            y, z = torch.empty_like(x), torch.empty_like(x)
            sort_rows[(1,)](x, y, z, desc)
            assert torch.equal(y, z)
            assert torch.equal(y, x.sort(1, descending=desc).values)


def reference(landmarks, k, topk, dtype, mask=None):
    """``(B, H, m, topk)`` int64: the top-k by float64 score, lowest index on ties."""
    lm = landmarks.to(dtype).double()
    scores = (lm @ k.to(dtype).double().transpose(-1, -2)) * k.shape[-1] ** -0.5
    if mask is not None:
        scores = scores.masked_fill(mask[:, None, None, :], float("-inf"))
    flat = scores.reshape(-1, scores.shape[-1]).numpy()
    index = np.arange(flat.shape[1])
    rows = [np.sort(np.lexsort((index, -row))[:topk]) for row in flat]
    return torch.from_numpy(np.stack(rows)).reshape(*scores.shape[:3], topk), scores


def integer_qk(B, H, N, m, d, seed, tied_keys=0.0):
    """Small-integer landmarks and keys; a fraction ``tied_keys`` of the keys are one repeated
    vector, so every landmark has that many keys tied at its k-th score (more than the
    candidate buffer holds when the fraction is large)."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randint(-2, 3, (B, H, N, d), generator=g).float()
    landmarks = torch.randint(-2, 3, (B, H, m, d), generator=g).float()
    if tied_keys:  # non-negative landmarks and a positive tied vector: the tied keys score
        # ~29 against ~N(0, 8²) for the others, so they hold every landmark's top-k
        landmarks = landmarks.abs()
        tied = torch.rand(N, generator=g) < tied_keys
        k[:, :, tied] = torch.randint(1, 3, (d,), generator=g).float()
    return landmarks, k


def run_plans(topk_module, landmarks, k, topk, mask=None):
    """``threshold_topk`` launch by launch: returns the indices and the overflow flags."""
    launches, out = topk_module.threshold_topk_plans(landmarks, k, topk, k.shape[-1] ** -0.5,
                                                     mask)
    topk_module.run_launches(launches)
    return out, topk_module.overflow_flags(launches)


# (B, H, N, m, k, masked, tied fraction, overflows, dtypes): each case's landmarks fit one
# select program (≤ 16 landmarks of a 128-slot buffer, one of 2,048), since the interpreter
# runs Triton's sort slowly; the multi-program cases run float32 only.
ALL = (torch.float32, torch.bfloat16, torch.float16)
F32 = (torch.float32,)


@pytest.mark.parametrize("B,H,N,m,topk,masked,tied,overflows,dtypes", [
    (1, 2, 300, 5, 7, False, 0.0, False, ALL),   # 5 chunks of one 64-key tile, ties at k-th
    (2, 1, 200, 8, 40, True, 0.0, False, ALL),   # padding; rows with < k real keys overflow
    (1, 1, 48, 3, 48, True, 0.0, False, ALL),    # k = N: padded keys fill rows, lowest first
    (1, 2, 200, 6, 20, False, 0.8, True, ALL),   # ~160 keys tied: the buffer (128) overflows
    (1, 1, 200, 70, 30, False, 0.0, False, F32),  # two landmark blocks, five select programs
    (1, 1, 700, 2, 600, False, 0.0, False, F32),  # k > 512 (a 2,048-slot buffer)
])
def test_select_equals_reference_with_ties(kernels, B, H, N, m, topk, masked, tied, overflows,
                                           dtypes):
    """Every case has one 64-key tile per chunk (the 264-program target asks for more chunks
    than there are tiles), so each group holds one key and θ is the k-th score itself: a
    landmark overflows exactly when more than ``candidate_capacity(k)`` keys score ≥ its k-th
    score — e.g. a padded row with fewer than k real keys, whose k-th score is -inf."""
    _, topk_module = kernels
    assert topk_module.num_chunks(N, m, topk, B * H)[1] == 1
    landmarks, k = integer_qk(B, H, N, m, 16, seed=N + topk, tied_keys=tied)
    mask = random_mask(B, N, seed=topk) if masked else None
    for dtype in dtypes:
        want, scores = reference(landmarks, k, topk, dtype, mask)
        kth = scores.sort(-1, descending=True).values[..., topk - 1:topk]
        if topk < N:
            assert ((scores == kth).sum(-1) > 1).any()  # there really are ties at the k-th
        got, flag = run_plans(topk_module, landmarks, k.to(dtype), topk, mask)
        assert got.dtype == torch.int64 and torch.equal(got, want), dtype
        # the landmarks whose candidates overflowed, and only those, went to the fallback
        over = (scores >= kth).sum(-1) > topk_module.candidate_capacity(topk)
        assert torch.equal(flag.bool(), over)
        if overflows:
            assert bool(over.all())  # ~160 tied keys reach θ for every landmark


def test_threshold_topk_is_its_launches(kernels):
    """The public function runs the same five launches (k = 7, padding, float32)."""
    _, topk_module = kernels
    landmarks, k = integer_qk(2, 1, 150, 4, 16, seed=3)
    mask = random_mask(2, 150, seed=3)
    assert torch.equal(topk_module.threshold_topk(landmarks, k, 7, 0.25, mask),
                       reference(landmarks, k, 7, torch.float32, mask)[0])


def test_chunks_of_several_tiles(kernels, monkeypatch):
    """With a 4-program target, N = 2,000 (32 tiles) and k = 12 split into 2 chunks of 16
    tiles: chunk c holds tiles c, c + 2, …, so each group max spans 16 keys 128 apart; the
    select is still exact, and the padded row (real keys first) reaches both chunks."""
    _, topk_module = kernels
    monkeypatch.setattr(topk_module, "TARGET_PROGRAMS", 4)
    assert topk_module.num_chunks(2000, 3, 12, 2) == (2, 16)
    landmarks, k = integer_qk(2, 1, 2000, 3, 16, seed=12)
    mask = random_mask(2, 2000, seed=12)
    for dtype in (torch.float32, torch.bfloat16):
        got, flag = run_plans(topk_module, landmarks, k.to(dtype), 12, mask)
        assert not flag.any()
        assert torch.equal(got, reference(landmarks, k, 12, dtype, mask)[0]), dtype


def test_chunks_and_candidate_sizes(kernels):
    """The launch geometry worked out by hand: N = 2,000 keys are 32 tiles of 64; with m = 3
    (one landmark block) and B·H = 2 the 264-program target asks for 132 chunks, more than
    the 32 tiles, so one tile per chunk (G = 2,048 ≥ 4k); at N = 1M, m = k = 512, B·H = 2:
    8 landmark blocks × 2 → 17 chunks for the programs, 32 for 4k = 2,048 groups, so 32
    chunks of 512 tiles. Buffers: 2 × k rounded up to a power of two, at least 128."""
    _, topk_module = kernels
    assert topk_module.num_chunks(2000, 3, 12, 2) == (32, 1)
    assert topk_module.num_chunks(2000, 3, 12, 264) == (1, 32)  # 264 programs already
    assert topk_module.num_chunks(1 << 20, 512, 512, 2) == (32, 512)
    assert topk_module.num_chunks(1 << 14, 64, 64, 2) == (128, 2)  # 132 wanted, 256 tiles
    assert [topk_module.candidate_capacity(k) for k in (1, 64, 65, 512, 600, 2048)] == [
        128, 128, 256, 1024, 2048, 4096]


def test_select_random_scores_match_float64(kernels):
    """Normal inputs, several chunks: the k keys are the float64 top-k on every row whose k-th
    and (k+1)-th scores differ by more than 1e-4 (module docstring)."""
    _, topk_module = kernels
    g = torch.Generator().manual_seed(21)
    k = torch.randn(2, 2, 900, 32, generator=g)
    landmarks = torch.randn(2, 2, 5, 32, generator=g)
    got, flag = run_plans(topk_module, landmarks, k, 9)
    assert not flag.any()  # continuous scores: far fewer than 128 keys reach θ
    want, scores = reference(landmarks, k, 9, torch.float32)
    top = scores.sort(-1, descending=True).values
    clear = (top[..., 8] - top[..., 9]) > 1e-4
    assert clear.float().mean() > 0.9
    assert torch.equal(got[clear], want[clear])


def test_bisect_fallback_redoes_only_flagged_landmarks(kernels):
    """The exact fallback on its own: flagged landmarks get the reference top-k, the others'
    rows are left as they were (poisoned with -7)."""
    landmarks, k = integer_qk(1, 2, 130, 20, 16, seed=5)
    want, _ = reference(landmarks, k, 11, torch.float32)
    out = torch.full((1, 2, 20, 11), -7, dtype=torch.int64)
    flag = torch.zeros(1, 2, 20, dtype=torch.int8)
    flag[0, 0, [0, 3, 17]] = 1
    flag[0, 1, 19] = 1
    key_valid = torch.ones(1, 130, dtype=torch.int8)
    importlib.import_module("mita.kernels.bisect").bisect_fallback(
        landmarks, k, key_valid, flag, out, 11, 0.25, False)
    done = flag.bool()
    assert torch.equal(out[done], want[done])
    assert (out[~done] == -7).all()


def test_bitonic_kernel_stores_stay_inside_the_row(kernels):
    """``triton_common.emit_topk`` with a k-th score below the true one selects more than k
    keys: it must write only the row's k slots (the next landmark's row, here a poisoned
    guard region, stays untouched) and report how many it took, so the launcher can flag
    it."""
    import triton
    import triton.language as tl

    globals()["_common"] = importlib.import_module("mita.kernels.triton_common")  # interpreted

    @triton.jit
    def emit(LM, K, KEY_VALID, OUT, TAKEN, N, TOPK, kth_value, BLOCK_D: tl.constexpr):
        rows = tl.arange(0, 16)
        dd = tl.arange(0, BLOCK_D)
        lm = tl.load(LM + rows[:, None] * BLOCK_D + dd[None, :])
        kth = tl.full([16], kth_value, tl.int32)
        need = tl.full([16], 0, tl.int32)
        taken = _common.emit_topk(lm, K, KEY_VALID, OUT + rows * (2 * TOPK), kth, need,
                                  rows < 16, 0, 0, dd, dd < BLOCK_D, N, TOPK,
                                  N * BLOCK_D, N * BLOCK_D, BLOCK_D, 1, 1.0, False, False,
                                  16, 64)
        tl.store(TAKEN + rows, taken)

    landmarks, k = integer_qk(1, 1, 100, 16, 16, seed=9)
    out = torch.full((16, 2 * 5), -7, dtype=torch.int64)
    taken = torch.zeros(16, dtype=torch.int32)
    # kth = the sort key of score -100: below every score here (|score| ≤ 64), so all 100 keys
    # are "above" it
    minus_100 = torch.tensor([-100.0]).view(torch.int32).item() ^ 0x7FFFFFFF
    emit[(1,)](landmarks[0, 0].contiguous(), k[0, 0].contiguous(),
               torch.ones(100, dtype=torch.int8), out, taken, 100, 5, minus_100, BLOCK_D=16)
    assert (taken == 100).all()
    assert torch.equal(out[:, :5], torch.arange(5).expand(16, 5))  # the first 5 keys
    assert (out[:, 5:] == -7).all()


def test_grid_limit_refused(kernels):
    """B·H over CUDA's 65,535 programs on a grid's second axis is refused before launch."""
    routing, topk_module = kernels
    k, lm = torch.randn(1, 65_536, 8, 16), torch.randn(1, 65_536, 2, 16)
    for plan in (routing.landmark_topk_plan, topk_module.threshold_topk_plans):
        with pytest.raises(ValueError, match="65535"):
            plan(lm, k, 4, 0.25)


def test_select_refuses_bad_k(kernels):
    _, topk_module = kernels
    k, lm = torch.randn(1, 1, 3000, 16), torch.randn(1, 1, 2, 16)
    with pytest.raises(ValueError, match="k ≤ min"):
        topk_module.threshold_topk(lm, k, 2049, 0.25)
    with pytest.raises(ValueError, match="k ≤ min"):
        topk_module.threshold_topk(lm, k[:, :, :10], 11, 0.25)


def test_gpu_topk_script_dry_run(kernels, tmp_path, monkeypatch):
    """``benchmarks/gpu_topk.py --smoke``: the GPU script's own code path on the interpreter
    (N = 128, m = k = round(√(128/4)) = 6): both Triton paths equal the torch path on integer
    inputs, no landmark overflowed on normal inputs, every path timed, the table written. Run
    in this process (its kernels are the interpreted ones already imported)."""
    (row,) = run_smoke_here("gpu_topk", tmp_path, monkeypatch)
    assert (row["N"], row["m"], row["k"], row["d"]) == (128, 6, 6, 64)
    assert row["exact_vs_torch"] == {"select": True, "bitonic": True}
    assert row["select_overflow_landmarks"] == 0
    assert row["clear_rows_equal"] == {"select": 1.0, "bitonic": 1.0}
    assert all(row[f"{p}_ms"] > 0 for p in ("select", "bitonic", "torch"))
    assert "| 128 | 6 |" in (tmp_path / "gpu_topk.md").read_text()
