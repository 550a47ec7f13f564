"""MiTA's backward (``mita/joint.py``, the CPU kernel ``joint_backward``): gradients against
float64 references, reproducibility, what is kept for the backward, the autograd graph's size
and the operators' registration.

Tolerances, and why:
- ``gradcheck`` (float64, finite differences with eps = 1e-6): atol 1e-7 — a central
  difference of a smooth function has error O(eps²·f''') ≈ 1e-12 plus rounding
  O(1e-16 / eps) = 1e-10; a wrong term in a gradient is O(0.1). The inputs are fresh random
  normals: top-k and route have no ties closer than eps, so the selections do not flip.
- float64 gradients of every implementation against ``reference_mita_autograd`` (a per-query
  loop, autograd through it): 1e-10 absolute — the same sums in another order (O(100)
  roundings of O(1) values stay below 1e-13).
- float32 gradients against the float64 reference: 5e-6 relative to the largest entry of
  each gradient. Sums of up to m + s·k products in float32 (2^-24 ≈ 6e-8 each) and, on the
  CPU kernels, ATen's vectorised exp_u20 (a few ulp) gave at most 5.1e-7 when this was
  written (``test_float32_gradients``, dq at N = 300); one wrongly weighted entry moves a
  gradient by ≥ 1e-3.
- Selections (top-k indices, routes) are equal, not close: the float32 cases use inputs whose
  float32 and float64 scores order alike (fresh normals; the tie case uses halves, exact in
  both).
"""

from __future__ import annotations

import functools

import pytest
import torch

from mita import joint
from mita import stages as S
from mita.attention import mita_attention
from mita.config import ModelConfig
from mita.hooks import NULL_HOOK
from mita.kernels import cpu
from mita.layers import DenseAttention, MiTAAttention
from mita.reference import reference_mita, reference_mita_autograd

from ..helpers import rand_qkv, random_mask

IMPLS = ("torch", "cpu", "tiled")
F64_GRAD_TOL = 1e-10
F32_GRAD_REL_TOL = 5e-6


@pytest.fixture(scope="module", autouse=True)
def ext():
    module = cpu.load()
    assert module is not None, "the CPU kernels did not build (see the log)"
    return module


# (B, H, N, d, m, k, s, masked, grid, shared_scale)
CASES = [
    (2, 2, 37, 8, 5, 6, 1, False, None, "paper"),
    (2, 2, 37, 8, 5, 6, 2, True, None, "paper"),
    (1, 3, 40, 8, 6, 5, 3, False, None, "official"),
    (2, 1, 36, 8, 4, 7, 1, True, (6, 6), "paper"),
    (2, 2, 30, 8, 4, 30, 1, True, None, "official"),  # k > valid keys: padded picks masked
    (1, 2, 9, 4, 12, 3, 2, True, None, "paper"),  # N < m: empty landmarks
    (4, 4, 24, 4, 4, 5, 1, True, None, "paper"),  # B·H = 16: one CPU work item per head
]


def _inputs(case, seed, dtype=torch.float64):
    B, H, N, d, m, topk, s, masked, grid, scale = case
    q, k, v = rand_qkv(B, H, N, d, seed=seed, dtype=dtype)
    mask = random_mask(B, N, seed=seed + 1) if masked else None
    kw = dict(num_landmarks=m, topk=min(topk, N), route_topk=s, key_padding_mask=mask,
              landmark_grid=grid, shared_scale=scale)
    return q, k, v, kw


def _impl(impl, q, k, v, kw):
    return joint.mita_attention_grad(q, k, v, kw["num_landmarks"], kw["topk"],
                                     kw["route_topk"], kw["key_padding_mask"],
                                     kw["landmark_grid"], kw["shared_scale"], impl, NULL_HOOK)


def _reference(q, k, v, kw):
    return reference_mita_autograd(q, k, v, kw["num_landmarks"], kw["topk"], kw["route_topk"],
                                   kw["key_padding_mask"], kw["landmark_grid"],
                                   kw["shared_scale"])


@functools.cache
def _reference_grads(case):
    """The reference's output and gradients for a ``CASES`` entry (computed once per case)."""
    q, k, v, kw = _inputs(case, seed=sum(case[:7]))
    weight = torch.randn(*q.shape[:3], v.shape[-1], dtype=torch.float64,
                         generator=torch.Generator().manual_seed(7))
    return _grads(lambda a, b, c: _reference(a, b, c, kw), q, k, v, weight)


