"""The Triton backward of MiTA (``mita/kernels/triton_backward.py``) on CPU under
``TRITON_INTERPRET=1``: the kernels' own code, numerics checked here; their compiles for sm_80
and sm_90 in ``test_kernel_compile.py`` (the committed table).

Tolerances, and why:
- float32 against the float64 tiled backward (itself equal to the float64 per-query reference,
  ``test_backward.py``) on the same inputs: 5e-6 relative to each gradient's largest entry, as
  the CPU float32 paths — IEEE fp32 products (no TF32), fp32 sums of at most m + s·k entries
  per query and of a key's uses across experts; at most 7.3e-7 measured when this was
  written.
- bfloat16 / float16: 3e-2 / 4e-3 relative (8.2e-3 / 7.8e-4 measured, dk the worst). The
  kernels multiply in the input dtype, as the forward (``test_kernels.py``: 1.5e-2 / 2e-3
  for the output): P and dℓ are rounded to 16 bits before their products, and the gradients
  to the input dtype at the end; a backward has about twice the roundings of a forward.
- deterministic: two runs give the same bits; atomics (``triton_atomic``): equal to the
  deterministic result within float32 rounding (the order of the sums differs).
"""

from __future__ import annotations

import pytest
import torch

from mita import mita_attention
from mita.hooks import NULL_HOOK

from ..helpers import rand_qkv, random_mask, run_smoke_here, triton_interpreter

pytestmark = [pytest.mark.slow]  # the Triton interpreter


@pytest.fixture(scope="module")
def interpreted():
    with triton_interpreter() as module:
        yield module


def _grads(fn, q, k, v, weight):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = fn(q, k, v)
    return (out.detach(), *torch.autograd.grad((out * weight.to(out.dtype)).sum(), (q, k, v)))


def _joint(impl, kw):
    from mita import joint

    return lambda q, k, v: joint.mita_attention_grad(
        q, k, v, kw["num_landmarks"], kw["topk"], kw["route_topk"], kw["key_padding_mask"],
        kw.get("landmark_grid"), kw.get("shared_scale", "paper"), impl, NULL_HOOK)


def _rel(a, b):
    return float((a.double() - b).abs().max() / b.abs().max())


CASES = [  # B, H, N, d, m, k, s, mask
    (2, 2, 40, 16, 4, 6, 1, None),
    (2, 1, 50, 32, 5, 9, 2, "suffix"),
    (1, 2, 37, 16, 5, 40, 3, "scattered"),   # k clamped to N; padded keys picked and masked
    (1, 1, 9, 16, 12, 3, 2, None),            # N < m: empty landmarks
    (1, 1, 70, 64, 3, 33, 1, None),           # several key blocks per expert
]


@pytest.mark.parametrize("B,H,N,d,m,topk,s,mask", CASES)
def test_float32_gradients(interpreted, B, H, N, d, m, topk, s, mask):
    """``backend="triton"`` under autograd: forward and gradients against the float64 tiled
    backward on the same inputs, deterministic and atomic."""
    q, k, v = rand_qkv(B, H, N, d, seed=N + 7 * m, dtype=torch.float32)
    km = None if mask is None else random_mask(B, N, seed=N, suffix=mask == "suffix")
    kw = dict(num_landmarks=m, topk=min(topk, N), route_topk=s, key_padding_mask=km)
    weight = torch.randn(B, H, N, d, generator=torch.Generator().manual_seed(1))
    want = _grads(_joint("tiled", kw), q.double(), k.double(), v.double(), weight.double())
    got = _grads(lambda a, b, c: mita_attention(a, b, c, backend="triton", **kw), q, k, v,
                 weight)
    again = _grads(lambda a, b, c: mita_attention(a, b, c, backend="triton", **kw), q, k, v,
                   weight)
    atomic = _grads(_joint("triton_atomic", kw), q, k, v, weight)
    for name, a, b, c, w in zip(("out", "dq", "dk", "dv"), got, again, atomic, want,
                                strict=True):
        assert w.abs().max() > 1e-3, name
        assert _rel(a, w) < 5e-6, (name, _rel(a, w))
        assert torch.equal(a, b), name  # deterministic: the same bits
        assert _rel(c, w) < 5e-6, (name, _rel(c, w))


@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 3e-2), (torch.float16, 4e-3)])
def test_16_bit_gradients(interpreted, dtype, tol):
    """16-bit q, k, v: products in the input dtype, fp32 sums; against float64 on the same
    (16-bit-representable) inputs."""
    q, k, v = (t.to(dtype) for t in rand_qkv(2, 2, 48, 32, seed=5, dtype=torch.float32))
    km = random_mask(2, 48, seed=6)
    kw = dict(num_landmarks=4, topk=8, route_topk=1, key_padding_mask=km)
    weight = torch.randn(2, 2, 48, 32, generator=torch.Generator().manual_seed(2))
    want = _grads(_joint("tiled", kw), q.double(), k.double(), v.double(), weight.double())
    got = _grads(lambda a, b, c: mita_attention(a, b, c, backend="triton", **kw), q, k, v,
                 weight)
    for name, a, w in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
        assert a.dtype == dtype
        assert _rel(a, w) < tol, (name, _rel(a, w))


def test_gpu_training_script_dry_run(interpreted, tmp_path, monkeypatch):
    """``benchmarks/gpu_training.py --smoke``: the GPU command's training step (gradient checks,
    then the timed layer) on the CPU interpreter, so the prepared GPU run is not its first."""
    result = run_smoke_here("gpu_training", tmp_path, monkeypatch)
    assert [c.split()[0] for c in result["checks"][1:]] == ["PASS", "PASS"]
    assert len(result["rows"]) == 1 and result["rows"][0].startswith("| 128 | 4 | 4 |")
    assert "flash / MiTA" in (tmp_path / "gpu_training.md").read_text()


def test_shared_gradients_over_several_query_slices(interpreted, monkeypatch):
    """The shared branch's dk/dv kernel splits the queries into slices of ``SHARED_SLICE``
    (4,096) and adds the slices' sums afterwards; here slices of 16 queries, so a 50-query
    sequence takes 4 (the last partial), against the float64 tiled backward."""
    from mita.kernels import triton_backward

    monkeypatch.setattr(triton_backward, "SHARED_SLICE", 16)
    q, k, v = rand_qkv(1, 2, 50, 16, seed=77, dtype=torch.float32)
    kw = dict(num_landmarks=5, topk=6, route_topk=2, key_padding_mask=random_mask(1, 50, 78))
    weight = torch.randn(1, 2, 50, 16, generator=torch.Generator().manual_seed(3))
    want = _grads(_joint("tiled", kw), q.double(), k.double(), v.double(), weight.double())
    got = _grads(_joint("triton", kw), q, k, v, weight)
    for name, a, w in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
        assert _rel(a, w) < 5e-6, (name, _rel(a, w))
