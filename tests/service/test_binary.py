"""Binary token ids (``POST /v1/classify/binary``) on the real service, and the deployment's
answers against the plain ``ClassifierEngine`` it wraps."""

from __future__ import annotations

import numpy as np
import pytest

from mita.data.listops import ListOpsConfig, encode, generate
from service.engine import ClassifierEngine

from ..helpers import CHECKPOINT, set_gateway

OCTETS = {"content-type": "application/octet-stream"}
EXAMPLES = generate(4, seed=424_242, cfg=ListOpsConfig(100, 400))


# sharing: answers, counts and refusals, nothing timed: runs beside the tests/own_ray/
# tests instead of waiting for the cores lock (tests/lanes.py)
pytestmark = pytest.mark.sharing


def binary(service, data: bytes, **params):
    return service.client.post("/v1/classify/binary", content=data, headers=OCTETS,
                               params=params)


@pytest.mark.parametrize("variant", ["mita", "dense"])
def test_binary_equals_json_equals_engine(service, variant):
    """uint8 and int32 bodies give the JSON answer bit for bit (one forward per sequence in
    the same replica), and the deployment gives what ``ClassifierEngine`` gives in this
    process: labels equal, probabilities within 1e-6 (the replica's BLAS may block the float32
    products differently with its own thread count)."""
    engine = ClassifierEngine(CHECKPOINT, variant, "cpu", "torch", "auto")
    for text, _ in EXAMPLES:
        ids = np.array(encode(text), dtype=np.uint8)
        js = service.post("/v1/classify", json={"ids": ids.tolist(), "variant": variant})
        u8 = binary(service, ids.tobytes(), variant=variant)
        i32 = binary(service, ids.astype("<i4").tobytes(), variant=variant, dtype="int32")
        for r in (js, u8, i32):
            assert r.status_code == 200, r.text
        assert u8.json() == js.json() == i32.json()
        local = engine.run([ids])[0]
        body = js.json()
        assert body["label"] == local["label"] and body["n"] == len(ids)
        assert body["model_id"] == local["model_id"]
        assert np.abs(np.array(body["probabilities"])
                      - np.array(local["probabilities"])).max() < 1e-6


def test_binary_profile_reports_dtype_and_pre_forward_time(service):
    ids = np.array(encode(EXAMPLES[0][0]), dtype=np.uint8)
    r = binary(service, ids.tobytes(), variant="mita", profile="true")
    assert r.status_code == 200, r.text
    prof = r.json()["profile"]
    assert prof["dtype"] == "float32" and prof["device"] == "cpu"
    assert 0 < prof["pre_forward_ms"] < r.elapsed.total_seconds() * 1e3
    assert "started_at" not in prof  # internal; the gateway turns it into pre_forward_ms
    models = service.client.get("/v1/models").json()["variants"]
    assert models["mita"]["dtype"] == models["dense"]["dtype"] == "float32"


BAD_BINARY = [
    (b"", {}, 400, "empty request body"),
    (b"\x03\x04\x05\x06\x07", {"dtype": "int32"}, 400,
     "a body of 5 bytes is not a whole number of int32 ids (4 bytes each)"),
    (b"\x03\x00\x05", {}, 422, "token id 0 at position 1 is out of range [1, 15]"),
    (np.array([3, 4], "<i4").tobytes(), {}, 422,  # int32 ids sent without ?dtype=int32
     "read as uint8 little-endian (?dtype=uint8): int32 ids need ?dtype=int32"),
    (b"\x03\x04\x10", {}, 422, "token id 16 at position 2 is out of range"),
    (np.array([3, -1], "<i4").tobytes(), {"dtype": "int32"}, 422, "token id -1 at position 1"),
    (np.array([3, 1 << 30], "<i4").tobytes(), {"dtype": "int32"}, 422, "token id 1073741824"),
    (b"\x03" * 16385, {}, 422, "sequence length N = 16385 exceeds max_n = 16384"),
    (b"\x03", {"dtype": "int64"}, 422, "dtype"),
    (b"\x03", {"variant": "sparse"}, 422, "variant"),
    (b"\x03", {"profile": "maybe"}, 422, "profile"),
    (b"\x03", {"varient": "mita"}, 422, "unknown query parameter(s) ['varient']"),
    (b"\x03", {"dtype": ["uint8", "int32"]}, 422, "['dtype'] given more than once"),
]


