"""MiTA under autograd: stages ``route``, ``gather`` and ``attention`` (eqs. 9-12) as one
differentiable operator, ``torch.ops.mita.joint_attention``, with a real backward, and
``mita_attention_grad``, the whole of eqs. 5-12 with gradients to q, k and v.

Source: Wen et al., *Mixture-of-Top-k Attention*, arXiv:2602.01219 v6, §3.2 (eqs. 5-12).

Which quantities carry gradients, as eqs. 5-12 define them (and as the authors' code):
the routed logits q·k_j/√d (into q and the chosen keys), the shared logits q·q̃_i·c (into q
and the landmarks q̃, hence back into q through the pooling of eq. 5), the values of both
branches (into v and into the shared values ṽ, hence through the shared compression's
softmax over all N keys of eq. 8 into q̃, k and v). Top-k (eq. 7) and the route (eq. 9) are
index selections: no gradient, as in the paper.

The backward is the flash-attention one: the forward keeps only the output and each query's
log-sum-exp ``lse`` over its m + s·k joint logits; the backward recomputes the probabilities
P = exp(ℓ − lse) and, with D = rowsum(dO ∘ O), dℓ = P ∘ (dO·Vᵀ − D). It runs as batched
tensor operations on **tiles**: each head's (query, expert) pairs are sorted by expert and cut
into tiles of ``TILE`` pairs of one expert, so every tile multiplies against one expert's k
keys; the shared branch is one (N × m) product per head. A layer's autograd graph thus has a
fixed number of nodes whatever B, H, m and N are (the per-expert loop of ``stages.attention``
under autograd built ~9,300 nodes per layer at N = 512). Key and value gradients are
accumulated with ``index_add_`` over the tiles' key rows: on the CPU one thread per output
slice, in a fixed order, so two runs give the same bits; on CUDA under
``torch.use_deterministic_algorithms(True)`` too (sorted accumulation), otherwise atomics.

Saved for the backward: q, k, v (the caller holds them), the landmarks and shared values
(m rows per head), the output, ``lse`` (one number per query) and the int64 indices (top-k,
route). Nothing of size B·H·m·k·d: the tiles' keys are gathered again in the backward.

Forward implementations (``impl``): ``"torch"`` — ``stages.route``, ``gather`` and
``attention`` themselves (their output bit for bit: the PyTorch stages' forward does not
change under autograd); ``"cpu"`` — the compiled CPU kernels for s = 1 (``kernels.cpu``, the
output of the inference path bit for bit), the PyTorch stages for s > 1; ``"tiled"`` — the
tiles above (CUDA tensors the Triton kernels cannot take, where the per-expert loop would
launch B·H·m small kernels); ``"triton"`` / ``"triton_atomic"`` — the fused Triton kernels,
which write ``lse`` too. Backward: the CPU kernel ``joint_backward`` for ``"cpu"`` with s = 1
(one work item per run of whole experts, summed in a fixed order: the same bits on every run);
``kernels/triton_backward.py`` for the Triton ones (deterministic per-key sums, or fp32
atomics); the tiled PyTorch backward otherwise.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import stages as S
from .hooks import StageHook

TILE = 64  # (query, expert) pairs per tile: one expert's keys serve TILE queries per product
# The stages ``mita_attention_grad`` reports (``hooks.MITA_STAGES`` less route and gather,
# which run inside ``joint_attention``, reported as ``attention``).
GRAD_STAGES = ("pool", "landmark_scores", "topk", "shared_compress", "attention")
# The Triton implementations: forward on the fused kernels, backward on
# kernels/triton_backward.py — "triton" deterministic (per-expert rows summed per key in a fixed
# order), "triton_atomic" with fp32 atomics (not reproducible bit for bit).
TRITON_IMPLS = ("triton", "triton_atomic")


def expert_tiles(experts: Tensor, query_valid: Tensor | None, num_landmarks: int,
                 tile: int = TILE) -> tuple[Tensor, Tensor, Tensor]:
    """Cut each head's (query, expert) pairs into tiles of at most ``tile`` pairs of one
    expert (pairs in query order within an expert).

    Args: ``experts`` ``(B, H, N, s)`` int64 from ``stages.route``; ``query_valid`` ``(B, N)``
    bool (None: all valid; padded queries are left out); ``num_landmarks`` m.
    Returns: ``pairs`` ``(T, tile)`` int64 — the flat pair index ``(b·H + h)·N·s + n·s + j``
    of each slot (0 in empty slots), ``slot_ok`` ``(T, tile)`` bool (False for empty slots),
    ``group`` ``(T,)`` int64 — the tile's flat expert ``(b·H + h)·m + e``. T ≤ B·H·(N·s/tile
    + m).
    """
    B, H, N, s = experts.shape
    m, dev = num_landmarks, experts.device
    groups = B * H * m
    group = (torch.arange(B * H, device=dev).view(B, H, 1, 1) * m + experts).reshape(-1)
    if query_valid is not None:  # padded queries: a dummy group past the last
        keep = query_valid[:, None, :, None].expand(B, H, N, s).reshape(-1)
        group = group.masked_fill(~keep, groups)
    order = torch.argsort(group, stable=True)
    counts = torch.bincount(group, minlength=groups + 1)[:groups]
    per_group = torch.div(counts + tile - 1, tile, rounding_mode="floor")
    tile_group = torch.repeat_interleave(torch.arange(groups, device=dev), per_group)
    rank = (torch.arange(tile_group.numel(), device=dev)
            - (per_group.cumsum(0) - per_group)[tile_group])
    start = (counts.cumsum(0) - counts)[tile_group] + rank * tile
    length = torch.clamp(counts[tile_group] - rank * tile, max=tile)
    offset = torch.arange(tile, device=dev)
    slot_ok = offset < length[:, None]
    pairs = torch.where(slot_ok, order[torch.where(slot_ok, start[:, None] + offset, 0)], 0)
    return pairs, slot_ok, tile_group


def _layout(q, expert_index, experts, landmark_valid, query_valid):
    """What the tiled forward and backward both need: per tile its queries' flat rows
    ``(T, tile)``, slot mask, its keys' flat rows ``(T, k)`` and key mask ``(T, k)``, and the
    tiles' flat pair indices."""
    B, H, N, _ = q.shape
    m, topk = expert_index.shape[2], expert_index.shape[3]
    s = experts.shape[-1]
    pairs, slot_ok, group = expert_tiles(experts, query_valid, m)
    rows = torch.div(pairs, s, rounding_mode="floor")  # flat (b·H + h)·N + n
    bh = torch.arange(B * H, device=q.device).view(B * H, 1, 1)
    key_rows = (expert_index.reshape(B * H, m, topk) + bh * N).reshape(B * H * m, topk)[group]
    ok = landmark_valid[:, None, :, None].expand(B, H, m, topk)
    if query_valid is not None:  # a padded key that top-k had to take: masked
        ok = ok & query_valid[:, None, :].expand(B, H, N).gather(
            2, expert_index.reshape(B, H, m * topk)).view(B, H, m, topk)
    key_ok = ok.reshape(B * H * m, topk)[group]
    return rows, slot_ok, key_rows, key_ok, pairs


