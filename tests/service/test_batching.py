"""No request waits for a batch that cannot help it (the real service, Ray Serve on loopback,
in this process)."""

from __future__ import annotations

import httpx

from mita.data.listops import encode

from ..helpers import EXAMPLES, set_classifier

WAIT_S = 10.0  # batch_wait_timeout_s at the schema's maximum: a wait nobody can miss


def test_a_lone_request_never_waits_batch_wait_timeout_s(service, serve_reset):
    """With ``batch_wait_timeout_s`` at 10 s, a request alone in its replica starts its
    forward at once, with ``deterministic: true`` (every sequence runs its own forward: a
    batch cannot help; on main each request waited the whole timeout in ``@serve.batch``) and
    with padded batching (nothing else is inside to batch with). Either way it answers well
    inside the 10 s, and its pre-forward time says the wait was not taken."""
    ids = encode(EXAMPLES[0][0])
    for deterministic in (True, False):
        set_classifier(service, "MiTAClassifier", batch_wait_timeout_s=WAIT_S,
                       deterministic=deterministic)
        for _ in range(3):
            r = httpx.post(f"{service.url}/v1/classify", timeout=WAIT_S / 2, json={
                "ids": ids, "variant": "mita", "profile": True})
            assert r.status_code == 200, r.text
            profile = r.json()["profile"]
            assert profile["batch_size"] == 1 and profile["pre_forward_ms"] < WAIT_S * 1e3 / 2
