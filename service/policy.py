"""The A/B policy: which variant serves a request, and how its shadow answer is compared.

Pure functions of the gateway's config and a request's headers, apart from the gateway so
they can be tested (and mutation-tested) without Ray.
"""

from __future__ import annotations

import hashlib
import random

from mita.quality import kl_divergence

from .settings import VARIANTS, GatewayConfig


def sticky_unit(key: str) -> float:
    """A client key hashed (SHA-256) to a number in [0, 1): the same key, the same variant."""
    return int(hashlib.sha256(key.encode("utf-8")).hexdigest()[:16], 16) / 2.0**64


def choose_variant(cfg: GatewayConfig, override: str | None, client_key: str | None,
                   rng: random.Random) -> tuple[str, str | None]:
    """(primary, shadow). An explicit ``override`` wins; otherwise the variant is drawn by
    ``cfg.weights`` — from the hashed client key when one is sent (sticky), else at random.
    In shadow mode the other variant is the shadow."""
    if override is not None:
        primary = override
    else:
        total = sum(cfg.weights.values())
        u = sticky_unit(client_key) if client_key else rng.random()
        live = [v for v in VARIANTS if cfg.weights.get(v, 0) > 0]
        primary, acc = live[-1], 0.0
        for v in live:
            acc += cfg.weights[v] / total
            if u < acc:
                primary = v
                break
    shadow = next(v for v in VARIANTS if v != primary) if cfg.shadow else None
    return primary, shadow


def shadow_comparison(primary: str, served: dict, other: dict) -> tuple[bool, float]:
    """(labels agree, KL(dense ‖ MiTA) in nats) of the answer ``served`` by ``primary`` and
    its shadow's answer ``other`` (each with ``label`` and ``probabilities``): dense is the
    reference whichever variant is primary, so the metric keeps one meaning across A/B
    weights (``mita.quality``)."""
    shadow = next(v for v in VARIANTS if v != primary)
    probs = {primary: served["probabilities"], shadow: other["probabilities"]}
    return served["label"] == other["label"], kl_divergence(probs["dense"], probs["mita"])
