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

from ..helpers import random_mask, run_smoke_here, triton_interpreter

# heavy(2): ~83 CPU s in a serial run
pytestmark = [pytest.mark.slow, pytest.mark.heavy(2)]  # the Triton interpreter
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


# (B, H, N, m, k, masked, tied fraction, dtypes): each case's landmarks fit one select program
# (≤ 8 landmarks of a 2 × 128-slot buffer, one of 2 × 2,048), since the interpreter runs
# Triton's sort slowly; the multi-program cases run float32 only.
ALL = (torch.float32, torch.bfloat16, torch.float16)
F32 = (torch.float32,)


@pytest.mark.parametrize("B,H,N,m,topk,masked,tied,dtypes", [
    (1, 2, 300, 5, 7, False, 0.0, ALL),   # 5 chunks of one 64-key tile, ties at k-th
    (2, 1, 200, 8, 40, True, 0.0, ALL),   # padding: rows with < k real keys
    (1, 1, 48, 3, 48, True, 0.0, ALL),    # k = N: padded keys fill rows, lowest first
    (1, 2, 200, 6, 20, False, 0.8, ALL),  # ~160 keys tied at θ: more than the 128 tie slots
    (1, 1, 200, 70, 30, False, 0.0, F32),  # two landmark blocks, nine select programs
    (1, 1, 700, 2, 600, False, 0.0, F32),  # k > 512 (a 2 × 2,048-slot buffer)
])
def test_select_equals_reference_with_ties(kernels, B, H, N, m, topk, masked, tied, dtypes):
    """Every case has one 64-key tile per chunk (the 264-program target asks for more chunks
    than there are tiles), so each group holds one key and θ is the k-th score itself. Ties
    at θ — a padded row with fewer than k real keys (its k-th score is -inf), mass ties of
    small integers — go to their own half of the buffer or, where more ties than the half's
    128 slots reached θ and fewer than k keys lie above it, come from the tie window (here
    G ≥ N: every key): exact, and no landmark is flagged for the fallback."""
    _, topk_module = kernels
    assert topk_module.num_chunks(N, m, topk, B * H)[1] == 1
    landmarks, k = integer_qk(B, H, N, m, 16, seed=N + topk, tied_keys=tied)
    mask = random_mask(B, N, seed=topk) if masked else None
    for dtype in dtypes:
        want, scores = reference(landmarks, k, topk, dtype, mask)
        kth = scores.sort(-1, descending=True).values[..., topk - 1:topk]
        if topk < N:
            assert ((scores == kth).sum(-1) > 1).any()  # there really are ties at the k-th
        one_pass = (((scores > kth).sum(-1) < topk)
                    & ((scores == kth).sum(-1) > topk_module.candidate_capacity(topk)))
        if tied:  # the tie half (128 slots) overflows on every landmark: the window's ties
            assert bool(one_pass.all())
        got, flag = run_plans(topk_module, landmarks, k.to(dtype), topk, mask)
        assert got.dtype == torch.int64 and torch.equal(got, want), dtype
        assert not flag.any(), dtype


