"""The Triton launcher of ``mita_attention``: MiTA's stages on the Triton kernels of this
package (``routing``, ``mita_attention.fused_attention``), with the PyTorch stages of
``mita.attention`` where no kernel replaces them. ``mita.attention`` imports this module only
when it runs the Triton path (Triton reads ``TRITON_INTERPRET`` when a kernel is defined)."""

from __future__ import annotations

import os

from torch import Tensor

# Modules, not names: a reloaded kernel module (the interpreter tests) or a patched stage is
# what runs.
from .. import attention as A
from ..hooks import StageHook
from . import choose, routing
from . import mita_attention as fused


def mita_triton(q: Tensor, k: Tensor, v: Tensor, m: int, topk: int, s: int,
                key_padding_mask: Tensor | None, landmark_grid: tuple[int, int] | None,
                shared_scale: str, hook: StageHook) -> Tensor:
    """``mita_attention`` on the Triton kernels (``mita/kernels``), q, k, v in their own dtype
    (no float32 copies; matrix products in the input dtype with fp32 accumulation):
    ``pool`` (PyTorch, float32 landmarks); ``landmark_scores`` also does ``topk``
    (``choose.CHOOSER``: the fastest exact path for the shape — a threshold select,
    ``routing.landmark_topk``'s streaming pass with no m × N scores for k ≤ 512, or the
    PyTorch stages on float32 scores); ``shared_compress`` as one SDPA call
    (``shared_compress_sdpa``); ``route`` — for s = 1 ``routing.route_shared``, which also
    computes the shared half of the joint softmax, for s > 1 the PyTorch stage; ``attention``
    (``fused_attention``: gather fused, routed keys read by index). No host synchronisation.
    """
    if not q.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("backend='triton' needs CUDA tensors (or TRITON_INTERPRET=1 for the "
                         "CPU interpreter); use backend='torch' on CPU")
    routing._check(q, k)  # dtype and head dim, before a top-k path could take the blame
    d = q.shape[-1]
    c = A.shared_logit_scale(d, shared_scale)
    with hook.stage("pool"):
        landmarks, landmark_valid = A.pool(q, m, key_padding_mask, landmark_grid)
    with hook.stage("landmark_scores"):  # + topk
        # several exact paths: the fastest for the shape on this device (timed once)
        expert_index = choose.CHOOSER(landmarks, k, topk, d ** -0.5, key_padding_mask)
    with hook.stage("shared_compress"):
        shared_values = A.shared_compress_sdpa(landmarks, k, v, key_padding_mask)
    with hook.stage("route"):
        if s == 1:
            experts, *partial = routing.route_shared(q, landmarks, shared_values,
                                                     landmark_valid, c)
        else:
            experts, partial = A.route(q, landmarks, s, landmark_valid), None
    with hook.stage("attention"):  # gather is fused into this kernel
        return fused.fused_attention(q, k, v, landmarks * c, shared_values, landmark_valid,
                                     expert_index, experts, key_padding_mask,
                                     shared_partial=partial)
