"""Inputs and constants several test modules share (test modules never import each other)."""

from __future__ import annotations

import importlib
from contextlib import contextmanager

import pytest
import torch

from mita.data.listops import ListOpsConfig, generate

# float64 against the float64 loop reference: only summation order differs.
F64_TOL = 1e-10
# Stages the compiled CPU kernels report for s = 1: topk + shared_compress run inside
# landmark_scores, gather inside attention.
CPU_KERNEL_STAGES = ("pool", "landmark_scores", "route", "attention")
# Real ListOps sequences for the service tests (lengths 100-500, as the LRA-style data).
EXAMPLES = generate(12, seed=777_001, cfg=ListOpsConfig(100, 500))


def rand_qkv(B, H, N, d, seed, dv=None, dtype=torch.float64):
    """Fresh standard-normal q, k (B, H, N, d) and v (B, H, N, dv or d) from ``seed``."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, N, d, generator=g, dtype=dtype)
    k = torch.randn(B, H, N, d, generator=g, dtype=dtype)
    v = torch.randn(B, H, N, dv or d, generator=g, dtype=dtype)
    return q, k, v


def random_mask(B, N, seed, suffix=True):
    """Bool (B, N), True = padding; every row keeps at least one valid token."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros(B, N, dtype=torch.bool)
    for b in range(B):
        if suffix:
            length = int(torch.randint(1, N + 1, (1,), generator=g))
            mask[b, length:] = True
        else:
            mask[b] = torch.rand(N, generator=g) < 0.4
            mask[b, int(torch.randint(0, N, (1,), generator=g))] = False
    return mask


# The Triton kernel modules in import order (each after the modules it imports jit helpers
# from) and one jit function of each: Triton decides at decoration whether a kernel is
# interpreted, so a module first imported without TRITON_INTERPRET is reloaded, and with it
# every module after it (they hold references to its functions).
KERNEL_MODULES = (("mita.kernels.triton_common", "dot"),
                  ("mita.kernels.bisect", "_bisect_topk_kernel"),
                  ("mita.kernels.mita_attention", "_mita_fused_kernel"),
                  ("mita.kernels.routing", "_landmark_topk_kernel"),
                  ("mita.kernels.topk", "_select_kernel"),
                  ("mita.kernels.pooling", "_pool_kernel"))


@contextmanager
def triton_interpreter():
    """``TRITON_INTERPRET=1`` with the Triton kernel modules (re)imported under it, for a
    module-scoped fixture; yields ``mita.kernels.mita_attention``."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "1")
        stale = False
        for name, fn in KERNEL_MODULES:
            module = importlib.import_module(name)
            stale = stale or type(getattr(module, fn)).__name__ != "InterpretedFunction"
            if stale:
                importlib.reload(module)
        yield importlib.import_module("mita.kernels.mita_attention")


JSON = {"content-type": "application/json"}
OCTETS = {"content-type": "application/octet-stream"}
# One request per kind of refusal before routing, as (status, method, path, body, headers,
# query): the middleware's, the JSON parser's, schema validation's, the router's and the
# endpoints' own checks. Each is counted once as variant "none", except the 404 (not a
# classify path). Sent under any route prefix, every one must give the same status.
REFUSALS = [
    (400, "POST", "/v1/classify", b'{"text": ', JSON, None),
    (422, "POST", "/v1/classify", b'{"foo": 1}', JSON, None),
    (422, "POST", "/v1/classify/batch", b'{"items": [{"ids": [99]}]}', JSON, None),
    (422, "POST", "/v1/classify", b'{"text": "[MAX X ]"}', JSON, None),
    (415, "POST", "/v1/classify", b"{}", {"content-type": "text/plain"}, None),
    (413, "POST", "/v1/classify", b'{"ids": [' + b"3," * 3_000_000 + b"3]}", JSON, None),
    (405, "GET", "/v1/classify", None, None, None),
    (404, "POST", "/nope", b"x", None, None),
    (400, "POST", "/v1/classify/binary", b"", OCTETS, None),
    (422, "POST", "/v1/classify/binary", b"\x00", OCTETS, None),
    (415, "POST", "/v1/classify/binary", b"\x03", JSON, None),
    (422, "POST", "/v1/classify", b'{"text": "[MAX 2 9 ]"}', JSON, {"variant": "dense"}),
    (415, "POST", "/v1/classify", b'{"text": "[MAX 2 9 ]"}',
     {**JSON, "content-encoding": "gzip"}, None),
    (400, "POST", "/v1/classify", b'{"text": "[MAX 2 9 ]"}',
     [("content-type", "application/json"), ("content-type", "application/json")], None),
]
# How many of REFUSALS each status counts in requests_total{variant="none"}.
REFUSALS_COUNTED = {400: 3, 422: 5, 415: 3, 413: 1, 405: 1, 404: 0}


def send_refusals(client, prefix: str = "") -> list[int]:
    """Send every request of ``REFUSALS`` with ``client`` (an httpx.Client) under the route
    ``prefix``; returns the statuses, in order."""
    return [client.request(method, prefix + path, content=body, headers=headers,
                           params=query).status_code
            for _, method, path, body, headers, query in REFUSALS]
