"""The Triton version floor (``mita.kernels.TRITON_FLOOR``, ``triton>=3.5`` in pyproject.toml):
``routing._landmark_topk_kernel`` calls ``tl.bitonic_merge``, which Triton 3.3 does not have.
Below it, backend "auto" takes the PyTorch stages with one warning and "triton" is refused.
Only the version string is patched: nothing is interpreted or compiled (fast tier)."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import pytest
import torch

from mita import attention as A
from mita import kernels

triton = pytest.importorskip("triton")


@pytest.fixture
def cuda_like(monkeypatch):
    """float32 q, k, v that ``_use_triton`` takes for CUDA tensors (``is_cuda`` patched), and a
    fresh once-per-process warning."""
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    A._warn_no_triton.cache_clear()
    yield torch.randn(1, 2, 8, 16)
    A._warn_no_triton.cache_clear()


@pytest.mark.parametrize("version,ok", [
    ("3.5.0", True), ("3.9.0", True), ("4.0.0", True), ("3.10.1+git1234", True), ("3.4.0", False),
    ("3.3.1", False), ("3.0.0", False), ("2.9.9", False), ("", False),
])
def test_triton_supported_compares_major_minor(monkeypatch, version, ok):
    monkeypatch.setattr(triton, "__version__", version)
    reason = kernels.triton_supported()
    if ok:
        assert reason is None
    else:
        assert "triton>=3.5" in reason and (version or "(no version)") in reason


def test_floor_matches_pyproject():
    text = (Path(__file__).resolve().parents[2] / "pyproject.toml").read_text()
    assert "\"triton>=3.5; platform_system == 'Linux'" in text
    assert kernels.TRITON_FLOOR == (3, 5)


def test_auto_falls_back_with_one_warning_below_the_floor(monkeypatch, cuda_like, caplog):
    q = cuda_like
    with torch.no_grad():
        assert A._use_triton("auto", q, q, q)  # the installed Triton (≥ 3.5) is taken
        monkeypatch.setattr(triton, "__version__", "3.3.1")
        with caplog.at_level(logging.WARNING, logger="mita.attention"):
            assert not A._use_triton("auto", q, q, q)
            assert not A._use_triton("auto", q, q, q)
    warned = [r.getMessage() for r in caplog.records if r.name == "mita.attention"]
    assert len(warned) == 1, warned
    assert "Triton 3.3.1" in warned[0] and "triton>=3.5" in warned[0]


def test_triton_backend_refuses_an_old_triton(monkeypatch):
    monkeypatch.setattr(triton, "__version__", "3.2.0")
    q = torch.randn(1, 1, 4, 8)
    with torch.no_grad(), pytest.raises(ValueError, match=r"Triton 3\.2\.0 .*triton>=3\.5"):
        A._use_triton("triton", q, q, q)
    with torch.no_grad(), pytest.raises(ValueError, match=r"Triton 3\.2\.0"):
        A.mita_attention(q, q, q, num_landmarks=2, topk=2, backend="triton")


def test_triton_supported_does_not_import_the_kernels(monkeypatch):
    for name in ("mita.kernels.triton_fused", "mita.kernels.routing"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    assert kernels.triton_supported() is None
    assert "mita.kernels.triton_fused" not in sys.modules
    assert "mita.kernels.routing" not in sys.modules


def test_auto_takes_the_pytorch_stages_past_the_grid_limit(cuda_like):
    """B·H = 65,536 is one over CUDA's 65,535 programs on a grid's second axis, where the
    kernels put B·H: "auto" does not pick the Triton path; 65,535 it does."""
    q = torch.randn(1, 65_536, 2, 16)
    assert not A._use_triton("auto", q, q, q)
    assert A._use_triton("auto", q[:, :65_535], q[:, :65_535], q[:, :65_535])
