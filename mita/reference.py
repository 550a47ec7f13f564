"""Float64 per-query loop references for MiTA, written from eqs. 5-12 of arXiv:2602.01219: the
output (``reference_mita``, numpy) and, through autograd, the gradients
(``reference_mita_autograd``, torch).

Deliberately naive and independent of ``mita.stages``: Python lists and numpy vectors, one
query at a time, explicit sorting with (-score, index) keys for the lowest-index tie rule.
"""

from __future__ import annotations

import math

import numpy as np


def _segments_1d(valid: list[int], m: int) -> list[list[int]]:
    """Valid tokens in order; the r-th one (0-based) goes to segment floor(r·m/L)."""
    members = [[] for _ in range(m)]
    for r, j in enumerate(valid):
        members[r * m // len(valid)].append(j)
    return members


def _windows_2d(valid: set[int], grid: tuple[int, int], m: int) -> list[list[int]]:
    """Adaptive-average-pool windows of an H×W grid pooled to p×p (p² = m), row-major."""
    gh, gw = grid
    p = math.isqrt(m)
    members = []
    for a in range(p):
        rows = range(a * gh // p, -(-(a + 1) * gh // p))
        for c in range(p):
            cols = range(c * gw // p, -(-(c + 1) * gw // p))
            members.append([r * gw + x for r in rows for x in cols if r * gw + x in valid])
    return members


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


def reference_mita(q, k, v, m, topk, s=1, key_padding_mask=None, landmark_grid=None,
                   shared_scale="paper") -> np.ndarray:
    """q, k: (B, H, N, d), v: (B, H, N, dv) arrays; mask (B, N) bool with True = padding.

    Returns (B, H, N, dv) float64, zero at padded queries.
    """
    q, k, v = (np.asarray(t, dtype=np.float64) for t in (q, k, v))
    B, H, N, d = q.shape
    c_shared = 1 / math.sqrt(d) if shared_scale == "paper" else 1 / d
    out = np.zeros((B, H, N, v.shape[-1]))
    for b in range(B):
        valid = [j for j in range(N) if key_padding_mask is None or not key_padding_mask[b][j]]
        if landmark_grid is None:
            members = _segments_1d(valid, m)
        else:
            members = _windows_2d(set(valid), landmark_grid, m)
        filled = [i for i in range(m) if members[i]]  # valid landmarks (non-empty segments)
        for h in range(H):
            # eq. 5: landmarks are means of the queries of each segment
            landmark = {i: np.mean([q[b, h, j] for j in members[i]], axis=0) for i in filled}
            expert, shared_value = {}, {}
            for i in filled:
                # eq. 6: landmark scores over all valid keys
                score = {j: float(landmark[i] @ k[b, h, j]) / math.sqrt(d) for j in valid}
                # eq. 7: top-k keys, ties to the lowest index
                expert[i] = sorted(valid, key=lambda j, sc=score: (-sc[j], j))[:topk]
                # eq. 8: shared value = softmax over ALL valid keys, weighted sum of values
                w = _softmax(np.array([score[j] for j in valid]))
                shared_value[i] = sum(wj * v[b, h, j] for wj, j in zip(w, valid, strict=True))
            for n in valid:
                qn = q[b, h, n]
                affinity = {i: float(qn @ landmark[i]) for i in filled}
                # eq. 9: top-s landmarks by q·q̃, ties to the lowest index; no gate
                chosen = sorted(filled, key=lambda i, af=affinity: (-af[i], i))[:s]
                # eqs. 10-12: one softmax over m shared + s·k routed entries
                logits = [affinity[i] * c_shared for i in filled]
                values = [shared_value[i] for i in filled]
                for e in chosen:
                    for j in expert[e]:
                        logits.append(float(qn @ k[b, h, j]) / math.sqrt(d))
                        values.append(v[b, h, j])
                w = _softmax(np.array(logits))
                out[b, h, n] = np.sum(w[:, None] * np.array(values), axis=0)
    return out


def reference_dense(q, k, v, key_padding_mask=None) -> np.ndarray:
    """Dense softmax attention, float64, one query at a time (eqs. 1-4)."""
    q, k, v = (np.asarray(t, dtype=np.float64) for t in (q, k, v))
    B, H, N, d = q.shape
    out = np.zeros((B, H, N, v.shape[-1]))
    for b in range(B):
        valid = [j for j in range(N) if key_padding_mask is None or not key_padding_mask[b][j]]
        for h in range(H):
            for n in valid:
                w = _softmax(np.array([q[b, h, n] @ k[b, h, j] for j in valid]) / math.sqrt(d))
                out[b, h, n] = w @ v[b, h, valid]
    return out


def reference_mita_autograd(q, k, v, m, topk, s=1, key_padding_mask=None, landmark_grid=None,
                            shared_scale="paper"):
    """``reference_mita`` in float64 torch operations, one query at a time, so that autograd
    gives the gradients eqs. 5-12 define: through the pooled landmarks (eq. 5), the shared
    compression's softmax over all valid keys (eq. 8), the shared logits q·q̃ and the routed
    logits; top-k and the route (eqs. 7, 9) are chosen on the values (``.item()``), so they
    carry no gradient. The float64 gradient reference of ``tests``; tiny shapes only (a Python
    loop per query and key).

    q, k: (B, H, N, d), v: (B, H, N, dv) float64 tensors (requiring grad as the caller wants);
    mask (B, N) bool, True = padding. Returns (B, H, N, dv) float64, zero at padded queries.
    """
    import torch

    B, H, N, d = q.shape
    c_shared = 1 / math.sqrt(d) if shared_scale == "paper" else 1 / d
    rows = []
    for b in range(B):
        mask = None if key_padding_mask is None else key_padding_mask[b].tolist()
        valid = [j for j in range(N) if mask is None or not mask[j]]
        members = (_segments_1d(valid, m) if landmark_grid is None
                   else _windows_2d(set(valid), landmark_grid, m))
        filled = [i for i in range(m) if members[i]]
        heads = []
        for h in range(H):
            qb, kb, vb = q[b, h], k[b, h], v[b, h]
            landmark = {i: qb[members[i]].mean(0) for i in filled}
            expert, shared_value = {}, {}
            for i in filled:
                score = (kb[valid] @ landmark[i]) / math.sqrt(d)
                values = score.tolist()
                order = sorted(range(len(valid)), key=lambda t, sc=values: (-sc[t], t))
                expert[i] = [valid[t] for t in order[:topk]]
                shared_value[i] = torch.softmax(score, 0) @ vb[valid]
            out = [vb.new_zeros(v.shape[-1]) for _ in range(N)]
            for n in valid:
                affinity = torch.stack([qb[n] @ landmark[i] for i in filled])
                af = affinity.tolist()
                chosen = sorted(range(len(filled)), key=lambda t: (-af[t], t))[:s]
                logits = [affinity * c_shared]
                values = [torch.stack([shared_value[i] for i in filled])]
                for t in chosen:
                    keys = expert[filled[t]]
                    logits.append((kb[keys] @ qb[n]) / math.sqrt(d))
                    values.append(vb[keys])
                out[n] = torch.softmax(torch.cat(logits), 0) @ torch.cat(values)
            heads.append(torch.stack(out))
        rows.append(torch.stack(heads))
    return torch.stack(rows)