@pytest.mark.parametrize("data,params,status,message", BAD_BINARY)
def test_bad_binary_bodies_get_clear_4xx(service, data, params, status, message):
    r = binary(service, data, **params)
    assert r.status_code == status, r.text
    assert r.headers["content-type"] == "application/json"
    assert message in r.json()["error"], r.json()


def test_binary_and_json_content_types_are_not_mixed(service):
    r = service.client.post("/v1/classify/binary", content=b"\x03\x04",
                            headers={"content-type": "application/json"})
    assert r.status_code == 415
    assert "Content-Type must be application/octet-stream" in r.json()["error"]
    r = service.client.post("/v1/classify", content=b"\x03\x04", headers=OCTETS)
    assert r.status_code == 415 and "must be application/json" in r.json()["error"]


def test_one_million_binary_ids_accepted(service, serve_reset):
    """1M ids (1 MiB as uint8) under a gateway allowing them: answered, N counted, the
    forward's own length; JSON of the same ids would be ~3 MB."""
    n = 1 << 20
    ids = np.random.default_rng(7).integers(1, 16, n).astype(np.uint8)
    set_gateway(service, max_n=n, max_body_bytes=16 * 1024 * 1024)
    r = binary(service, ids.tobytes(), variant="mita", profile="true")
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["n"] == n and body["profile"]["padded_n"] == n
    assert 0 <= body["label"] < 10 and abs(sum(body["probabilities"]) - 1) < 1e-9
    r = binary(service, np.append(ids, 3).astype(np.uint8).tobytes(), variant="mita")
    assert r.status_code == 422 and f"exceeds max_n = {n}" in r.json()["error"]


def test_ambiguous_or_encoded_bodies_refused(service):
    c = service.client
    r = c.post("/v1/classify/binary", content=b"\x03\x04",
               headers=[("content-type", "application/octet-stream"),
                        ("content-type", "application/json")])
    assert r.status_code == 400 and "more than one Content-Type" in r.json()["error"]
    r = c.post("/v1/classify/binary", content=b"\x1f\x8b\x08",
               headers=OCTETS | {"content-encoding": "gzip"})
    assert r.status_code == 415 and "Content-Encoding 'gzip'" in r.json()["error"]
    r = c.post("/v1/classify", json={"text": "[MAX 2 9 ]"}, headers={"content-encoding": "br"})
    assert r.status_code == 415


ONE = {"text": "[MAX 2 9 ]"}


@pytest.mark.parametrize("method,path,params,body,status,message", [
    ("POST", "/v1/classify", {"variant": "dense"}, ONE, 422,
     "unknown query parameter(s) ['variant']; this endpoint takes none (variant and profile "
     "go in the JSON body)"),
    ("POST", "/v1/classify/batch", {"profile": "true"}, {"items": [ONE]}, 422,
     "this endpoint takes none"),
    ("GET", "/v1/stats", {"window_s": ["10", "20"]}, None, 422,
     "['window_s'] given more than once"),
    ("GET", "/v1/stats", {"window_s": "nan"}, None, 422, "finite number"),
    ("GET", "/v1/stats", {"window": "10"}, None, 422, "known: window_s"),
    ("GET", "/v1/classify", {"variant": "dense"}, None, 405, "Method Not Allowed"),
])
def test_query_parameters_are_checked(service, method, path, params, body, status, message):
    """Found by a new user: the JSON endpoint ignored ?variant=dense (answered by the A/B
    policy), and a repeated parameter silently took its last value."""
    r = service.client.request(method, path, params=params, json=body)
    assert r.status_code == status, r.text
    assert message in r.json()["error"], r.json()


def test_empty_batch_body_names_items(service):
    r = service.client.post("/v1/classify/batch", content=b"",
                            headers={"content-type": "application/json"})
    assert r.status_code == 400
    assert r.json()["error"] == "empty request body: send a JSON object with 'items'"