def _grads(fn, q, k, v, weight):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = fn(q, k, v)
    return (out.detach(), *torch.autograd.grad((out * weight).sum(), (q, k, v)))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", CASES, ids=lambda c: "B{}H{}N{}d{}m{}k{}s{}{}{}{}".format(
    *c[:7], "-mask" if c[7] else "", "-grid" if c[8] else "", "-" + c[9]))
def test_float64_gradients_equal_the_reference(impl, case):
    """Every implementation's float64 output and gradients to q, k, v equal the per-query
    float64 reference (autograd through eqs. 5-12), whose output equals the numpy one."""
    q, k, v, kw = _inputs(case, seed=sum(case[:7]))
    weight = torch.randn(*q.shape[:3], v.shape[-1], dtype=torch.float64,
                         generator=torch.Generator().manual_seed(7))
    want = _reference_grads(case)
    got = _grads(lambda a, b, c: _impl(impl, a, b, c, kw), q, k, v, weight)
    numpy_ref = reference_mita(q.numpy(), k.numpy(), v.numpy(), kw["num_landmarks"], kw["topk"],
                               kw["route_topk"], None if kw["key_padding_mask"] is None
                               else kw["key_padding_mask"].numpy(), kw["landmark_grid"],
                               kw["shared_scale"])
    torch.testing.assert_close(want[0], torch.from_numpy(numpy_ref), rtol=0, atol=F64_GRAD_TOL)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
        assert b.abs().max() > 1e-3, name  # a real gradient, not zeros
        torch.testing.assert_close(a, b, rtol=0, atol=F64_GRAD_TOL, msg=name)


# Small enough for finite differences (one forward per input element): s = 1 and 2, a mask
# with empty landmarks, a 2-D grid, both shared scales.
GRADCHECK_CASES = [(1, 1, 12, 4, 3, 4, 1, False, None, "paper"),
                   (2, 1, 10, 4, 4, 3, 2, True, None, "official"),
                   (1, 1, 16, 4, 4, 5, 1, True, (4, 4), "paper")]


@pytest.mark.parametrize("impl", IMPLS)
def test_gradcheck(impl):
    """``torch.autograd.gradcheck`` (float64 finite differences) on each implementation, in
    its fast mode: uᵀJv for random u, v against the finite differences along v, not the whole
    Jacobian (one backward per output element: ~60 s of the suite for the three; the full
    gradients are compared with the float64 reference above)."""
    for case in GRADCHECK_CASES:
        q, k, v, kw = _inputs(case, seed=61 + case[2])
        assert torch.autograd.gradcheck(
            lambda a, b, c, kw=kw: _impl(impl, a, b, c, kw),
            tuple(t.requires_grad_() for t in (q, k, v)), eps=1e-6, atol=1e-7,
            fast_mode=True), case


@pytest.mark.parametrize("backend", ["cpu", "torch", "auto"])
@pytest.mark.parametrize("case", [CASES[1], CASES[3], CASES[4],
                                  (1, 2, 300, 16, 8, 16, 1, True, None, "paper")],
                         ids=["s2-mask", "grid", "k-over-valid", "N300"])
def test_float32_gradients(backend, case):
    """float32 gradients of ``mita_attention`` on each CPU backend against the float64
    reference on the same inputs, within ``F32_GRAD_REL_TOL`` of each gradient's largest
    entry; ties included (``test_ties``)."""
    q, k, v, kw = _inputs(case, seed=11 + case[2], dtype=torch.float32)
    weight = torch.randn(*q.shape[:3], v.shape[-1], generator=torch.Generator().manual_seed(3))
    got = _grads(lambda a, b, c: mita_attention(a, b, c, backend=backend, **kw), q, k, v,
                 weight)
    want = _grads(lambda a, b, c: _impl("tiled", a, b, c, kw), q.double(), k.double(),
                  v.double(), weight.double())
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
        err = float((a.double() - b).abs().max() / b.abs().max())
        assert err < F32_GRAD_REL_TOL, (name, err)