def _shared_logits(q: Tensor, shared_keys: Tensor, landmark_valid: Tensor) -> Tensor:
    """``(B, H, N, m)`` shared logits q·(c·q̃) (eq. 11), −inf at empty landmarks."""
    return (q @ shared_keys.transpose(-1, -2)).masked_fill(
        ~landmark_valid[:, None, None, :], float("-inf"))


def _routed_logits(qf, kf, rows, key_rows, key_ok, scale):
    """``(T, tile, k)`` routed logits q·k_j/√d of every tile (eq. 11), −inf at masked keys."""
    logits = (qf[rows] @ kf[key_rows].transpose(-1, -2)) * scale
    return logits.masked_fill(~key_ok[:, None, :], float("-inf"))


def tiled_forward(q, landmarks, shared_values, k, v, expert_index, experts, landmark_valid,
                  query_valid, c_shared) -> tuple[Tensor, Tensor]:
    """The joint softmax of eqs. 11-12 on tiles (the ``"tiled"`` implementation): shapes as
    ``joint_attention``. Returns ``out`` ``(B, H, N, dv)`` (zero at padded queries) and
    ``lse`` ``(B, H, N)`` (+inf at padded queries)."""
    B, H, N, d = q.shape
    s, dv = experts.shape[-1], v.shape[-1]
    rows, slot_ok, key_rows, key_ok, pairs = _layout(q, expert_index, experts, landmark_valid,
                                                     query_valid)
    qf, kf, vf = q.reshape(-1, d), k.reshape(-1, d), v.reshape(-1, dv)
    shared = _shared_logits(q, landmarks * c_shared, landmark_valid)
    routed = _routed_logits(qf, kf, rows, key_rows, key_ok, d ** -0.5)
    pair_lse = q.new_full((B * H * N * s,), float("-inf"))
    pair_lse[pairs[slot_ok]] = torch.logsumexp(routed, -1)[slot_ok]
    lse = torch.cat([torch.logsumexp(shared, -1, keepdim=True), pair_lse.view(B, H, N, s)],
                    -1).logsumexp(-1)
    if query_valid is not None:
        lse = lse.masked_fill(~query_valid[:, None, :], float("inf"))
    out = torch.exp(shared - lse[..., None]) @ shared_values
    slot_lse = lse.reshape(-1)[rows].masked_fill(~slot_ok, float("inf"))
    routed_out = torch.exp(routed - slot_lse[..., None]) @ vf[key_rows]
    out = out.reshape(-1, dv).index_add(0, rows.reshape(-1), routed_out.reshape(-1, dv))
    return out.view(B, H, N, dv), lse


