"""MiTA (Mixture-of-Top-k Attention) and dense attention on ``(B, H, N, d)`` tensors: the public
``mita_attention`` (check the inputs once, then dispatch to a backend), its unchecking core
``mita_attention_unchecked`` (for ``mita.layers``, whose inputs were checked once per model or
forward) and ``dense_attention``.
The stages themselves are in ``mita.stages``; within ``mita`` this is the only module that
imports ``mita.kernels``' launchers.

Source: Wen et al., *Mixture-of-Top-k Attention: Efficient Attention via Scalable Fast Weights*,
arXiv:2602.01219 v6, §3.1 (dense, eqs. 1-4) and §3.2 (MiTA, eqs. 5-12).

MiTA is seven stages (``mita.stages``, named after the profiler's stages: ``pool``,
``landmark_scores``, ``topk``, ``shared_compress``, ``route``, ``gather``, ``attention``); every
backend runs them in order, each inside ``hook.stage(name)``.

Conventions: ``key_padding_mask`` is ``(B, N)`` bool with ``True`` marking padding (as in
``torch.nn.MultiheadAttention``); it masks keys and, since this is self-attention, queries.
Outputs at padded query positions are zero. float16/bfloat16 inputs are computed in float32
and the output cast back, except on the Triton path (input-dtype products, fp32 accumulation,
as flash attention).
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F
from torch import Tensor

from . import stages as S
from .config import check_backend, check_setting, clamp_topk
from .hooks import NULL_HOOK, StageHook, check_cancelled


def mita_attention(q: Tensor, k: Tensor, v: Tensor, *, num_landmarks: int, topk: int,
                   route_topk: int = 1, key_padding_mask: Tensor | None = None,
                   landmark_grid: tuple[int, int] | None = None, shared_scale: str = "paper",
                   backend: str = "auto", hook: StageHook = NULL_HOOK,
                   check_mask: bool = True) -> Tensor:
    """MiTA attention, eqs. 5-12 of arXiv:2602.01219 (§3.2), exactly. The checking entry point:
    the shapes, the setting (``check_setting``) and the backend (``check_backend``) are
    checked on every call, then ``mita_attention_unchecked`` (the unchecking core the model's layers
    call, having checked them once) computes.

    Args:
        q, k: ``(B, H, N, d)``; v: ``(B, H, N, dv)``; float16/bfloat16/float32/float64.
        num_landmarks: m ≥ 1 landmarks = routed experts. N < m is allowed: landmarks whose
            segment holds no valid token are empty and excluded (see ``pool``).
        topk: k ≥ 1 raw key/value pairs per routed expert; **clamped to N** when k > N (rows
            with fewer valid keys than k mask the padded picks).
        route_topk: s, experts per query, 1 ≤ s ≤ m. If a row has fewer non-empty landmarks
            than s, the extra picks are masked.
        key_padding_mask: optional ``(B, N)`` bool, True = padding. Padded keys are never
            weighted (shared or routed); padded queries are left out of landmark pooling and
            their outputs are zero.
        landmark_grid: None for 1-D contiguous pooling, ``(H, W)`` with H·W ≤ N for 2-D
            pooling of the first H·W tokens (``stages.pool``).
        shared_scale: ``"paper"`` (shared logit q·q̃/√d) or ``"official"`` (q·q̃/d, as the
            authors' code).
        backend: ``"torch"`` (the expert-grouped PyTorch stages, every stage timed apart — the
            reference path), ``"cpu"`` (the compiled, cache-blocked CPU kernels of
            ``mita.kernels.cpu``: ``landmark_scores`` includes ``topk`` and ``shared_compress``; for
            s = 1 ``route`` includes the shared half of the joint softmax),
            ``"triton"`` (the Triton kernels, ``kernels.triton_mita.mita_triton``:
            ``landmark_scores`` includes ``topk``, ``route`` the shared half for s = 1,
            ``attention`` the gather; head dims ≤ 128), or ``"auto"``: triton for CUDA
            float16/bfloat16/float32 inputs with head dims ≤ 128 when Triton ≥ 3.5 imports
            (older: the PyTorch stages, one warning); on CPU the compiled kernels when they
            build here (else the PyTorch stages, logged once). The triton path computes in
            q, k, v's own dtype (16-bit matrix products, fp32 accumulation; landmarks averaged
            in float32, rounded to the input dtype for the products); the other paths compute
            16-bit inputs in float32. **With autograd** (q, k or v needing gradients) every
            backend runs ``mita.joint.mita_attention_grad``: the same forward (stages
            ``route``, ``gather`` and ``attention`` as one operator, reported as
            ``attention``; ``shared_compress`` as SDPA) and a real backward — the CPU kernels'
            (``"cpu"``, ``"auto"`` on CPU), the Triton kernels' (``"triton"``, ``"auto"`` on
            CUDA), or tiled PyTorch (``"torch"``, and where those cannot run).
        hook: stage hook; each stage runs inside ``hook.stage(name)``.
        check_mask: False when the caller has already run ``stages.check_padding_mask`` on
            this mask (``EncoderClassifier.forward``: once per forward, not once per layer).
    Returns:
        ``(B, H, N, dv)`` in the input dtype.
    Raises:
        ValueError: shape mismatch, m/k/s < 1, s > m, unknown ``shared_scale``, bad grid,
            a bad mask or an all-padding row, an unknown ``backend``, ``"cpu"`` for CUDA
            tensors or where the kernels do not build, or ``"triton"`` for CPU tensors
            (unless ``TRITON_INTERPRET=1``), float64, or without Triton ≥ 3.5
            (``kernels.triton_supported``).
    """
    if q.dim() != 4 or k.shape != q.shape or v.dim() != 4 or v.shape[:3] != q.shape[:3]:
        raise ValueError(f"expected q, k (B, H, N, d) and v (B, H, N, dv) with equal B, H, N; "
                         f"got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if q.shape[2] == 0:  # before the setting, as always (mita_attention_unchecked checks it again)
        raise ValueError("sequence length N must be ≥ 1")
    check_setting(num_landmarks, topk, route_topk, shared_scale)
    check_backend(backend)
    return mita_attention_unchecked(q, k, v, num_landmarks=num_landmarks, topk=topk,
                           route_topk=route_topk, key_padding_mask=key_padding_mask,
                           landmark_grid=landmark_grid, shared_scale=shared_scale,
                           backend=backend, hook=hook, check_mask=check_mask)


def mita_attention_unchecked(q: Tensor, k: Tensor, v: Tensor, *, num_landmarks: int, topk: int,
                    route_topk: int, key_padding_mask: Tensor | None,
                    landmark_grid: tuple[int, int] | None, shared_scale: str, backend: str,
                    hook: StageHook, check_mask: bool) -> Tensor:
    """``mita_attention`` without its checks of the q/k/v shapes, the setting
    (``check_setting``) and the backend (``check_backend``): for callers that checked them
    once already (``layers.MiTAAttention``: q, k, v from its own projection, the setting from
    ``ModelConfig``, the backend where it is set), so that no layer of a forward checks them
    again. Same arguments, results (bit for bit) and remaining errors as ``mita_attention``:
    N = 0, the mask (when ``check_mask``), the grid and the backend's own conditions
    (``"cpu"``/``"triton"`` where they cannot run) are still refused with ValueError. Wrong
    shapes or settings here are not diagnosed (the error, if any, comes from deeper down)."""
    B, H, N, _ = q.shape
    # Kept here too: the model does not check N once per forward, and this is the error a
    # (B, 0) input to it has always raised.
    if N == 0:
        raise ValueError("sequence length N must be ≥ 1")
    if check_mask:
        S.check_padding_mask(key_padding_mask, B, N)
    out_dtype = q.dtype
    topk = clamp_topk(topk, N)
    impl = _grad_impl(backend, q, k, v)
    if impl is not None:
        from .joint import mita_attention_grad

        if impl not in ("triton", "triton_atomic") and q.dtype in (torch.float16,
                                                                   torch.bfloat16):
            q, k, v = q.float(), k.float(), v.float()
        out = mita_attention_grad(q, k, v, num_landmarks, topk, route_topk, key_padding_mask,
                                  landmark_grid, shared_scale, impl, hook)
        return out.to(out_dtype)
    if _use_triton(backend, q, v, k):
        from .kernels.triton_mita import mita_triton

        return mita_triton(q, k, v, num_landmarks, topk, route_topk, key_padding_mask,
                           landmark_grid, shared_scale, hook)
    if q.dtype in (torch.float16, torch.bfloat16):
        q, k, v = q.float(), k.float(), v.float()
    ext = _cpu_kernels(backend, q, k, v)
    if ext is not None:
        from .kernels.cpu import mita_cpu

        out = mita_cpu(ext, q, k, v, num_landmarks, topk, route_topk, key_padding_mask,
                       landmark_grid, shared_scale, hook)
        return out.to(out_dtype)
    landmarks, landmark_valid, expert_index, shared_values, experts = S.routing_stages(
        q, k, v, num_landmarks, topk, route_topk, key_padding_mask, landmark_grid, hook)
    out = S.gather_and_attend(q, k, v, landmarks, landmark_valid, shared_values, expert_index,
                             experts, shared_scale, key_padding_mask, hook)
    return out.to(out_dtype)


def _needs_grad(*tensors: Tensor | None) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


# Under autograd, backend "triton" and "auto" on CUDA run the Triton backward with fp32
# atomics instead of its deterministic per-key sums when this is True (faster where many
# experts share keys; not reproducible bit for bit).
ATOMIC_TRITON_BACKWARD = False


def _grad_impl(backend: str, q: Tensor, k: Tensor, v: Tensor) -> str | None:
    """Under autograd, which implementation of ``joint.joint_attention`` runs: ``"torch"`` for
    backend ``"torch"``; ``"cpu"`` (the compiled kernels' forward and backward) for ``"cpu"``
    and for ``"auto"`` on CPU where they build (else ``"tiled"``); ``"triton"`` (or
    ``"triton_atomic"``, ``ATOMIC_TRITON_BACKWARD``) for ``"triton"`` and for ``"auto"`` where
    the Triton kernels would run the forward, else ``"tiled"`` on CUDA. None without autograd
    (the inference paths). Raises ValueError for ``"cpu"`` on CUDA tensors or where the kernels
    do not build, and for ``"triton"`` where the Triton kernels cannot run."""
    if not _needs_grad(q, k, v):
        return None
    if backend == "torch":
        return "torch"
    triton_impl = "triton_atomic" if ATOMIC_TRITON_BACKWARD else "triton"
    if backend == "triton" or (backend == "auto" and q.is_cuda):
        with torch.no_grad():  # whether the forward kernels take these inputs
            runs = _use_triton(backend, q, v, k)
        if runs:
            return triton_impl
    if q.is_cuda:
        if backend == "cpu":
            raise ValueError("backend='cpu' needs CPU tensors")
        return "tiled"
    from .kernels.cpu import load
    if load() is not None:
        return "cpu"
    if backend == "cpu":
        raise ValueError("backend='cpu': the CPU kernels could not be built here (see the log)")
    return "tiled"


def _cpu_kernels(backend: str, q: Tensor, k: Tensor, v: Tensor):
    """The compiled CPU kernels when ``backend`` asks for them (``"cpu"``, or ``"auto"`` on CPU
    without autograd), else None. Raises ValueError when ``"cpu"`` cannot run."""
    if backend == "torch" or q.is_cuda:
        if backend == "cpu":
            raise ValueError("backend='cpu' needs CPU tensors")
        return None
    from .kernels.cpu import load
    ext = load()
    if ext is None and backend == "cpu":
        raise ValueError("backend='cpu': the CPU kernels could not be built here (see the log)")
    return ext


def _use_triton(backend: str, q: Tensor, v: Tensor, k: Tensor | None = None) -> bool:
    """Whether ``mita_attention``'s inference path runs the Triton kernels (under autograd
    ``_grad_impl`` asks it, with gradients off, whether the forward kernels take the inputs).
    Without a Triton the kernels can run on (``kernels.triton_supported``: not installed, or
    older than ``kernels.TRITON_FLOOR``) ``"auto"`` takes the PyTorch stages and logs one
    warning per process; ``"triton"`` raises ValueError naming the installed version and the
    floor."""
    if backend in ("torch", "cpu"):
        return False
    needs_grad = _needs_grad(q, k, v)
    from .kernels import MAX_GRID_Y, MAX_HEAD_DIM, triton_supported  # no kernel import

    if backend == "triton":
        reason = triton_supported()
        if reason is not None:
            raise ValueError(f"backend='triton': {reason}")
        return True
    if needs_grad:
        return False
    if not q.is_cuda or q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return False
    if max(q.shape[-1], v.shape[-1]) > MAX_HEAD_DIM:
        return False
    if q.shape[0] * q.shape[1] > MAX_GRID_Y:  # the kernels' grids put B·H on CUDA's y axis
        return False
    reason = triton_supported()
    if reason is not None:
        _warn_no_triton(reason)
        return False
    return True


@functools.cache
def _warn_no_triton(reason: str) -> None:
    """One warning per process (per reason) that ``"auto"`` takes the PyTorch stages on CUDA."""
    logging.getLogger(__name__).warning("mita_attention backend='auto' runs the PyTorch "
                                        "stages on CUDA: %s", reason)


# Query rows × keys of one dense SDPA call on the CPU above which it runs in query chunks:
# each row's softmax is its own (bit-identical results), and between chunks
# hooks.check_cancelled can stop a forward whose callers left. 2^28: chunks of 1,024 rows at
# N = 262,144, about a second each on 2 cores; none at N ≤ 16,384.
DENSE_CHUNK_ELEMENTS = 1 << 28


def dense_attention(q: Tensor, k: Tensor, v: Tensor,
                    key_padding_mask: Tensor | None = None, check_mask: bool = True) -> Tensor:
    """Dense softmax attention (§3.1, eqs. 1-4) via ``F.scaled_dot_product_attention``; on the
    CPU above ``DENSE_CHUNK_ELEMENTS`` in query chunks, between which
    ``hooks.check_cancelled`` is asked.

    Args: ``q``, ``k`` ``(B, H, N, d)``; ``v`` ``(B, H, N, dv)``; optional ``(B, N)`` bool
    mask, True = padding; ``check_mask`` as in ``mita_attention``. Returns ``(B, H, N, dv)``;
    zero at padded query positions.
    Raises: ValueError on an all-padding row or a bad mask; ``hooks.Cancelled`` (chunked
    only) when the forward's callers have gone.
    """
    B, _, N, _ = q.shape
    if key_padding_mask is not None and check_mask:
        S.check_padding_mask(key_padding_mask, B, N)
    valid = None if key_padding_mask is None else ~key_padding_mask
    mask = None if valid is None else valid[:, None, None, :]
    rows = max(1, DENSE_CHUNK_ELEMENTS // k.shape[2])
    if q.is_cuda or rows >= N:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    else:
        chunks = []
        for start in range(0, N, rows):
            check_cancelled()
            chunks.append(F.scaled_dot_product_attention(q[:, :, start:start + rows], k, v,
                                                         attn_mask=mask))
        out = torch.cat(chunks, 2)
    return out if valid is None else out.masked_fill(~valid[:, None, :, None], 0.0)
