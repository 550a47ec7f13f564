"""Security of the real service's HTTP inputs (Ray Serve on loopback, in this process):
the fuzzed OpenAPI schema, no path parameters, nasty bodies, refusals counted, size limits."""

from __future__ import annotations

import json
import time

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.specs.openapi.checks import positive_data_acceptance

from mita.data.listops import encode, generate_long

from ..helpers import (
    REFUSALS,
    REFUSALS_COUNTED,
    counter,
    delta,
    send_refusals,
    set_gateway,
    wait_for,
)


def settled_metrics(service) -> str:
    """Metrics text once earlier refusals (``requests_total{variant="none"}``) have been
    exported (two equal reads 1.5 s apart): Ray exports every 0.5 s in tests, so a fresh
    snapshot can still miss the last test's. Only the refusals' series: the count of all
    requests did not hold still for 30 s in a whole-suite run (50 s for the test below,
    4 s alone), and what the test reads is the refusals'."""
    def refusals(text: str) -> float:
        return counter(text, "ray_mita_serve_requests_total", variant="none")

    text = service.metrics_text()
    for _ in range(20):
        time.sleep(1.5)
        again = service.metrics_text()
        if refusals(again) == refusals(text):
            return again
        text = again
    return text


# ---------------------------------------------------------------------------------------------
# Fuzzing: schemathesis against the service's own OpenAPI schema.

@pytest.mark.sharing  # statuses and bodies, no timing
def test_openapi_fuzz(service):
    """Every request schemathesis generates from the service's own OpenAPI schema (valid and
    invalid data, every operation) gets a status the schema documents, a body matching the
    documented model, and never a 5xx. 25 examples per operation (schema-valid and
    schema-invalid data mixed), derandomized. Not checked:
    that every schema-valid body is accepted — the schema cannot express the ListOps
    vocabulary, "exactly one of text/ids" or max_n, so such bodies get a documented 422."""
    schema = schemathesis.openapi.from_url(f"{service.url}/openapi.json")
    operations = [r.ok() for r in schema.get_all_operations()]
    assert {op.path for op in operations} >= {"/v1/classify", "/v1/classify/batch",
                                              "/v1/models", "/v1/stats", "/healthz"}
    seen: dict[str, set[int]] = {}  # operation → statuses answered
    for op in operations:
        @given(case=st.one_of(op.as_strategy(GenerationMode.POSITIVE),
                              op.as_strategy(GenerationMode.NEGATIVE)))
        @settings(max_examples=25, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))
        def check(case):
            response = case.call_and_validate(timeout=60, excluded_checks=[
                positive_data_acceptance])
            seen.setdefault(case.operation.label, set()).add(response.status_code)
        check()
    print(f"fuzz statuses: {seen}")
    assert 422 in seen["POST /v1/classify"] and 422 in seen["POST /v1/classify/batch"]
    assert max(max(codes) for codes in seen.values()) < 500
    # The schema's own examples are real ListOps: answered 200, response schema checked.
    classify = next(op for op in operations if op.label == "POST /v1/classify")
    examples = schema.raw_schema["components"]["schemas"]["ClassifyRequest"]["examples"]
    for example in examples:
        case = classify.Case(body=example, media_type="application/json")
        assert case.call_and_validate(timeout=60).status_code == 200


def test_no_endpoint_takes_paths(service):
    spec = service.client.get("/openapi.json").json()
    for path, ops in spec["paths"].items():
        assert "{" not in path, path  # no path parameters
        for op in ops.values():
            for p in op.get("parameters", []):
                # Strings only from a closed set (an enum cannot carry a path).
                assert p["in"] == "query", (path, p)
                assert "example" not in p, (path, p)  # was {} for every parameter
                assert p["schema"].get("type") != "string" or "enum" in p["schema"], (path, p)
    for name in ("ClassifyRequest", "BatchRequest"):
        assert spec["components"]["schemas"][name]["additionalProperties"] is False


# ---------------------------------------------------------------------------------------------
# Hand-written nasty bodies (raw bytes, so the JSON itself can be odd).

def raw(service, body: bytes | str, path="/v1/classify") -> httpx.Response:
    data = body.encode() if isinstance(body, str) else body
    return service.client.post(path, content=data, headers={"content-type": "application/json"})