def tiled_backward(grad_out, q, landmarks, shared_values, k, v, out, lse, expert_index,
                   experts, landmark_valid, query_valid, c_shared):
    """The backward of eqs. 11-12 (every implementation's): recompute P = exp(ℓ − lse), then
    dℓ = P ∘ (dO·Vᵀ − D), D = rowsum(dO ∘ O); the shared branch as (N × m) products per
    head, the routed branch on tiles. Returns dq, d(landmarks), d(shared values), dk, dv in
    the inputs' shapes."""
    B, H, N, d = q.shape
    dv_dim = v.shape[-1]
    rows, slot_ok, key_rows, key_ok, _ = _layout(q, expert_index, experts, landmark_valid,
                                                 query_valid)
    scale = d ** -0.5
    shared_keys = landmarks * c_shared
    delta = (grad_out * out).sum(-1)  # D: 0 at padded queries (their output is 0)
    # Shared branch: logits q·(c·q̃), values ṽ.
    p = torch.exp(_shared_logits(q, shared_keys, landmark_valid) - lse[..., None])
    ds = p * (grad_out @ shared_values.transpose(-1, -2) - delta[..., None])
    dq = ds @ shared_keys
    d_landmarks = (ds.transpose(-1, -2) @ q) * c_shared
    d_shared_values = p.transpose(-1, -2) @ grad_out
    del p, ds
    # Routed branch, tile by tile (empty slots have lse = +inf: P = 0, no contribution).
    qf, kf, vf = q.reshape(-1, d), k.reshape(-1, d), v.reshape(-1, dv_dim)
    slot_lse = lse.reshape(-1)[rows].masked_fill(~slot_ok, float("inf"))
    p = torch.exp(_routed_logits(qf, kf, rows, key_rows, key_ok, scale) - slot_lse[..., None])
    g = grad_out.reshape(-1, dv_dim)[rows]
    vt = vf[key_rows]
    ds = p * (g @ vt.transpose(-1, -2) - delta.reshape(-1)[rows][..., None])
    flat_rows, flat_keys = rows.reshape(-1), key_rows.reshape(-1)
    kt = kf[key_rows]
    dq = dq.reshape(-1, d).index_add(0, flat_rows, (ds @ kt).reshape(-1, d), alpha=scale)
    del kt
    dk = torch.zeros_like(kf).index_add_(
        0, flat_keys, (ds.transpose(-1, -2) @ qf[rows]).reshape(-1, d), alpha=scale)
    dv = torch.zeros_like(vf).index_add_(
        0, flat_keys, (p.transpose(-1, -2) @ g).reshape(-1, dv_dim))
    return (dq.view_as(q), d_landmarks, d_shared_values, dk.view_as(k), dv.view_as(v))