def test_ties():
    """Inputs on a half-integer grid: top-k and the route meet exact ties (broken by the
    lowest index on every path); float32 gradients still match the float64 reference."""
    g = torch.Generator().manual_seed(5)
    q, k, v = ((torch.randint(-3, 4, (1, 2, 24, 4), generator=g) / 2).float() for _ in range(3))
    kw = dict(num_landmarks=4, topk=5, route_topk=2, key_padding_mask=None, landmark_grid=None,
              shared_scale="paper")
    scores = S.landmark_scores(S.pool(q.double(), 4)[0], k.double())
    top = scores.topk(6, -1).values
    assert bool((top[..., 4] == top[..., 5]).any()), "no tie at the top-k boundary"
    want = _grads(lambda a, b, c: _reference(a, b, c, kw), q.double(), k.double(), v.double(),
                  torch.ones(1, 2, 24, 4, dtype=torch.float64))
    for impl in IMPLS:
        got = _grads(lambda a, b, c, i=impl: _impl(i, a, b, c, kw), q, k, v,
                     torch.ones(1, 2, 24, 4))
        for name, a, b in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
            assert float((a.double() - b).abs().max() / b.abs().max()) < F32_GRAD_REL_TOL, (
                impl, name)


def _cpu_grads(q, k, v, m, topk):
    return _grads(lambda a, b, c: mita_attention(a, b, c, num_landmarks=m, topk=topk,
                                                 backend="cpu"), q, k, v, torch.ones_like(q))


def test_cpu_backward_is_reproducible():
    """The CPU backward gives the same bits on every run and for any thread count: each work
    item (a head's run of tiles; here 8 per head, B·H = 2) sums into its own buffers, added in
    item order."""
    q, k, v = rand_qkv(1, 2, 3000, 16, seed=21, dtype=torch.float32)
    threads = torch.get_num_threads()  # make test's background runs on one
    try:
        torch.set_num_threads(2)
        first = _cpu_grads(q, k, v, 64, 64)
        again = _cpu_grads(q, k, v, 64, 64)
        torch.set_num_threads(1)
        one = _cpu_grads(q, k, v, 64, 64)
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(first, one, strict=True))


@pytest.mark.parametrize("impl", ["torch", "cpu"])
def test_joint_forward_is_the_inference_forward(impl):
    """Under autograd the joint operator's output is bit for bit what the inference path
    computes from the same landmarks, shared values and top-k: the PyTorch stages'
    ``attention`` (impl "torch") and the CPU kernels (impl "cpu")."""
    q, k, v = rand_qkv(2, 2, 500, 16, seed=31, dtype=torch.float32)
    mask = random_mask(2, 500, seed=32)
    m, topk = 8, 24
    landmarks, valid = S.pool(q, m, mask)
    expert_index = S.topk_tokens(S.landmark_scores(landmarks, k, mask), topk)
    shared = S.shared_compress(S.landmark_scores(landmarks, k, mask), v)
    out, lse, experts = joint.joint_attention(q, landmarks, shared, k, v, expert_index, valid,
                                              ~mask, 1, "paper", impl)
    if impl == "torch":
        keys, values, key_valid = S.gather(k, v, expert_index, mask)
        want = S.attention(q, landmarks, valid, shared, S.route(q, landmarks, 1, valid), keys,
                           values, key_valid, "paper", mask).masked_fill(
            mask[:, None, :, None], 0.0)
    else:
        ext = cpu.load()
        ex, want, top, total = ext.route_shared(q=q, landmarks=landmarks, landmark_valid=valid,
                                                shared_values=shared, c_shared=16 ** -0.5,
                                                token_valid=~mask)
        ext.routed_attention(q=q, k=k, v=v, expert_index=expert_index, landmark_valid=valid,
                             token_valid=~mask, experts=ex, scale=16 ** -0.5, acc=want, mx=top,
                             sum=total)
    assert torch.equal(out, want)
    assert torch.isinf(lse[mask[:, None, :].expand_as(lse)]).all()
    assert torch.isfinite(lse[~mask[:, None, :].expand_as(lse)]).all()


def test_forward_under_autograd_matches_inference():
    """The whole forward under autograd (``shared_compress`` as SDPA) equals the no-gradient
    path to float32 rounding (1e-6 of the largest output)."""
    q, k, v = rand_qkv(2, 2, 700, 16, seed=41, dtype=torch.float32)
    with torch.no_grad():
        want = mita_attention(q, k, v, num_landmarks=16, topk=32)
    got = mita_attention(q.requires_grad_(), k, v, num_landmarks=16, topk=32)
    assert float((got.detach() - want).abs().max() / want.abs().max()) < 1e-6


