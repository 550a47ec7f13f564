"""The fused Triton MiTA kernel (``mita.kernels``) on CPU under ``TRITON_INTERPRET=1``.

The interpreter runs the same kernel code as a GPU (tile loads by index, online softmax,
masks), in numpy, so correctness is checked here; speed only on a GPU
(``benchmarks/gpu_mita.py``).

Tolerances, and why:
- float32 kernel vs the float64 loop reference: 1e-5 relative to the largest output, as for the
  PyTorch path (``test_attention.py``): IEEE fp32 products (no TF32), fp32 online softmax over
  ≤ a few hundred entries, unit roundoff 6e-8.
- bfloat16 / float16 vs the float64 reference on the same (16-bit-representable) inputs:
  1.5e-2 / 2e-3 relative. The kernel multiplies in the input dtype, as flash attention does: the
  shared keys/values (float32 averages) and the softmax weights p are rounded to 16 bits before
  their matrix products, and the output is rounded to 16 bits (2^-9 relative for bfloat16,
  2^-12 for float16). Measured worst over 5 seeds of the test's shape: 4.7e-3 / 5.8e-4 (the
  PyTorch path, float32 inside, 3.1e-3 / 3.8e-4); the tolerances leave ~3x.
"""

from __future__ import annotations

import importlib
import os

import pytest
import torch

from mita import attention as A
from mita import mita_attention
from mita import stages as S
from mita.config import clamp_topk
from mita.hooks import MITA_STAGES, NULL_HOOK
from mita.reference import reference_mita

from ..helpers import rand_qkv, random_mask, run_smoke_here, triton_interpreter

# heavy(1): ~90 CPU s in a serial run
pytestmark = [pytest.mark.slow, pytest.mark.heavy(1)]  # the Triton interpreter: minutes on 2 cores


@pytest.fixture(scope="module")
def kernel():
    """The kernel module, (re)imported with the interpreter on: Triton decides at decoration."""
    with triton_interpreter() as module:
        yield module


def stage_inputs(q, k, v, m, topk, s, mask=None):
    """The PyTorch stages up to ``route``, as the fused kernel's arguments (paper scaling)."""
    landmarks, landmark_valid, expert_index, shared_values, experts = S.routing_stages(
        q, k, v, m, clamp_topk(topk, q.shape[2]), s, mask)
    return (landmarks * S.shared_logit_scale(q.shape[-1], "paper"), shared_values, landmark_valid,
            expert_index, experts)


def rel_err(out, ref):
    return float((out.double() - ref).abs().max() / ref.abs().max())


CASES = [  # B, H, N, d, m, k, s, mask
    (1, 1, 64, 32, 4, 8, 1, None),
    (2, 2, 100, 32, 7, 13, 1, "suffix"),
    (2, 1, 90, 64, 6, 11, 2, "scattered"),
    (1, 2, 37, 32, 5, 40, 3, None),          # k > N (clamped), s = 3
    (1, 1, 5, 32, 8, 4, 1, None),            # N < m: empty landmarks masked
    (1, 2, 3, 32, 8, 2, 4, None),            # s > live landmarks: a dead expert is routed
    (2, 1, 70, 128, 9, 33, 2, "suffix"),     # d = 128
    (1, 1, 160, 32, 70, 80, 2, "scattered"),  # m and k > BLOCK_N: several key blocks each
]


@pytest.mark.parametrize("B,H,N,d,m,topk,s,mask", CASES)
def test_kernel_matches_float64_reference(kernel, B, H, N, d, m, topk, s, mask):
    q, k, v = rand_qkv(B, H, N, d, seed=N * 31 + m, dtype=torch.float32)
    km = None if mask is None else random_mask(B, N, seed=N, suffix=mask == "suffix")
    out = mita_attention(q, k, v, num_landmarks=m, topk=topk, route_topk=s,
                         key_padding_mask=km, backend="triton")
    assert out.dtype == torch.float32
    ref = torch.from_numpy(reference_mita(q.double().numpy(), k.double().numpy(),
                                          v.double().numpy(), m, topk, s,
                                          None if km is None else km.numpy()))
    assert rel_err(out, ref) < 1e-5
    torch_path = mita_attention(q, k, v, num_landmarks=m, topk=topk, route_topk=s,
                                key_padding_mask=km, backend="torch")
    assert rel_err(out, torch_path.double()) < 1e-5