@torch.library.custom_op("mita::joint_attention", mutates_args=())
def joint_attention(q: Tensor, landmarks: Tensor, shared_values: Tensor, k: Tensor, v: Tensor,
                    expert_index: Tensor, landmark_valid: Tensor, query_valid: Tensor | None,
                    route_topk: int, shared_scale: str, impl: str
                    ) -> tuple[Tensor, Tensor, Tensor]:
    """Stages ``route``, ``gather`` and ``attention`` (eqs. 9-12) as one operator with a
    backward (``torch.ops.mita.joint_attention``; a fake kernel gives ``torch.compile`` and
    the meta device its shapes).

    Args: ``q``, ``k`` ``(B, H, N, d)``, ``v`` ``(B, H, N, dv)``, float32/float64 (16-bit
    for the Triton implementations), on one device; ``landmarks`` ``(B, H, m, d)`` and
    ``landmark_valid`` ``(B, m)`` bool from ``stages.pool``; ``shared_values``
    ``(B, H, m, dv)`` (eq. 8); ``expert_index`` ``(B, H, m, k)`` int64 from
    ``stages.topk_tokens``; ``query_valid`` ``(B, N)`` bool, True = real token, or None;
    ``route_topk`` s; ``shared_scale`` ``"paper"`` or ``"official"``; ``impl`` ``"torch"``,
    ``"cpu"``, ``"tiled"``, ``"triton"`` or ``"triton_atomic"`` (module docstring).
    Returns: ``out`` ``(B, H, N, dv)`` (zero at padded queries), ``lse`` ``(B, H, N)`` (the
    joint logits' log-sum-exp, float32 for 16-bit q; +inf at padded queries) and ``experts``
    ``(B, H, N, s)``
    int64 (eq. 9). Gradients flow to q, landmarks, shared_values, k and v.
    """
    B, H, N, d = q.shape
    c = S.shared_logit_scale(d, shared_scale)
    mask = None if query_valid is None else ~query_valid
    if impl in TRITON_IMPLS:
        return _triton_forward(q, landmarks, shared_values, k, v, expert_index, landmark_valid,
                               mask, route_topk, c)
    if impl == "cpu" and route_topk == 1:
        from .kernels.cpu import load

        ext = load()
        lse = q.new_full((B, H, N), float("inf"))
        experts, out, top, total = ext.route_shared(
            q=q, landmarks=landmarks, landmark_valid=landmark_valid,
            shared_values=shared_values, c_shared=c, token_valid=query_valid)
        ext.routed_attention(q=q, k=k, v=v, expert_index=expert_index,
                             landmark_valid=landmark_valid, token_valid=query_valid,
                             experts=experts, scale=d ** -0.5, acc=out, mx=top, sum=total,
                             lse=lse)
        return out, lse, experts[..., None]
    experts = S.route(q, landmarks, route_topk, landmark_valid)
    if impl == "tiled":
        out, lse = tiled_forward(q, landmarks, shared_values, k, v, expert_index, experts,
                                 landmark_valid, query_valid, c)
        return out, lse, experts
    lse = q.new_full((B, H, N), float("inf"))
    keys, values, key_valid = S.gather(k, v, expert_index, mask)
    out = S.attention(q, landmarks, landmark_valid, shared_values, experts, keys, values,
                      key_valid, shared_scale, mask, lse=lse)
    if mask is not None:
        out = out.masked_fill(mask[:, None, :, None], 0.0)
        lse = lse.masked_fill(mask[:, None, :], float("inf"))
    return out, lse, experts


def _triton_forward(q, landmarks, shared_values, k, v, expert_index, landmark_valid, mask,
                    route_topk, c):
    """``joint_attention``'s forward on the Triton kernels (``triton_mita``'s route and fused
    attention, which also write ``lse``), q, k, v in their own dtype."""
    from .kernels import routing, triton_fused

    B, H, N, _ = q.shape
    lse = torch.full((B, H, N), float("inf"), dtype=torch.float32, device=q.device)
    if route_topk == 1:
        experts, *partial = routing.route_shared(q, landmarks.to(q.dtype), shared_values,
                                                 landmark_valid, c)
        out = triton_fused.fused_attention(q, k, v, None, shared_values, landmark_valid,
                                           expert_index, experts, mask, shared_partial=partial,
                                           lse=lse)
    else:
        experts = S.route(q, landmarks, route_topk, landmark_valid)
        out = triton_fused.fused_attention(q, k, v, landmarks * c, shared_values,
                                           landmark_valid, expert_index, experts, mask, lse=lse)
    return out, lse, experts


@joint_attention.register_fake
def _(q, landmarks, shared_values, k, v, expert_index, landmark_valid, query_valid,
      route_topk, shared_scale, impl):
    B, H, N, _ = q.shape
    return (q.new_empty(B, H, N, v.shape[-1]),
            q.new_empty(B, H, N, dtype=torch.promote_types(q.dtype, torch.float32)),
            q.new_empty(B, H, N, route_topk, dtype=torch.long))


def _setup_context(ctx, inputs, output):
    q, landmarks, shared_values, k, v, expert_index, landmark_valid, query_valid, _, scale, _ = (
        inputs)
    out, lse, experts = output
    ctx.save_for_backward(q, landmarks, shared_values, k, v, out, lse, expert_index, experts,
                          landmark_valid, query_valid)
    ctx.shared_scale, ctx.impl = scale, inputs[-1]