def _graph_nodes(out) -> int:
    seen, todo = set(), [out.grad_fn]
    while todo:
        fn = todo.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        todo.extend(f for f, _ in fn.next_functions)
    return len(seen)


def test_autograd_graph_does_not_grow_with_batch_heads_or_experts():
    """One MiTA layer's autograd graph has the same number of nodes at B·H·m = 4·16 as at
    16·128 experts (the per-expert loop under autograd built ~9,300 at N = 512), and few."""
    counts = []
    for B, m in ((1, 16), (4, 64)):
        layer = MiTAAttention(ModelConfig(num_landmarks=m, topk=16, num_heads=2))
        x = torch.randn(B, 512, 64, requires_grad=True)
        counts.append(_graph_nodes(layer(x)))
    assert counts[0] == counts[1] and counts[0] < 40, counts


def test_saved_tensors_hold_nothing_of_expert_size():
    """What one MiTA layer keeps for its backward: no tensor of B·H·m·k·d elements (the
    gathered expert keys) — here m·k·d = 16 × the sequence's N·d — and in all at most what
    dense attention keeps plus the output and O(N + m·d) per head."""
    B, N, dim, m, topk = 1, 256, 64, 32, 128
    saved = {}
    for name, layer in (("mita", MiTAAttention(ModelConfig(num_landmarks=m, topk=topk))),
                        ("dense", DenseAttention(ModelConfig()))):
        sizes = []

        def pack(t, sizes=sizes):
            sizes.append(t.numel() * t.element_size())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            layer(torch.randn(B, N, dim, requires_grad=True)).sum()
        saved[name] = sizes
    expert_bytes = B * 2 * m * topk * (dim // 2) * 4
    assert max(saved["mita"]) < expert_bytes / 8, saved["mita"]
    assert sum(saved["mita"]) < 2 * sum(saved["dense"]), (sum(saved["mita"]),
                                                          sum(saved["dense"]))


def test_operators_are_registered_for_compile_and_meta():
    """``torch.library.opcheck`` (schema, fake kernel, autograd registration, traced forward
    and backward) passes for each implementation, and the meta device gives the shapes."""
    q, k, v = rand_qkv(2, 2, 20, 8, seed=51)
    landmarks, valid = S.pool(q, 4)
    shared = torch.randn(2, 2, 4, 8, dtype=torch.float64)
    index = S.topk_tokens(S.landmark_scores(landmarks, k), 5)
    args = [t.requires_grad_() for t in (q, landmarks, shared, k, v)]
    for impl in IMPLS:
        torch.library.opcheck(torch.ops.mita.joint_attention.default,
                              (args[0], args[1], args[2], args[3], args[4], index, valid, None,
                               2, "paper", impl))
    meta = torch.empty(2, 2, 20, 8, device="meta")
    out, lse, experts = torch.ops.mita.joint_attention(
        meta, meta[:, :, :4], meta[:, :, :4], meta, meta,
        torch.empty(2, 2, 4, 5, dtype=torch.long, device="meta"),
        torch.empty(2, 4, dtype=torch.bool, device="meta"), None, 3, "paper", "cpu")
    assert (out.shape, lse.shape, experts.shape) == ((2, 2, 20, 8), (2, 2, 20), (2, 2, 20, 3))


def test_a_training_step_runs_the_operator():
    """The model's training step (what ``python -m mita.training`` runs: ``backend="auto"``)
    goes through ``mita::joint_attention`` and its backward in every MiTA layer, and the whole
    loss's autograd graph stays small (each MiTA layer once built thousands of nodes)."""
    from mita.model import EncoderClassifier

    torch.manual_seed(0)
    model = EncoderClassifier(ModelConfig(num_landmarks=8, topk=8, depth=2))
    ids = torch.randint(1, 16, (4, 300))
    loss = torch.nn.functional.cross_entropy(model(ids), torch.tensor([0, 1, 2, 3]))
    seen, todo, names = set(), [loss.grad_fn], []
    while todo:
        fn = todo.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        names.append(type(fn).__name__ if not hasattr(fn, "name") else fn.name())
        todo.extend(f for f, _ in fn.next_functions)
    assert sum("mita_joint_attention" in n for n in names) == 2, names
    assert len(names) < 150, len(names)
    loss.backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
