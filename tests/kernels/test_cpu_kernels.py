"""The compiled CPU kernels (``mita/kernels/cpu_mita.cpp``, ``backend="cpu"``) against the
PyTorch stages (``backend="torch"``, the reference path) and the float64 loop reference.

Tolerances, and why:
- 1e-10 absolute in float64: the kernels compute the same sums in another order (online
  softmax over key chunks, log-sum-exp merge of the shared and routed halves); O(100) float64
  roundings of O(1) values stay below 1e-13, while a wrong pick or weight shows at ≥ 1e-3.
- float32: 1e-5 relative to the largest output against float64, as in test_attention.py;
  float32 exponentials use ATen's vectorised exp_u20 (a few ulp) instead of std::exp.
- Selections (top-k indices, routed experts) must be equal, not close.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mita import mita_attention
from mita import stages as S
from mita.kernels import cpu
from mita.reference import reference_mita

from ..helpers import F64_TOL, rand_qkv, random_mask

F32_REL_TOL = 1e-5


@pytest.fixture(scope="module")
def ext():
    module = cpu.load()
    assert module is not None, "the CPU kernels did not build (see the log)"
    return module


# (B, H, N, d, m, k, s, mask): sizes cross every tile boundary of the kernels — key chunks of
# 256, 128 landmarks per item, 256 queries per route block and attention tile.
CASES = [
    (2, 3, 700, 16, 12, 40, 1, None),
    (2, 3, 700, 16, 12, 40, 2, None),
    (2, 2, 1100, 8, 130, 9, 1, "suffix"),
    (2, 2, 1100, 8, 130, 9, 2, "scattered"),
    (1, 2, 3000, 8, 3, 300, 1, "scattered"),  # one expert holds > 256 queries
    (3, 1, 40, 4, 64, 5, 1, "suffix"),  # N < m and short rows: empty landmarks
]


@pytest.mark.parametrize("B,H,N,d,m,k,s,mask", CASES)
def test_float64_equals_reference_path(ext, B, H, N, d, m, k, s, mask):
    q, keys, v = rand_qkv(B, H, N, d, seed=N + m + s, dv=d + 2)
    kpm = None if mask is None else random_mask(B, N, seed=N, suffix=mask == "suffix")
    got = mita_attention(q, keys, v, num_landmarks=m, topk=k, route_topk=s,
                         key_padding_mask=kpm, backend="cpu")
    want = mita_attention(q, keys, v, num_landmarks=m, topk=k, route_topk=s,
                          key_padding_mask=kpm, backend="torch")
    torch.testing.assert_close(got, want, rtol=0, atol=F64_TOL)
    if kpm is not None:
        assert torch.all(got[kpm[:, None, :].expand(-1, H, -1)] == 0)


def test_experts_no_query_selects(ext):
    # m = 40 landmarks over N = 60 queries of dimension 2: most landmarks win no query.
    q, keys, v = rand_qkv(1, 2, 60, 2, seed=4)
    lm, landmark_valid = S.pool(q, 40)
    experts, *_ = ext.route_shared(q, lm, landmark_valid,
                                   torch.rand(1, 2, 40, 2, dtype=torch.float64), 0.5, None)
    assert torch.equal(experts, S.route(q, lm, 1, landmark_valid)[..., 0])
    assert len(experts[0, 0].unique()) < 40
    for s in (1, 2):
        got = mita_attention(q, keys, v, num_landmarks=40, topk=6, route_topk=s, backend="cpu")
        want = reference_mita(q.numpy(), keys.numpy(), v.numpy(), 40, 6, s)
        np.testing.assert_allclose(got.numpy(), want, rtol=0, atol=F64_TOL)


@pytest.mark.parametrize("shared_scale", ["paper", "official"])
def test_float32_close_to_float64(ext, shared_scale):
    q, keys, v = rand_qkv(2, 2, 2000, 32, seed=9)
    mask = random_mask(2, 2000, seed=3)
    want = mita_attention(q, keys, v, num_landmarks=32, topk=48, key_padding_mask=mask,
                          shared_scale=shared_scale, backend="torch")
    got = mita_attention(q.float(), keys.float(), v.float(), num_landmarks=32, topk=48,
                         key_padding_mask=mask, shared_scale=shared_scale, backend="cpu")
    assert got.dtype == torch.float32
    err = (got.double() - want).abs().max() / want.abs().max()
    assert err < F32_REL_TOL


def test_landmark_pass_topk_ties_and_padding(ext):
    # Integer keys tie everywhere; padded keys score -inf and fill rows with < k valid keys.
    g = torch.Generator().manual_seed(1)
    lm = torch.randint(-1, 2, (2, 1, 5, 3), generator=g).double()
    k = torch.randint(-1, 2, (2, 1, 600, 3), generator=g).double()
    v = torch.randn(2, 1, 600, 3, generator=g, dtype=torch.float64)
    mask = torch.zeros(2, 600, dtype=torch.bool)
    mask[1, 7:] = True  # 7 valid keys, k = 20
    index, shared = ext.landmark_pass(lm, k, v, ~mask, 20)
    scores = S.landmark_scores(lm, k, mask) * 3 ** 0.5  # the kernel takes pre-scaled landmarks
    assert torch.equal(index, S.topk_tokens(scores, 20))
    assert index[1, 0, :, :7].tolist() == [list(range(7))] * 5
    torch.testing.assert_close(shared, S.shared_compress(scores, v), rtol=0, atol=F64_TOL)


def test_route_ties_lowest_index(ext):
    q = torch.tensor([[[[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]]]], dtype=torch.float64)
    lm = torch.tensor([[[[0.0, 1.0], [1.0, 0.0], [1.0, 0.0], [0.0, 1.0]]]], dtype=torch.float64)
    landmark_valid = torch.tensor([[True, True, True, True]])
    experts, *_ = ext.route_shared(q, lm, landmark_valid,
                                   torch.ones(1, 1, 4, 2, dtype=torch.float64), 1.0, None)
    assert experts.tolist() == [[[1, 0, 0]]]  # q2 ties all four: the first wins
    landmark_valid[0, :2] = False  # dead landmarks are never picked
    experts, *_ = ext.route_shared(q, lm, landmark_valid,
                                   torch.ones(1, 1, 4, 2, dtype=torch.float64), 1.0, None)
    assert experts.tolist() == [[[2, 3, 2]]]


def test_same_bits_for_any_thread_count_and_batch(ext):
    q, keys, v = (t.float() for t in rand_qkv(2, 2, 1500, 16, seed=2))
    threads = torch.get_num_threads()  # make test's background runs on one
    try:
        torch.set_num_threads(1)
        one = mita_attention(q, keys, v, num_landmarks=16, topk=32, backend="cpu")
        torch.set_num_threads(2)
        both = mita_attention(q, keys, v, num_landmarks=16, topk=32, backend="cpu")
        alone = mita_attention(q[1:], keys[1:], v[1:], num_landmarks=16, topk=32,
                               backend="cpu")
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, both)
    assert torch.equal(both[1:], alone)


def test_autograd_runs_the_kernels_forward_and_backward(ext):
    """With gradients asked for, backend "cpu" (and "auto" on CPU) runs the kernels' forward and
    their backward (``joint_backward``; ``tests/kernels/test_backward.py`` checks it against the
    float64 reference): gradients equal the PyTorch stages' to float64 rounding, and the
    output equals the no-gradient forward."""
    q, keys, v = rand_qkv(1, 2, 30, 4, seed=5)
    grads = {}
    for backend in ("cpu", "auto", "torch"):
        leaves = [t.clone().requires_grad_() for t in (q, keys, v)]
        out = mita_attention(*leaves, num_landmarks=3, topk=4, backend=backend)
        out.square().sum().backward()
        grads[backend] = [t.grad for t in leaves]
        with torch.no_grad():
            fast = mita_attention(q, keys, v, num_landmarks=3, topk=4, backend=backend)
        torch.testing.assert_close(fast, out.detach(), rtol=0, atol=F64_TOL)
    for a, b, c in zip(grads["cpu"], grads["auto"], grads["torch"], strict=True):
        assert torch.equal(a, b) and a.abs().sum() > 0
        torch.testing.assert_close(a, c, rtol=0, atol=F64_TOL)


def test_build_failure_falls_back(monkeypatch, tmp_path, caplog):
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    monkeypatch.setenv("MITA_CPU_BUILD_DIR", str(blocker))
    assert cpu.build_dir().parent == blocker  # the cache root; one folder per cache_key()
    assert cpu._build() is None
    assert "MiTA CPU kernels unavailable" in caplog.text


@pytest.mark.parametrize("backend,builds", [("torch", False), ("auto", True), (None, True)])
def test_service_prebuilds_kernels_only_when_a_classifier_runs_them(monkeypatch, backend,
                                                                    builds):
    from service import launch

    config = launch.load_config(launch.CPU_CONFIG)
    assert config.applications[0].args["mita_backend"] == "auto"  # the shipped CPU config
    if backend is None:
        del config.applications[0].args["mita_backend"]  # the code default: auto
    else:
        config.applications[0].args["mita_backend"] = backend
    calls = []
    monkeypatch.setattr(cpu, "load", lambda: calls.append(1))
    launch.prebuild_cpu_kernels(config)
    assert len(calls) == int(builds)