@pytest.mark.parametrize("shared_scale", ["paper", "official"])
def test_shared_scales(kernel, shared_scale):
    q, k, v = rand_qkv(1, 2, 48, 32, seed=7, dtype=torch.float32)
    out = mita_attention(q, k, v, num_landmarks=6, topk=8, shared_scale=shared_scale,
                         backend="triton")
    ref = reference_mita(q.double().numpy(), k.double().numpy(), v.double().numpy(), 6, 8, 1,
                         shared_scale=shared_scale)
    assert rel_err(out, torch.from_numpy(ref)) < 1e-5


def clustered_queries(seed):
    """Queries from 2 tight clusters: a few experts take most queries, others none."""
    g = torch.Generator().manual_seed(seed)
    centers = 2.0 * torch.randn(2, 32, generator=g)
    pick = torch.randint(0, 2, (1, 1, 200), generator=g)
    q = centers[pick] + 0.3 * torch.randn(1, 1, 200, 32, generator=g)
    k = torch.randn(1, 1, 200, 32, generator=g)
    v = torch.randn(1, 1, 200, 32, generator=g)
    return q, k, v


@pytest.mark.parametrize("s", [1, 2])
def test_ragged_experts_and_poisoned_output(kernel, s):
    q, k, v = clustered_queries(seed=3)
    mask = torch.zeros(1, 200, dtype=torch.bool)
    mask[0, 190:] = True
    mask[0, 17] = True
    shared_keys, shared_values, landmark_valid, expert_index, experts = stage_inputs(
        q, k, v, 12, 10, s, mask)
    counts = torch.bincount(experts[0, 0][~mask[0]].flatten(), minlength=12)
    assert (counts == 0).sum() >= 3, counts  # experts no query selects
    block_m = kernel._blocks(torch.float32, 32)[0]
    assert counts.max() > 2 * block_m, counts  # an expert spanning several tiles
    out = torch.full_like(q, float("nan"))
    kernel.fused_attention(q, k, v, shared_keys, shared_values, landmark_valid, expert_index,
                           experts, mask, out=out)
    assert torch.isfinite(out).all()
    assert (out[0, 0, mask[0]] == 0).all()
    ref = reference_mita(q.double().numpy(), k.double().numpy(), v.double().numpy(), 12, 10, s,
                         mask.numpy())
    assert rel_err(out, torch.from_numpy(ref)) < 1e-5


@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 1.5e-2), (torch.float16, 2e-3)])
def test_half_precision_inputs(kernel, dtype, tol):
    # 16-bit scores can route a near-tie key or query differently from float64; on these
    # fixed inputs none is that close (benchmarks/gpu_mita.py, on fresh inputs, compares with
    # the float64 stages given the kernel's own routing decisions instead)
    q, k, v = (t.to(dtype) for t in rand_qkv(2, 2, 80, 64, seed=11, dtype=torch.float32))
    mask = random_mask(2, 80, seed=5)
    out = mita_attention(q, k, v, num_landmarks=8, topk=16, route_topk=2,
                         key_padding_mask=mask, backend="triton")
    assert out.dtype == dtype
    ref = reference_mita(q.double().numpy(), k.double().numpy(), v.double().numpy(), 8, 16, 2,
                         mask.numpy())
    err = rel_err(out, torch.from_numpy(ref))
    assert 0 < err < tol  # > 0: the 16-bit path really multiplies in 16 bits


class Recorder:
    def __init__(self):
        self.names = []

    def stage(self, name):
        self.names.append(name)
        return NULL_HOOK.stage(name)

    def layer(self, index):
        return NULL_HOOK.layer(index)


