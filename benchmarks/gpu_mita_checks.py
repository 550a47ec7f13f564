"""``benchmarks/gpu_mita.py``'s kernel checks (its step 1 a-c): the fused path, the routing
kernels and the float32 kernels against the PyTorch stages and the float64 references, on fresh
random inputs. Each check returns rows ``{"check", "dtype", "shape", "rel_err", "tol", "ok"}``;
the interpreter is chosen by whoever imports the kernels first (``gpu_mita.py --smoke``)."""

from __future__ import annotations

import torch

from mita import attention as A
from mita import stages as S
from mita.config import clamp_topk
from mita.hooks import NULL_HOOK
from mita.reference import reference_mita

TOL = {torch.float32: 1e-5, torch.bfloat16: 1.5e-2, torch.float16: 2e-3}


# The checks' shapes (``benchmarks/gpu_compiles.py`` lists the kernels they compile).
CHECK_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
REFERENCE_CASES = [  # B, H, N, d, m, k, s, masked
    (2, 2, 96, 64, 6, 12, 1, True), (1, 2, 120, 32, 8, 20, 2, True),
    (2, 1, 70, 128, 9, 33, 3, False), (1, 1, 5, 64, 8, 4, 1, False),
    (1, 2, 700, 64, 20, 300, 1, True)]
ROUTING_DTYPES = (torch.float32, torch.bfloat16)
ROUTING_CASES = [(1, 2, 150, 64, 9, 7), (2, 2, 3000, 16, 40, 100),  # B, H, N, d, m, k
                 (1, 2, 20000, 64, 64, 512), (1, 1, 5000, 16, 17, 256)]
TORCH_PATH_SHAPE = (8192, 64, 64)  # N, m, k; B = H = 2, d = 64, s = 1 and 2, masked, float32


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    ref = ref.to(out.device, torch.float64)
    return float((out.double() - ref).abs().max() / ref.abs().max())


def rand_inputs(shape, gen, device, dtype, integer: bool = False):
    """Fresh random q, k, v: normal, or small integers in [-2, 2] (then every score is exact in
    float32 whatever the summation order, so top-k and argmax must equal the reference's
    exactly, ties included)."""
    if integer:
        return tuple(torch.randint(-2, 3, shape, generator=gen).to(device, dtype)
                     for _ in range(3))
    return tuple(torch.randn(shape, generator=gen).to(device, dtype) for _ in range(3))


def rand_mask(B, N, gen, device, p=0.3):
    mask = torch.rand(B, N, generator=gen) < p
    mask[:, 0] = False
    return mask.to(device)


def fused_decisions(q, k, v, m, topk, s, mask):
    """The routing decisions the fused path makes — its own (deterministic) kernels on the
    same inputs: ``(expert_index (B, H, m, k), experts (B, H, N, s))``."""
    from mita.kernels import pooling, routing

    d = q.shape[-1]
    landmarks, lm, landmark_valid, _, _ = pooling.pool_landmarks(q, m, mask)
    index = routing.landmark_topk(lm, k, topk, d ** -0.5, mask)
    if s == 1:
        shared = S.shared_compress_sdpa(lm, k, v, mask)
        experts = routing.route_shared(q, lm, shared, landmark_valid, d ** -0.5)[0]
    else:
        experts = S.route(q, landmarks, s, landmark_valid)
    return index, experts


def reference_given(q, k, v, m, s, mask, index, experts) -> torch.Tensor:
    """The PyTorch stages in float64 (eqs. 5-12) with the routing decisions given: 16-bit
    scores round the landmarks, so a key near the k-th score (or a query between two
    landmarks) can go either way; the arithmetic after the decisions is what is checked
    against float64 here (the decisions themselves are checked exactly by
    ``check_routing``)."""
    q, k, v = q.double(), k.double(), v.double()
    landmarks, landmark_valid = S.pool(q, m, mask)
    shared = S.shared_compress(S.landmark_scores(landmarks, k, mask), v)
    return S.gather_and_attend(q, k, v, landmarks, landmark_valid, shared, index, experts, "paper",
                                mask, NULL_HOOK)