NASTY = [
    ('{"ids": [9223372036854775808]}', 422, "out of range"),          # int64 max + 1
    ('{"ids": [-9223372036854775809]}', 422, "out of range"),
    ('{"ids": [3, -2]}', 422, "token id -2 at position 1"),
    ('{"ids": [3.0]}', 422, "invalid request"),
    ('{"ids": [1e400]}', 422, "invalid request"),
    ('{"ids": [NaN]}', 422, "invalid request"),
    ('{"ids": [[3, [4]]]}', 422, "invalid request"),
    ('{"ids": ["3", 4]}', 422, "invalid request"),
    ('{"ids": [true]}', 422, "invalid request"),
    ('{"ids": null, "text": null}', 422, "null is not a value of 'text': leave the field out"),
    # a null given is not the field left out: it was served by the A/B policy
    ('{"text": "[MAX 2 3 ]", "variant": null}', 422,
     "null is not a value of 'variant': leave the field out for the A/B policy, or give "
     "'mita' or 'dense'"),
    ('{"ids": [3], "text": null}', 422, "null is not a value of 'text'"),
    ('{"text": "[MAX 2 ３ ]"}', 422, "unknown token '３'"),              # full-width digit
    ('{"text": "[MAX 2 3 ] \\u0000"}', 422, "unknown token"),
    ('{"text": "[MAX 2 💥 ]"}', 422, "unknown token '💥'"),
    ('{"text": "\\ud800"}', 422, "unknown token"),                     # lone surrogate
    ('{"text": "[MAX 2 3 ]", "text": "[MIN 4 ]"}', 400, "duplicate key 'text'"),
    ('{"ids": [3], "ids": [4]}', 400, "duplicate key 'ids'"),
    ('{"ids": ' + "[" * 5000 + "]" * 5000 + "}", 400, "malformed JSON"),  # nesting bomb
    ('[{"text": "[MAX 2 3 ]"}]', 422, "invalid request"),
    ('"[MAX 2 3 ]"', 422, "invalid request"),
    ("{}", 422, "exactly one of 'text' or 'ids'"),
    ('{"text": "[MAX 2 3 ]", "checkpoint": "/etc/passwd"}', 422, "checkpoint"),
    ('{"ids": [' + "7" * 5000 + "]}", 400, "an integer with too many digits"),
]


@pytest.mark.parametrize("body,status,message", NASTY)
def test_nasty_bodies(service, body, status, message):
    r = raw(service, body)
    assert r.status_code == status, r.text
    assert r.headers["content-type"] == "application/json"
    assert message in r.json()["error"], r.json()


# A new user's tries (issue: faults a user hits): each refused with what is wrong, quickly.
BIG = [
    ("/v1/classify/batch", {"items": [{"text": "[MAX 2 3 ]"}] * 5000}, 422, 1.0,
     "5000 items exceed max_batch_items = 64"),
    ("/v1/classify/batch", {"items": [{"ids": [3] * 100_000}] * 8}, 422, 5.0,
     "items[0]: sequence length N = 100000 exceeds max_n = 16384"),
    ("/v1/classify", {"text": " " * 10_000_000}, 413, 1.0,
     "request body of 10000012 bytes exceeds the limit of 4194304 bytes"),
    ("/v1/classify", {"text": "[MAX " * 10_000 + "1" + " ]" * 10_000}, 422, 1.0,
     "sequence length N = 20001 exceeds max_n = 16384"),
    ("/v1/classify", {"ids": [3] * 1_048_576, "variant": "dense"}, 422, 5.0,
     "sequence length N = 1048576 exceeds max_n = 16384"),
]


@pytest.mark.parametrize("path,body,status,within_s,message", BIG,
                         ids=["5000-tiny-items", "8x100k-ids", "10MB-whitespace",
                              "brackets-10000-deep", "dense-1M"])
def test_big_and_deep_bodies_are_refused_quickly(service, path, body, status, within_s,
                                                 message):
    data = json.dumps(body)
    t0 = time.monotonic()
    r = raw(service, data, path)
    elapsed = time.monotonic() - t0
    assert r.status_code == status, r.text
    assert r.json()["error"] == message
    assert elapsed < within_s, elapsed


def test_many_bad_items_answer_fast_and_small(service):
    """Found by a user: 800,000 bad ids took 20 s (stalling the gateway) and returned a 70 MB
    error. Now the first 10 errors are reported with the total."""
    body = json.dumps({"ids": ["x"] * 200_000})
    t0 = time.monotonic()
    r = raw(service, body)
    elapsed = time.monotonic() - t0
    assert r.status_code == 422
    assert "(200000 errors; the first 10 in detail)" in r.json()["error"]
    assert len(r.json()["detail"]) == 10 and len(r.content) < 5000
    assert elapsed < 5, elapsed


@pytest.mark.sharing  # counts, no timing
def test_every_refusal_of_a_classify_request_is_counted(service):
    """Found by a user: refusals by the middleware, the JSON parser, schema validation and the
    router were missing from requests_total (and /v1/stats). Each one counts once, as
    variant "none"; requests to other paths do not count."""
    text0 = settled_metrics(service)
    assert send_refusals(service.client) == [status for status, *_ in REFUSALS]

    def counted():
        text = service.metrics_text()
        return {st: delta(text, text0, "ray_mita_serve_requests_total", variant="none",
                          status=str(st)) for st in REFUSALS_COUNTED}
    got = wait_for(lambda: (lambda g: g if g == REFUSALS_COUNTED else None)(counted()),
                   timeout_s=20)
    assert got == REFUSALS_COUNTED, counted()