@torch.library.custom_op("mita::joint_attention_backward", mutates_args=())
def joint_attention_backward(grad_out: Tensor, q: Tensor, landmarks: Tensor,
                             shared_values: Tensor, k: Tensor, v: Tensor, out: Tensor,
                             lse: Tensor, expert_index: Tensor, experts: Tensor,
                             landmark_valid: Tensor, query_valid: Tensor | None,
                             shared_scale: str, impl: str
                             ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The backward of ``joint_attention`` as an operator of its own (so that
    ``torch.compile`` traces the backward as one opaque call, as FlashAttention's): the
    compiled CPU kernel (``joint_backward``) for ``impl="cpu"`` and s = 1, else
    ``tiled_backward``. Arguments: ``joint_attention``'s, its three outputs (``experts``
    ``(B, H, N, s)``) and ``grad_out`` ``(B, H, N, dv)``. Returns dq, d(landmarks),
    d(shared_values), dk, dv, in the shapes of those inputs."""
    c = S.shared_logit_scale(q.shape[-1], shared_scale)
    if impl in TRITON_IMPLS:
        from .kernels.triton_backward import joint_backward_triton

        return joint_backward_triton(grad_out, q, landmarks, shared_values, k, v, out, lse,
                                     expert_index, experts, landmark_valid, query_valid, c,
                                     deterministic=impl == "triton")
    if impl == "cpu" and experts.shape[-1] == 1 and not q.is_cuda:
        from .kernels.cpu import load

        return tuple(load().joint_backward(
            q=q, k=k, v=v, landmarks=landmarks, landmark_valid=landmark_valid,
            shared_values=shared_values, expert_index=expert_index, experts=experts[..., 0],
            token_valid=query_valid, out=out, lse=lse, grad=grad_out.contiguous(), c_shared=c,
            scale=q.shape[-1] ** -0.5))
    return tiled_backward(grad_out, q, landmarks, shared_values, k, v, out, lse, expert_index,
                          experts, landmark_valid, query_valid, c)


@joint_attention_backward.register_fake
def _(grad_out, q, landmarks, shared_values, k, v, out, lse, expert_index, experts,
      landmark_valid, query_valid, shared_scale, impl):
    return (torch.empty_like(q), torch.empty_like(landmarks), torch.empty_like(shared_values),
            torch.empty_like(k), torch.empty_like(v))


def _backward(ctx, grad_out, _grad_lse, _grad_experts):
    q, landmarks, shared_values, k, v, out, lse, expert_index, experts, landmark_valid, \
        query_valid = ctx.saved_tensors
    grads = joint_attention_backward(grad_out, q, landmarks, shared_values, k, v, out, lse,
                                     expert_index, experts, landmark_valid, query_valid,
                                     ctx.shared_scale, ctx.impl)
    return (*grads, None, None, None, None, None, None)


joint_attention.register_autograd(_backward, setup_context=_setup_context)


def mita_attention_grad(q: Tensor, k: Tensor, v: Tensor, num_landmarks: int, topk: int,
                        route_topk: int, key_padding_mask: Tensor | None,
                        landmark_grid: tuple[int, int] | None, shared_scale: str, impl: str,
                        hook: StageHook) -> Tensor:
    """MiTA (eqs. 5-12) with gradients to q, k and v: ``pool`` (eq. 5, differentiable),
    ``landmark_scores`` + ``topk`` without gradient (eqs. 6-7: indices), ``shared_compress``
    as one SDPA call with its fused backward (eq. 8: keeps no m × N weights), then
    ``joint_attention`` (eqs. 9-12; stage ``attention`` here, route and gather included).

    Args: as ``mita.attention.mita_attention`` (checked there), float32/float64 tensors,
    ``topk`` ≤ N; ``impl`` as ``joint_attention``. Returns ``(B, H, N, dv)``, zero at padded
    queries. The forward equals the no-gradient path's to float rounding (``shared_compress``
    runs as SDPA here; the joint part is bit-identical for ``impl`` "torch" and "cpu").
    """
    with hook.stage("pool"):
        landmarks, landmark_valid = S.pool(q, num_landmarks, key_padding_mask, landmark_grid)
    with torch.no_grad():
        with hook.stage("landmark_scores"):
            # 16-bit k (the Triton path): the landmarks rounded to k's dtype, as the kernels
            # take them, and the products summed in float32.
            wide = torch.promote_types(k.dtype, torch.float32)
            scores = S.landmark_scores(landmarks.to(k.dtype).to(wide), k.to(wide),
                                       key_padding_mask)
        with hook.stage("topk"):
            expert_index = S.topk_tokens(scores, topk)
            del scores
    with hook.stage("shared_compress"):
        shared_values = S.shared_compress_sdpa(landmarks, k, v, key_padding_mask)
    query_valid = None if key_padding_mask is None else ~key_padding_mask
    with hook.stage("attention"):
        out, _, _ = joint_attention(q, landmarks, shared_values, k, v, expert_index,
                                    landmark_valid, query_valid, route_topk, shared_scale, impl)
    return out
