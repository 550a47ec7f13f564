"""The Triton launcher of ``mita_attention``: MiTA's stages on the Triton kernels of this
package (``pooling``, ``routing``, ``triton_fused.fused_attention``), with the PyTorch stages of
``mita.stages`` where no kernel replaces them. ``mita.attention`` imports this module only
when it runs the Triton path (Triton reads ``TRITON_INTERPRET`` when a kernel is defined)."""

from __future__ import annotations

import os

from torch import Tensor

# Modules, not names: a reloaded kernel module (the interpreter tests) or a patched stage is
# what runs.
from .. import stages as S
from ..hooks import StageHook
from . import choose, pooling, routing, triton_common
from . import triton_fused as fused


def mita_triton(q: Tensor, k: Tensor, v: Tensor, m: int, topk: int, s: int,
                key_padding_mask: Tensor | None, landmark_grid: tuple[int, int] | None,
                shared_scale: str, hook: StageHook) -> Tensor:
    """``mita_attention`` on the Triton kernels (``mita/kernels``), q, k, v in their own dtype
    (no float32 copies; matrix products in the input dtype with fp32 accumulation):
    ``pool`` (``pooling.pool_landmarks``: the landmarks in float32 and in the input dtype, and
    the key-padding mask as the kernels' int8 vector and SDPA's additive bias, in one launch
    plus a ``cumsum`` with a mask; 2-D grids: ``mita.stages.pool``); ``landmark_scores``
    also does ``topk`` (``choose.CHOOSER``: the fastest exact path for the shape — the
    threshold select ``topk.threshold_topk``, the bitonic ``routing.landmark_topk`` (k ≤ 512),
    or float32 scores + ``torch.topk``; none of the Triton ones stores the m × N scores);
    ``shared_compress`` as one SDPA
    call (``shared_compress_sdpa``); ``route`` — for s = 1 ``routing.route_shared``, which
    also computes the shared half of the joint softmax, for s > 1 the PyTorch stage;
    ``attention`` (``fused_attention``: tile table, then the gather fused into the attention
    kernel). Every kernel reads the one rounding of the landmarks to the input dtype. No host
    synchronisation. ``tests/kernels/test_launches.py`` counts the launches per stage.
    """
    if not q.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("backend='triton' needs CUDA tensors (or TRITON_INTERPRET=1 for the "
                         "CPU interpreter); use backend='torch' on CPU")
    triton_common.check_inputs(q, k)  # dtype and head dim, before a top-k path could take the blame
    B, H, N, d = q.shape
    triton_common.check_grid(B * H)
    c = S.shared_logit_scale(d, shared_scale)
    with hook.stage("pool"):
        if landmark_grid is None:
            landmarks, lm, landmark_valid, key_valid, key_bias = pooling.pool_landmarks(
                q, m, key_padding_mask)
        else:
            landmarks, landmark_valid = S.pool(q, m, key_padding_mask, landmark_grid)
            lm = landmarks.to(q.dtype)
            key_valid, key_bias = pooling.key_vectors(key_padding_mask, B, N, q.dtype,
                                                      q.device)
    with hook.stage("landmark_scores"):  # + topk
        # several exact paths: the fastest for the shape on this device (timed once)
        expert_index = choose.CHOOSER(lm, k, topk, d ** -0.5, key_padding_mask,
                                      key_valid=key_valid)
    with hook.stage("shared_compress"):
        shared_values = S.shared_compress_sdpa(lm, k, v, key_bias)
    with hook.stage("route"):
        if s == 1:
            experts, *partial = routing.route_shared(q, lm, shared_values, landmark_valid, c)
        else:
            experts, partial = S.route(q, landmarks, s, landmark_valid), None
    with hook.stage("attention"):  # tile table, then the gather fused into the kernel
        # s = 1 reads no shared keys (route_shared computed the shared half); s > 1 reads
        # the landmarks scaled by c, rounded once to the input dtype
        return fused.fused_attention(q, k, v, None if s == 1 else landmarks * c,
                                     shared_values, landmark_valid, expert_index, experts,
                                     key_padding_mask, shared_partial=partial,
                                     key_valid=key_valid)