def test_stage_names_fused_and_unfused(kernel):
    q, k, v = rand_qkv(1, 1, 32, 32, seed=2, dtype=torch.float32)
    fused, unfused = Recorder(), Recorder()
    mita_attention(q, k, v, num_landmarks=4, topk=4, backend="triton", hook=fused)
    mita_attention(q, k, v, num_landmarks=4, topk=4, backend="torch", hook=unfused)
    assert unfused.names == list(MITA_STAGES)
    # landmark_scores streams topk (routing.landmark_topk), route computes the shared half,
    # attention gathers by index
    assert fused.names == ["pool", "landmark_scores", "shared_compress", "route", "attention"]
    assert set(fused.names) < set(MITA_STAGES)


def test_bad_backend_and_dtype(kernel):
    q, k, v = rand_qkv(1, 1, 16, 32, seed=1)
    with pytest.raises(ValueError, match="backend must be one of"):
        mita_attention(q, k, v, num_landmarks=2, topk=2, backend="cuda")
    with pytest.raises(ValueError, match="float16/bfloat16/float32"):
        mita_attention(q, k, v, num_landmarks=2, topk=2, backend="triton")  # float64


def test_cpu_without_interpreter_refused(kernel, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET")
    q, k, v = rand_qkv(1, 1, 16, 32, seed=1, dtype=torch.float32)
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        mita_attention(q, k, v, num_landmarks=2, topk=2, backend="triton")
    assert os.environ.get("TRITON_INTERPRET") is None


def test_gpu_benchmark_script_dry_run(kernel, tmp_path, monkeypatch):
    """``benchmarks/gpu_mita.py --smoke``: the GPU script's own code path (checks, timing,
    table) on the CPU interpreter, so the prepared GPU run is not its first run."""
    result = run_smoke_here("gpu_mita", tmp_path, monkeypatch)
    assert len(result["checks"]) == 11 and all(c["ok"] for c in result["checks"])
    assert sum("landmark_topk ==" in c["check"] for c in result["checks"]) == 2
    assert sum("threshold_topk ==" in c["check"] for c in result["checks"]) == 2
    assert [r["N"] for r in result["speed"]] == [128]
    # the interpreter has no timer: the chooser's fixed order serves the select
    assert result["speed"][0]["topk_path"] == "select"
    assert result["speed"][0]["mita_ms"] > 0 and result["speed"][0]["dense_ms"] > 0
    fused = result["stages"][0]
    assert fused["backend"] == "triton (fused)" and "gather" not in fused
    assert fused["attention"] > 0 and "gather" in result["stages"][1]
    table = (tmp_path / "gpu_mita.md").read_text()
    assert "| 128 | 4 | 4 | float32 |" in table and "### Attention only" in table
    only = result["attention_only"][0]
    assert (only["N"], only["m"], only["k"]) == (128, 4, 4) and only["mita_ms"] > 0
    assert set(only["floor"]) == {"pool", "landmark_scores", "topk", "shared_compress", "route"}
    assert set(only["stages"]) == {"pool", "landmark_scores", "shared_compress", "route",
                                   "attention"}


def test_launch_plan_refuses_head_dims_over_128(kernel):
    q = torch.randn(1, 1, 8, 160)
    with pytest.raises(ValueError, match="head dims up to 128"):
        kernel.launch_plan(q, q, q, torch.randn(1, 1, 2, 160), torch.randn(1, 1, 2, 160),
                           torch.ones(1, 2, dtype=torch.bool),
                           torch.zeros(1, 1, 2, 4, dtype=torch.long),
                           torch.zeros(1, 1, 8, 1, dtype=torch.long))
    # auto falls back to the PyTorch stages for such heads instead of failing
    assert not A._use_triton("auto", q, q)


def test_fused_path_computes_shared_values_by_sdpa_in_input_dtype(kernel, monkeypatch):
    """The triton path takes eq. 8 from one SDPA call on q, k, v in their own dtype (no m × N
    softmax); the torch path keeps softmax(scores) @ v as the reference."""
    calls = []
    real = S.shared_compress_sdpa

    def spy(landmarks, k, v, mask=None):
        calls.append(k.dtype)
        return real(landmarks, k, v, mask)

    monkeypatch.setattr(S, "shared_compress_sdpa", spy)
    q, k, v = (t.to(torch.bfloat16) for t in rand_qkv(1, 2, 48, 32, seed=9,
                                                       dtype=torch.float32))
    mita_attention(q, k, v, num_landmarks=4, topk=8, backend="triton")
    mita_attention(q, k, v, num_landmarks=4, topk=8, backend="torch")
    assert calls == [torch.bfloat16]


# --- routing kernels (mita/kernels/routing.py) -------------------------------------------


@pytest.fixture(scope="module")
def routing(kernel):
    return importlib.import_module("mita.kernels.routing")


def integer_qk(B, H, N, m, d, seed):
    """Small-integer keys and landmarks, d a power of 4: every score (and 1/√d) is exact in
    float32 whatever the summation order, and ties are everywhere — so the kernel must equal
    the PyTorch stages exactly, ties included."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randint(-2, 3, (B, H, N, d), generator=g).float()
    landmarks = torch.randint(-2, 3, (B, H, m, d), generator=g).float()
    return landmarks, k


@pytest.mark.parametrize("B,H,N,d,m,topk,masked", [
    (1, 2, 150, 16, 5, 7, False),    # 3 super-tiles of 64, ties at the boundary
    (2, 1, 100, 64, 18, 70, True),   # two landmark blocks, K_PAD 128, padding
    (1, 1, 40, 16, 3, 40, True),     # k = N: padded keys fill the rows, lowest index first
])
def test_landmark_topk_equals_torch_stages_with_ties(routing, B, H, N, d, m, topk, masked):
    landmarks, k = integer_qk(B, H, N, m, d, seed=N + topk)
    mask = random_mask(B, N, seed=topk) if masked else None
    want = S.topk_tokens(S.landmark_scores(landmarks, k, mask), topk)
    scores = S.landmark_scores(landmarks, k, mask)
    kth = scores.sort(-1, descending=True).values[..., topk - 1:topk]
    if topk < N:
        assert ((scores == kth).sum(-1) > 1).any()  # the test really has ties at the k-th
    else:
        assert mask.any(-1).all()  # every row takes padded (-inf) keys
    for dtype in (torch.float32, torch.bfloat16):  # integers: exact in bfloat16 too
        got = routing.landmark_topk(landmarks, k.to(dtype), topk, d ** -0.5, mask)
        assert got.dtype == torch.int64 and torch.equal(got, want), dtype


def test_landmark_topk_random_scores_match_float64(routing):
    """Fresh normal inputs: the kernel's k keys are the float64 top-k on every row whose k-th
    and (k+1)-th float64 scores differ by more than 1e-4 (fp32 products of ~unit entries over
    d = 32 are exact to ~1e-6; closer pairs may legitimately swap)."""
    g = torch.Generator().manual_seed(21)
    k = torch.randn(2, 2, 200, 32, generator=g)
    landmarks = torch.randn(2, 2, 5, 32, generator=g)
    got = routing.landmark_topk(landmarks, k, 9, 32 ** -0.5)
    scores = (landmarks.double() @ k.double().transpose(-1, -2)) * 32 ** -0.5
    top = scores.sort(-1, descending=True)
    clear = (top.values[..., 8] - top.values[..., 9]) > 1e-4
    assert clear.float().mean() > 0.9
    want = top.indices[..., :9].sort(-1).values
    assert torch.equal(got[clear], want[clear])


def test_landmark_topk_refuses_bad_k(routing):
    k, lm = torch.randn(1, 1, 600, 16), torch.randn(1, 1, 2, 16)
    with pytest.raises(ValueError, match="k ≤ min"):
        routing.landmark_topk(lm, k, 513, 0.25)
    with pytest.raises(ValueError, match="k ≤ min"):
        routing.landmark_topk(lm, k[:, :, :10], 11, 0.25)


def test_route_shared_equals_route_and_shared_branch(routing):
    """Experts equal ``route`` (integer inputs: ties, lowest index; dead landmarks never
    picked); the shared partials equal softmax over the live landmarks' c·q·q̃ (1e-6: fp32
    online softmax over 70 entries)."""
    g = torch.Generator().manual_seed(4)
    q = torch.randint(-2, 3, (2, 2, 130, 16), generator=g).float()
    landmarks = torch.randint(-2, 3, (2, 2, 70, 16), generator=g).float()
    sv = torch.randn(2, 2, 70, 24, generator=g)
    landmark_valid = torch.rand(2, 70, generator=g) > 0.3
    experts, pm, pl, pa = routing.route_shared(q, landmarks, sv, landmark_valid, 0.25)
    assert torch.equal(experts, S.route(q, landmarks, 1, landmark_valid))
    assert landmark_valid.gather(1, experts[:, :, :, 0].flatten(1)).all()
    logits = (q @ landmarks.transpose(-1, -2) * 0.25).masked_fill(
        ~landmark_valid[:, None, None], -1e30)
    assert torch.equal(pm, logits.amax(-1))
    w = torch.exp(logits - pm[..., None])
    assert rel_err(pl, w.sum(-1).double()) < 1e-6
    assert rel_err(pa, (w @ sv).double()) < 1e-6


def test_k_over_512_falls_back_to_torch_topk(kernel):
    q, k, v = rand_qkv(1, 1, 600, 16, seed=8, dtype=torch.float32)
    out = mita_attention(q, k, v, num_landmarks=3, topk=520, backend="triton")
    ref = reference_mita(q.double().numpy(), k.double().numpy(), v.double().numpy(), 3, 520)
    assert rel_err(out, torch.from_numpy(ref)) < 1e-5


def test_autograd_picks_the_triton_backward(kernel, monkeypatch):
    """Under autograd "triton" trains on the Triton kernels (forward and backward,
    ``test_backward_triton.py`` checks the numbers), and so does "auto" on CUDA where the
    forward kernels take the inputs; elsewhere "auto" on CUDA takes the tiled PyTorch
    backward."""
    q, k, v = (t.requires_grad_() for t in rand_qkv(1, 1, 32, 16, seed=3, dtype=torch.float32))
    out = mita_attention(q, k, v, num_landmarks=4, topk=4, backend="triton")
    out.sum().backward()
    assert q.grad.abs().sum() > 0 and k.grad.abs().sum() > 0
    assert A._grad_impl("triton", q, k, v) == "triton"
    monkeypatch.setattr(A, "ATOMIC_TRITON_BACKWARD", True)
    assert A._grad_impl("triton", q, k, v) == "triton_atomic"
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    assert A._grad_impl("auto", q, k, v) == "triton_atomic"  # as on a GPU: float32, d ≤ 128
    wide = torch.zeros(1, 1, 4, 256, requires_grad=True)  # head dim over the kernels' 128
    assert A._grad_impl("auto", wide, wide, wide) == "tiled"
    with torch.no_grad():
        assert A._grad_impl("auto", q, k, v) is None  # inference: the forward paths


# --- pool and tile table (mita/kernels/pooling.py, mita/kernels/tile_table.py) -------------


@pytest.fixture(scope="module")
def pooling(kernel):
    return importlib.import_module("mita.kernels.pooling")


def pooled_by_rank(q, m, mask):
    """Eq. 5's 1-D rule written out token by token in float64: the valid token of rank r (of
    L in its row) goes to landmark ⌊r·m/L⌋; returns the means (zero when empty) and counts."""
    B, H, N, d = q.shape
    sums = torch.zeros(B, H, m, d, dtype=torch.float64)
    counts = torch.zeros(B, m, dtype=torch.int64)
    for b in range(B):
        real = [n for n in range(N) if mask is None or not mask[b, n]]
        for r, n in enumerate(real):
            sums[b, :, r * m // len(real)] += q[b, :, n].double()
            counts[b, r * m // len(real)] += 1
    return sums / counts.clamp_min(1)[:, None, :, None], counts


@pytest.mark.parametrize("B,H,N,d,m,mask", [
    (2, 2, 100, 32, 7, "suffix"),     # N % m ≠ 0, padding at the end
    (2, 1, 90, 48, 6, "scattered"),   # padding anywhere: positions found by binary search
    (2, 1, 64, 32, 8, None),          # the common case: N/m tokens per landmark
    (1, 2, 5, 16, 8, None),           # N < m: empty landmarks
    (2, 2, 50, 32, 9, "short"),       # a row with 3 real tokens: 6 of its 9 landmarks empty
])
def test_pool_landmarks_follow_the_rank_rule(pooling, B, H, N, d, m, mask):
    """Small-integer queries: every fp32 sum is exact, so each landmark is one rounding of the
    exact mean (within one float32 ulp, 2^-23 relative, of the float64 mean rounded)."""
    g = torch.Generator().manual_seed(N + m)
    q = torch.randint(-3, 4, (B, H, N, d), generator=g).float()
    km = None
    if mask == "short":
        km = torch.zeros(B, N, dtype=torch.bool)
        km[0, 3:] = True
    elif mask is not None:
        km = random_mask(B, N, seed=N, suffix=mask == "suffix")
    want, counts = pooled_by_rank(q, m, km)
    assert (counts == 0).any() == (N < m or mask == "short")
    for dtype in (torch.float32, torch.bfloat16, torch.float16):  # small integers: exact
        landmarks, lm, valid, key_valid, key_bias = pooling.pool_landmarks(q.to(dtype), m, km)
        torch.testing.assert_close(landmarks, want.float(), rtol=2 ** -23, atol=0)
        assert lm.dtype == dtype and torch.equal(lm, landmarks.to(dtype))
        assert torch.equal(valid, counts > 0)
        if km is None:
            assert key_bias is None and torch.equal(key_valid, torch.ones(B, N, dtype=torch.int8))
        else:
            assert torch.equal(key_valid, (~km).to(torch.int8))
            assert key_bias.dtype == dtype and tuple(key_bias.shape) == (B, 1, 1, N)
            assert torch.equal(key_bias[:, 0, 0].isinf(), km) and (key_bias <= 0).all()
            assert (key_bias[:, 0, 0][~km] == 0).all()


@pytest.mark.parametrize("s,masked", [(1, True), (3, False), (2, True)])
def test_tile_table_groups_entries_by_expert(kernel, s, masked):
    """Every real (query, expert) entry appears once in ``order``, in its expert's run (runs in
    expert order, lengths = the entry counts); each run is cut into tiles of ≤ BLOCK_M entries
    in order; padded queries' entries get no slot; spare tiles are -1. BLOCK_M = 64, the 16-bit
    attention tile (the plan takes it as an argument)."""
    BLOCK_M = 64
    B, H, N, m = 2, 2, 150, 9
    g = torch.Generator().manual_seed(s)
    experts = torch.randint(0, 4, (B, H, N, s), generator=g)  # experts 4..8 stay empty
    experts[0, 1, :100] = 5  # one expert over BLOCK_M = 64 entries: two tiles
    mask = random_mask(B, N, seed=3, suffix=False) if masked else None
    key_valid = None if mask is None else (~mask).to(torch.int8)
    launches, (order, tile_e, tile_lo, tile_hi) = kernel.tile_table_plan(
        experts, key_valid, m, BLOCK_M)
    kernel.run_tile_table(launches)
    T = -(-N * s // BLOCK_M) + m  # cdiv(N·s, BLOCK_M) + m
    assert tuple(tile_e.shape) == (B * H, T)
    for bh in range(B * H):
        b, h = divmod(bh, H)
        real = [(n * s + j, int(experts[b, h, n, j])) for n in range(N) for j in range(s)
                if mask is None or not mask[b, n]]
        start, used = 0, 0
        for e in range(m):
            entries = sorted(r for r, x in real if x == e)
            run = order[bh, start:start + len(entries)]
            assert sorted(run.tolist()) == entries, (bh, e)
            n_tiles = -(-len(entries) // BLOCK_M)
            tiles = slice(used, used + n_tiles)
            assert (tile_e[bh, tiles] == e).all()
            lo = [start + t * BLOCK_M for t in range(n_tiles)]
            assert tile_lo[bh, tiles].tolist() == lo
            assert tile_hi[bh, tiles].tolist() == [min(x + BLOCK_M,
                                                       start + len(entries)) for x in lo]
            start, used = start + len(entries), used + n_tiles
        assert start == len(real) and (tile_e[bh, used:] == -1).all()