def check_reference(device, gen, smoke: bool) -> list[dict]:
    """The whole fused path (``mita_attention(backend="triton")``: landmark top-k, SDPA
    shared values, route + shared half, attention kernel) vs the float64 PyTorch stages on the
    fused path's own routing decisions; ``decisions_equal_loop_reference`` says whether those
    decisions were also the float64 loop reference's (then the loop reference is within the
    tolerance too)."""
    cases = REFERENCE_CASES
    runs = [(case, dtype) for dtype in CHECK_DTYPES for case in cases]
    if smoke:  # the interpreter sorts slowly: one s = 1 and one s = 2 case
        runs = [(cases[0], torch.float32), (cases[1], torch.bfloat16)]
    rows = []
    for (B, H, N, d, m, topk, s, masked), dtype in runs:
        q, k, v = rand_inputs((B, H, N, d), gen, device, dtype)
        mask = rand_mask(B, N, gen, device) if masked else None
        out = A.mita_attention(q, k, v, num_landmarks=m, topk=topk, route_topk=s,
                               key_padding_mask=mask, backend="triton")
        index, experts = fused_decisions(q, k, v, m, clamp_topk(topk, N), s, mask)
        err = rel_err(out, reference_given(q, k, v, m, s, mask, index, experts))
        loop = reference_mita(*(t.double().cpu().numpy() for t in (q, k, v)), m, topk, s,
                              None if mask is None else mask.cpu().numpy())
        rows.append({"check": "fused path vs float64 stages (its routing decisions)",
                     "dtype": str(dtype), "shape": f"B{B} H{H} N{N} d{d} m{m} k{topk} s{s}"
                     + (" masked" if masked else ""), "rel_err": err, "tol": TOL[dtype],
                     "ok": bool(torch.isfinite(out).all()) and err < TOL[dtype],
                     "loop_reference_rel_err": rel_err(out, torch.from_numpy(loop))})
    return rows


def check_routing(device, gen, smoke: bool) -> list[dict]:
    """The routing kernels vs the PyTorch stages on integer-valued inputs (exact scores):
    ``landmark_topk`` indices equal ``topk(landmark_scores(...))`` (lowest-index ties), and
    ``route_shared``'s experts equal ``route``'s, its shared partials within 1e-5."""
    from mita.kernels import routing
    from mita.kernels import topk as topk_kernels

    # d a power of 4: 1/√d is a power of two, so scaling before or after the sum is exact
    cases = ROUTING_CASES[:1] if smoke else ROUTING_CASES
    rows = []
    for dtype in ROUTING_DTYPES:
        for B, H, N, d, m, topk in cases:
            q, k, v = rand_inputs((B, H, N, d), gen, device, dtype, integer=True)
            mask = rand_mask(B, N, gen, device)
            landmarks, landmark_valid = S.pool(q, m, mask)
            landmarks = landmarks.round()  # integer landmarks: exact scores again
            want = S.topk_tokens(S.landmark_scores(landmarks, k.float(), mask), topk)
            shape = f"B{B} H{H} N{N} d{d} m{m} k{topk} masked"
            for name, fn in (("landmark_topk", routing.landmark_topk),
                             ("threshold_topk", topk_kernels.threshold_topk)):
                got = fn(landmarks, k, topk, d ** -0.5, mask)
                same = int((got != want).any(-1).sum())  # landmarks with another choice
                rows.append({"check": f"{name} == topk(landmark_scores), ties lowest index",
                             "dtype": str(dtype), "shape": shape, "rel_err": float(same),
                             "tol": 0.0, "ok": same == 0})
            sv = torch.randn(B, H, m, d, generator=gen).to(device)
            experts, pm, pl, pa = routing.route_shared(q, landmarks, sv, landmark_valid, d ** -0.5)
            ref_experts = S.route(q.float(), landmarks, 1, landmark_valid)
            logits = (q.float() @ landmarks.transpose(-1, -2) * d ** -0.5).masked_fill(
                ~landmark_valid[:, None, None, :], float("-inf"))
            weights = torch.softmax(logits, -1)
            shared = pa / pl[..., None]
            err = rel_err(shared, weights @ sv.to(dtype).float())
            wrong = int((experts != ref_experts).sum())
            # the shared half multiplies p·ṽ in the input dtype (as flash): TOL per dtype
            rows.append({"check": "route_shared experts == route; shared half", "dtype":
                         str(dtype), "shape": shape, "rel_err": err, "tol": TOL[dtype],
                         "ok": wrong == 0 and err < TOL[dtype]})
    return rows


def check_torch_path(device, gen, smoke: bool) -> list[dict]:
    n, m, topk = (128, 8, 8) if smoke else TORCH_PATH_SHAPE
    rows = []
    for s in (1, 2):
        q, k, v = (torch.randn(2, 2, n, 64, generator=gen).to(device) for _ in range(3))
        mask = (torch.rand(2, n, generator=gen) < 0.2).to(device)
        mask[:, 0] = False
        fused = A.mita_attention(q, k, v, num_landmarks=m, topk=topk, route_topk=s,
                                 key_padding_mask=mask, backend="triton")
        ref = A.mita_attention(q.double(), k.double(), v.double(), num_landmarks=m, topk=topk,
                               route_topk=s, key_padding_mask=mask, backend="torch")
        err = rel_err(fused, ref)
        rows.append({"check": "kernel fp32 vs PyTorch path fp64", "dtype": "torch.float32",
                     "shape": f"B2 H2 N{n} d64 m{m} k{topk} s{s} masked", "rel_err": err,
                     "tol": 1e-5, "ok": err < 1e-5})
    return rows