def repeated_keys(block, copies, m, d, seed, noise=0.0):
    """Keys that are one block of ``block`` random keys repeated ``copies`` times (plus
    ``noise``·N(0, 1) per element), and m random landmarks."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(1, 2, block, d, generator=g).repeat(1, 1, copies, 1)
    k = k + noise * torch.randn(k.shape, generator=g)
    return torch.randn(1, 2, m, d, generator=g), k


@pytest.mark.parametrize("block,copies,topk,target", [
    (256, 8, 64, 2),    # 2,048 keys in 64 tiles, 8 chunks (G = 256): 8 copies of a key a group
    (128, 32, 64, 2),   # 4,096 keys, G = 256: each key in 2 groups of 16 copies
    (128, 32, 30, 2),   # G = 128, k below the 32 copies of the best key: θ is its score
])
def test_repeated_content_is_exact_without_the_fallback(kernels, monkeypatch, block, copies,
                                                       topk, target):
    """The issue's repeated content, test-sized (a 2,048-token block repeated to 16K and 64K
    at the service's shapes puts every copy of a key in one group, as here): θ counts the
    copies equal to each group's max, so at most the copies of k keys reach it and the
    select is the float64 top-k (lowest index among the equal copies), none flagged. Before
    the group counts, θ was the k-th largest group max: with 8 copies per group ≥ 8k keys
    reached it, more than the 2k-slot buffer, and every landmark went to the bisection."""
    _, topk_module = kernels
    monkeypatch.setattr(topk_module, "TARGET_PROGRAMS", target)
    landmarks, k = repeated_keys(block, copies, 4, 16, seed=block + copies)
    n = block * copies
    C, per_chunk = topk_module.num_chunks(n, 4, topk, 2)
    G = C * topk_module.SELECT_BLOCK_N
    assert per_chunk > 1 and G % block == 0  # groups hold several copies of one key
    got, flag = run_plans(topk_module, landmarks, k, topk)
    assert torch.equal(got, reference(landmarks, k, topk, torch.float32)[0])
    assert not flag.any()


def test_all_equal_keys_and_short_padded_rows_take_ties_from_the_window(kernels, monkeypatch):
    """All-equal keys (every score ties) and a padded row with 10 real keys of 3,000 (k = 50):
    θ is the tied score (−inf for the padded row) and thousands of keys tie at it, far more
    than the tie half's 128 slots. The select takes the keys above θ and the lowest-index
    ties from the tie window (keys 0 … G − 1 = 223: 94 tiles of 32 keys, 7 chunks of 14
    tiles): exact, and no landmark flagged for the fallback (before the window, all went to
    its pass from θ)."""
    _, topk_module = kernels
    monkeypatch.setattr(topk_module, "TARGET_PROGRAMS", 4)
    assert topk_module.num_chunks(3000, 3, 50, 2) == (7, 14)
    g = torch.Generator().manual_seed(4)
    landmarks = torch.randn(2, 1, 3, 16, generator=g)
    k = torch.randn(2, 1, 3000, 16, generator=g)
    k[0] = 0.5  # batch row 0: all keys equal
    mask = torch.zeros(2, 3000, dtype=torch.bool)
    mask[1, 10:] = True  # batch row 1: 10 real keys
    got, flag = run_plans(topk_module, landmarks, k, 50, mask)
    assert torch.equal(got, reference(landmarks, k, 50, torch.float32, mask)[0])
    assert torch.equal(got[0], torch.arange(50).expand(1, 3, 50))
    assert not flag.any()


def test_ties_past_the_window_take_one_pass_from_theta(kernels, monkeypatch):
    """Where the window (keys 0 … 223) holds fewer ties than needed — its keys are distinct
    and low-scoring, and the 2,744 keys from 256 on one tied high-scoring vector — the landmark
    is flagged 2 and the fallback launch takes one pass from θ: the lowest-index ties, exact
    (keys 256 … 305), never the 32-pass bisection.

    The landmarks are small integers and the tied vector all ones, so every tied score is an
    exact float sum whatever order a dot product adds in: with fractional values the
    interpreter's numpy matmul rounds the same dot differently at different positions of a
    tile on some CPUs (SIMD paths), and the "ties" differed in their last bit."""
    _, topk_module = kernels
    monkeypatch.setattr(topk_module, "TARGET_PROGRAMS", 4)
    g = torch.Generator().manual_seed(6)
    # positive integers: the tied vector wins, its score exact
    landmarks = torch.randint(1, 4, (1, 1, 3, 16), generator=g).float()
    k = torch.randn(1, 1, 3000, 16, generator=g) * 0.1
    k[:, :, 256:] = 1.0
    got, flag = run_plans(topk_module, landmarks, k, 50)
    assert torch.equal(got, reference(landmarks, k, 50, torch.float32)[0])
    assert torch.equal(got[0, 0], torch.arange(256, 306).expand(3, 50))
    assert (flag == 2).all()


def test_noisy_repeats_overflow_to_the_exact_fallback(kernels, monkeypatch):
    """What the group counts cannot bound: copies that differ by noise (positions make a
    model's repeated tokens such keys) each count once, so ~copies × k keys score above θ,
    more than the 2k slots. Those landmarks are flagged 1 and the bisection computes them:
    still exact (the k-th and (k+1)-th scores are far apart on these rows)."""
    _, topk_module = kernels
    monkeypatch.setattr(topk_module, "TARGET_PROGRAMS", 2)
    landmarks, k = repeated_keys(256, 8, 4, 16, seed=8, noise=1e-3)
    got, flag = run_plans(topk_module, landmarks, k, 64)
    assert (flag == 1).all()
    assert torch.equal(got, reference(landmarks, k, 64, torch.float32)[0])


def test_threshold_topk_is_its_launches(kernels):
    """The public function runs the same five launches (k = 7, padding, float32)."""
    _, topk_module = kernels
    landmarks, k = integer_qk(2, 1, 150, 4, 16, seed=3)
    mask = random_mask(2, 150, seed=3)
    assert torch.equal(topk_module.threshold_topk(landmarks, k, 7, 0.25, mask),
                       reference(landmarks, k, 7, torch.float32, mask)[0])


def test_chunks_of_several_tiles(kernels, monkeypatch):
    """With a 4-program target, N = 2,000 (63 tiles of 32 keys) and k = 12 split into 2 chunks
    of 32 tiles: chunk c holds tiles c, c + 2, …, so each group max spans 32 (31) keys 64
    apart; the select is still exact, and the padded row (real keys first) reaches both
    chunks."""
    _, topk_module = kernels
    monkeypatch.setattr(topk_module, "TARGET_PROGRAMS", 4)
    assert topk_module.num_chunks(2000, 3, 12, 2) == (2, 32)
    landmarks, k = integer_qk(2, 1, 2000, 3, 16, seed=12)
    mask = random_mask(2, 2000, seed=12)
    for dtype in (torch.float32, torch.bfloat16):
        got, flag = run_plans(topk_module, landmarks, k.to(dtype), 12, mask)
        assert not flag.any()
        assert torch.equal(got, reference(landmarks, k, 12, dtype, mask)[0]), dtype


def test_chunks_and_candidate_sizes(kernels):
    """The launch geometry worked out by hand: N = 2,000 keys are 63 tiles of 32; with m = 3
    (one landmark block) and B·H = 2 the 264-program target asks for 132 chunks, more than
    the 63 tiles, so one tile per chunk (G = 2,016 ≥ 4k); with 264 programs already, the
    4k = 48 groups ask for 2 chunks (of 32 tiles); at N = 1M, m = k = 512, B·H = 2: 8
    landmark blocks × 2 → 17 chunks for the programs, 64 for 4k = 2,048 groups, so 64 chunks
    of 512 tiles; at 16K, m = k = 64: 132 chunks wanted of 512 tiles, 4 tiles each, 128
    chunks. Buffers: 2 × k rounded up to a power of two, at least 128."""
    _, topk_module = kernels
    assert topk_module.num_chunks(2000, 3, 12, 2) == (63, 1)
    assert topk_module.num_chunks(2000, 3, 12, 264) == (2, 32)  # 264 programs already
    assert topk_module.num_chunks(1 << 20, 512, 512, 2) == (64, 512)
    assert topk_module.num_chunks(1 << 14, 64, 64, 2) == (128, 4)  # 132 wanted, 512 tiles
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


def sort_keys(scores):
    """``triton_common.score_keys``' int32 sort keys of float scores (float32 bits, negatives
    flipped)."""
    bits = scores.float().contiguous().view(torch.int32)
    return torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


def test_bisect_fallback_redoes_only_flagged_landmarks(kernels):
    """The exact fallback on its own: landmarks flagged 1 (bisection) and 2 (the k-th score
    given, with the count of keys above it), mixed in one program, get the reference top-k;
    the others' rows are left as they were (poisoned with -7)."""
    bisect = importlib.import_module("mita.kernels.bisect")
    landmarks, k = integer_qk(1, 2, 130, 20, 16, seed=5)
    want, scores = reference(landmarks, k, 11, torch.float32)
    kth_score = scores.sort(-1, descending=True).values[..., 10]
    assert ((scores == kth_score[..., None]).sum(-1) > 1).any()  # ties at the k-th
    out = torch.full((1, 2, 20, 11), -7, dtype=torch.int64)
    flag = torch.zeros(1, 2, 20, dtype=torch.int8)
    flag[0, 0, [0, 3, 17]] = 1
    flag[0, 1, 19] = 1
    flag[0, 0, [1, 4]] = 2  # in the programs of landmarks 0-15 and 16-19 with bisected ones
    flag[0, 1, [2, 18]] = 2
    kth = sort_keys(kth_score).to(torch.int32)
    count = torch.stack([(scores > kth_score[..., None]).sum(-1),
                         torch.full_like(kth, 999)], -1).to(torch.int32)
    key_valid = torch.ones(1, 130, dtype=torch.int8)
    kernel, grid, args, meta = bisect.bisect_plan(landmarks, k, key_valid, flag, out, 11, 0.25,
                                                  False, kth=kth, count=count)
    kernel[grid](*args, **meta)
    done = flag.bool()
    assert torch.equal(out[done], want[done])
    assert (out[~done] == -7).all()
    # flag 2 takes the given k-th key, no bisection: a k-th key below every score with no key
    # counted above it makes the pass write the first k keys
    kth[0, 1, 2], count[0, 1, 2, 0] = -(2 ** 31) + 1, 0
    kernel[grid](*args, **meta)
    assert torch.equal(out[0, 1, 2], torch.arange(11)) and not torch.equal(want[0, 1, 2],
                                                                            torch.arange(11))
    out.fill_(-7)
    flag.masked_fill_(flag == 2, 0)
    bisect.bisect_fallback(landmarks, k, key_valid, flag, out, 11, 0.25, False)
    assert torch.equal(out[flag.bool()], want[flag.bool()]) and (out[flag == 0] == -7).all()


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
