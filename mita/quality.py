"""How far MiTA's answer is from dense attention's: the one KL every report uses.

The reference is always dense attention, whichever variant served the request: the
advisor's table, the gateway's shadow metric (``ray_mita_serve_shadow_kl_divergence``),
``/v1/stats`` and the dashboard all give KL(dense ‖ MiTA) of the class probabilities, so a
number means the same whether MiTA or dense is the primary of an A/B split.
"""

from __future__ import annotations

import numpy as np

KL_FLOOR = 1e-12  # probabilities clamped here, so a zero in MiTA's keeps KL finite


def kl_divergence(reference, probs) -> np.ndarray | float:
    """KL(reference ‖ probs) = Σ_c p_c (log p_c − log q_c) in nats, over the last axis.

    ``reference`` and ``probs``: class probabilities, array-likes of one shape
    ``(..., classes)`` (a list of floats for one answer, ``(n, classes)`` for many).
    Both are clamped at ``KL_FLOOR`` inside the log, so classes where the reference is 0
    add 0 (the limit p log p → 0) and a 0 in ``probs`` stays finite. Returns a float for
    one distribution, else a float64 array of shape ``(...)``. Raises ValueError when the
    shapes differ.
    """
    p = np.asarray(reference, dtype=np.float64)
    q = np.asarray(probs, dtype=np.float64)
    if p.shape != q.shape:
        raise ValueError(f"reference and probs differ in shape: {p.shape} vs {q.shape}")
    # p clamped too: a class where the reference is 0 then adds 0 · (finite) = 0, not 0 · −∞
    kl = (p * (np.log(np.clip(p, KL_FLOOR, None)) - np.log(np.clip(q, KL_FLOOR, None)))).sum(-1)
    return float(kl) if kl.ndim == 0 else kl