def test_body_limit_change_applies_without_restart(service, serve_reset):
    """The middleware used to keep a pickled copy of the limit: a new max_body_bytes in the
    user_config never reached it."""
    body = json.dumps({"ids": [3] * 1500})  # 4.5 KB
    assert raw(service, body).status_code == 200
    set_gateway(service, max_body_bytes=2048)
    r = raw(service, body)
    set_gateway(service)
    assert r.status_code == 413
    assert r.json()["error"] == f"request body of {len(body)} bytes exceeds the limit of 2048 bytes"
    assert raw(service, body).status_code == 200


def test_routing_before_body_checks_and_no_redirects(service):
    c = service.client
    r = c.post("/nope", content=b"x")  # no JSON content type: still a 404, not a 415
    assert r.status_code == 404 and r.json() == {"error": "Not Found"}
    r = c.post("/healthz", content=b"x")
    assert r.status_code == 405 and r.json() == {"error": "Method Not Allowed"}
    r = c.post("/v1/classify/", json={"text": "[MAX 2 3 ]"}, headers={"host": "evil.example"})
    assert r.status_code == 404 and "location" not in r.headers  # no Host-built redirect
    assert c.get("/redoc").status_code == 404  # ReDoc would load its script from a CDN


def test_size_limits_and_max_n(service):
    max_n = 16384
    ten_mb = b'{"ids": [' + b"3," * (5 * 1024 * 1024) + b"3]}"
    assert len(ten_mb) > 10 * 1024 * 1024
    r = raw(service, ten_mb)
    assert r.status_code == 413 and "exceeds the limit" in r.json()["error"]
    ids = encode(generate_long(max_n, seed=3)[0])
    assert len(ids) == max_n
    r = service.post("/v1/classify", json={"ids": ids, "variant": "mita"})
    assert r.status_code == 200 and r.json()["n"] == max_n
    r = service.post("/v1/classify", json={"ids": ids + [3], "variant": "mita"})
    assert r.status_code == 422
    assert r.json()["error"] == f"sequence length N = {max_n + 1} exceeds max_n = {max_n}"
    r = raw(service, json.dumps({"items": [{"ids": ids + [3]}]}), "/v1/classify/batch")
    assert r.status_code == 422 and r.json()["error"].startswith("items[0]: sequence length")


def post_with(service, body: bytes, content_type: str, path="/v1/classify") -> httpx.Response:
    return service.client.post(path, content=body, headers={"content-type": content_type})


def test_a_declared_charset_is_honoured_or_refused(service):
    """A latin-1 body was read as UTF-8: 'é' (0xE9) then broke the JSON (400 "malformed JSON
    body") instead of being the unknown token it is."""
    body = '{"text": "[MAX 2 é ]"}'.encode("latin-1")
    r = post_with(service, body, "application/json; charset=ISO-8859-1")
    assert r.status_code == 422, r.text
    assert "unknown token 'é'" in r.json()["error"]
    ok = '{"text": "[MAX 2 [MIN 4 7 ] 0 ]"}'
    expected = post_with(service, ok.encode(), "application/json").json()["label"]
    for charset in ("utf-16", '"latin-1"', "UTF-8", "us-ascii"):
        r = post_with(service, ok.encode(charset.strip('"')),
                      f"application/json; charset={charset}")
        assert (r.status_code, r.json()["label"]) == (200, expected), (charset, r.text)
    r = post_with(service, ok.encode(), "application/json; charset=klingon")
    assert r.status_code == 415
    assert r.json()["error"].startswith("charset 'klingon' is not a text encoding this service "
                                        "knows")
    r = post_with(service, ok.encode(), "application/json; charset=rot13")  # not text→text
    assert r.status_code == 415
    r = post_with(service, "é".encode("latin-1"), "application/json; charset=utf-8")
    assert r.status_code == 400
    assert "the body is not valid utf-8: byte 0xe9 at line 1, column 1" in r.json()["error"]


def test_surrogate_bytes_are_the_400_of_any_invalid_utf8(service):
    """Issue 62: CESU-8 surrogate bytes were a 422 about '\\ud800', other invalid UTF-8 a
    400: both are now the 400 naming the byte and column, with or without a charset."""
    for content_type in ("application/json", "application/json; charset=utf-8"):
        for body, byte, column in ((b'{"text": "[MAX 2 \xed\xa0\x80 ]"}', "0xed", 18),
                                   (b'{"text": "[MAX 2 \xff ]"}', "0xff", 18)):
            r = post_with(service, body, content_type)
            assert r.status_code == 400, r.text
            assert f"byte {byte} at line 1, column {column}" in r.json()["error"], r.text
