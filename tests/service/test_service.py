"""The real service: Ray Serve on loopback in this process, real ListOps over HTTP."""

from __future__ import annotations

import asyncio
import copy
import json
import math
import socket

import httpx
import pytest
import torch

from mita.data.listops import encode, generate_long
from mita.hooks import MITA_STAGES
from mita.model import load_checkpoint
from service import launch
from service.metrics import DURATION_BUCKETS_S, n_bucket

from ..helpers import (
    CHECKPOINT,
    EXAMPLES,
    delta,
    metric_families,
    set_classifier,
    set_gateway,
    wait_for,
)

# sharing: answers, counts and refusals, nothing timed: runs beside the tests/own_ray/
# tests instead of waiting for the cores lock (tests/lanes.py)
pytestmark = pytest.mark.sharing


def samples(text: str, name: str) -> dict[tuple, float]:
    """{(sample name, sorted labels): value} for one metric family in exposition text."""
    out = {}
    for fam in metric_families(text, name):
        for s in fam.samples:
            if s.name == name:
                labels = tuple(sorted((k, v) for k, v in s.labels.items()
                                      if k in ("variant", "stage", "n_bucket", "status",
                                               "primary", "agree", "le")))
                out[labels] = out.get(labels, 0.0) + s.value
    return out


def test_predictions_equal_in_process_model(service):
    models = {v: load_checkpoint(CHECKPOINT, attention=v) for v in ("mita", "dense")}
    for text, _ in EXAMPLES[:6]:
        ids = torch.tensor([encode(text)])
        for variant, model in models.items():
            r = service.post("/v1/classify", json={"text": text, "variant": variant})
            assert r.status_code == 200, r.text
            body = r.json()
            with torch.no_grad():
                probs = torch.softmax(model(ids, torch.zeros_like(ids, dtype=torch.bool))
                                      .double(), -1)[0]
            assert body["variant"] == variant and body["n"] == ids.shape[1]
            assert body["label"] == int(probs.argmax())
            # Same weights, same float32 forward; batching with other requests may change
            # BLAS blocking, so agree to 1e-6, not bit for bit.
            assert max(abs(a - b) for a, b in zip(body["probabilities"], probs.tolist(),
                                                  strict=True)) < 1e-6
            assert math.isclose(sum(body["probabilities"]), 1.0, abs_tol=1e-9)


def test_ids_input_and_profile(service):
    text, _ = EXAMPLES[0]
    r = service.post("/v1/classify", json={"ids": encode(text), "variant": "mita",
                                           "profile": True})
    assert r.status_code == 200, r.text
    prof = r.json()["profile"]
    depth = len(prof["layers_ms"])
    assert depth == 2
    assert list(prof["layers_ms"][0]) == ["qkv_proj", *MITA_STAGES, "out_proj", "ffn"]
    assert set(prof["stages_ms"]) == {"embed", "head", "qkv_proj", *MITA_STAGES,
                                      "out_proj", "ffn"}
    assert 0 < sum(prof["stages_ms"].values()) <= prof["total_ms"]
    assert prof["flops_total"] == sum(prof["flops"].values()) > 0
    assert prof["peak_memory_kind"] == "analytic_activation_estimate"
    assert "topk_path" not in prof  # null, left out: no Triton top-k on this CPU host
    # the same forward's time in the Server-Timing header, rounded to the header's 3 decimals
    assert r.headers["server-timing"] == f"forward;dur={prof['total_ms']:.3f}"
    r = service.post("/v1/classify", json={"ids": encode(text), "variant": "dense"})
    assert "profile" not in r.json()
    name, dur = r.headers["server-timing"].split(";dur=")
    assert name == "forward" and float(dur) > 0  # there without the profile too
    r = service.post("/v1/classify/binary?variant=mita&profile=true",
                     content=bytes(encode(text)),
                     headers={"content-type": "application/octet-stream"})
    assert r.status_code == 200, r.text
    assert r.headers["server-timing"] == f"forward;dur={r.json()['profile']['total_ms']:.3f}"


BAD = [
    ({"text": ""}, 422, "empty sequence"),
    ({"ids": []}, 422, "empty sequence"),
    ({"text": "[MAX 2 X ]"}, 422, "unknown token 'X' at position 2"),
    ({"ids": [3, 16]}, 422, "token id 16 at position 1 is out of range"),
    ({"ids": [3, 0]}, 422, "token id 0 at position 1"),
    ({"ids": [-1]}, 422, "token id -1"),
    ({"ids": [2**70]}, 422, "out of range"),
    ({"ids": [1.5]}, 422, "invalid request"),
    ({"ids": ["3"]}, 422, "invalid request"),
    ({"ids": [[3]]}, 422, "invalid request"),
    ({"text": "[MAX 2 3 ]", "ids": [3]}, 422, "exactly one of 'text' or 'ids'"),
    ({}, 422, "exactly one of 'text' or 'ids'"),
    ({"text": "[MAX 2 3 ]", "variant": "sparse"}, 422, "variant"),
    ({"text": "[MAX 2 3 ]", "colour": "red"}, 422, "colour"),
    ({"ids": [3] * 16385}, 422, "N = 16385 exceeds max_n = 16384"),
    ({"text": " ".join(["3"] * 40000)}, 422, "N = 40000 exceeds max_n = 16384"),
    ({"ids": [10**400]}, 422, "token id 100000000000000000000000000000…"),
    ({"text": "[MAX 2 3 ]", "profile": "yes"}, 422, "profile"),
]


@pytest.mark.parametrize("body,status,message", BAD)
def test_bad_input_gets_clear_4xx(service, body, status, message):
    r = service.post("/v1/classify", json=body)
    assert r.status_code == status, r.text
    assert message in r.json()["error"]


def test_malformed_json_oversized_body_and_batch_errors(service):
    r = service.client.post("/v1/classify", content=b'{"text": "[MAX 2',
                            headers={"content-type": "application/json"})
    assert r.status_code == 400 and "malformed JSON" in r.json()["error"]
    big = b'{"ids": [' + b"3," * (5 * 1024 * 1024 // 2) + b"3]}"
    r = service.client.post("/v1/classify", content=big,
                            headers={"content-type": "application/json"})
    assert r.status_code == 413 and "exceeds the limit" in r.json()["error"]
    r = service.post("/v1/classify/batch", json={"items": [{"text": "[MAX 2 3 ]"},
                                                           {"ids": [99]}]})
    assert r.status_code == 422 and r.json()["error"].startswith("items[1]: token id 99")
    r = service.post("/v1/classify/batch", json={"items": []})
    assert r.status_code == 422
    # Still answering after all that.
    r = service.post("/v1/classify", json={"text": EXAMPLES[1][0]})
    assert r.status_code == 200


def test_transport_level_errors_are_json(service):
    c = service.client
    r = c.post("/v1/classify", content=b'{"text": "[MAX 2 9 ]"}',
               headers={"content-type": "text/plain"})
    assert r.status_code == 415 and "application/json" in r.json()["error"]
    r = c.post("/v1/classify", content=iter([b'{"text": ', b'"[MAX 2 9 ]"}']),
               headers={"content-type": "application/json"})  # chunked, no Content-Length
    assert r.status_code == 411 and "Content-Length" in r.json()["error"]
    r = c.post("/v1/classify", content=b"", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "empty request body" in r.json()["error"]
    # No body at all (curl -X POST without -d): was 411 "chunked uploads are not accepted"
    host, port = service.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(b"POST /v1/classify HTTP/1.1\r\nHost: x\r\nContent-Type: "
                     b"application/json\r\nConnection: close\r\n\r\n")
        raw = b"".join(iter(lambda: sock.recv(65536), b""))
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 411"), raw[:300]
    assert json.loads(body)["error"] == ("the request has no body: send the JSON (or binary "
                                         "ids) with a Content-Length header")
    for path in ("/healthz", "/readyz"):  # HEAD was 405
        r = c.head(path)
        assert r.status_code == 200, (path, r.status_code)
    r = c.get("/nope")
    assert r.status_code == 404 and r.json() == {"error": "Not Found"}
    r = c.get("/v1/classify")
    assert r.status_code == 405 and r.json() == {"error": "Method Not Allowed"}


def test_lra_style_text_counts_real_tokens_only(service):
    # LRA's TSVs wrap the tree in "( … )" pairs; they are not tokens and must not count
    # towards max_n: 14,002 real tokens inside 42,002 whitespace-separated pieces.
    text = "( " * 14000 + "[MAX " + " ".join(["2 )"] * 14000) + " ]"
    r = service.post("/v1/classify", json={"text": text, "variant": "mita"})
    assert r.status_code == 200, r.text
    assert r.json()["n"] == 14002


def test_batch_endpoint_matches_single(service):
    items = [{"text": t, "variant": "dense"} for t, _ in EXAMPLES[:5]]
    r = service.post("/v1/classify/batch", json={"items": items})
    assert r.status_code == 200, r.text
    results = r.json()["results"]
    assert [x["n"] for x in results] == [len(encode(t)) for t, _ in EXAMPLES[:5]]
    for item, res in zip(items, results, strict=True):
        single = service.post("/v1/classify", json=item).json()
        assert single["label"] == res["label"]
        assert max(abs(a - b) for a, b in zip(single["probabilities"], res["probabilities"],
                                              strict=True)) < 1e-6


def test_padded_batching_end_to_end(service, serve_reset):
    """``deterministic: false`` (classifier user_config) through HTTP: ``@serve.batch`` groups
    concurrent requests, the engine pads each power-of-two length group into one forward.
    Answers equal the one-forward-per-sequence answers to 1e-5 (padding changes BLAS blocking;
    the engine test measured 3e-7), and some forward served several requests."""
    texts = [t for t, _ in EXAMPLES[:8]] * 3  # 24 at once: a queue forms behind a forward
    lengths = sorted(len(encode(t)) for t in texts)
    assert len({(n - 1).bit_length() for n in lengths}) < len(lengths)  # a group can form

    def batch(variant):
        r = service.post("/v1/classify/batch", json={"items": [
            {"text": t, "variant": variant, "profile": True} for t in texts]})
        assert r.status_code == 200, r.text
        return r.json()["results"]
    solo = {v: batch(v) for v in ("mita", "dense")}
    assert all(x["profile"]["batch_size"] == 1 for v in solo for x in solo[v])
    # set_classifier redeploys from the session's overrides: one classifier at a time (the
    # next call puts the previous one back, serve_reset the last).
    for v, name in (("mita", "MiTAClassifier"), ("dense", "DenseClassifier")):
        set_classifier(service, name, deterministic=False)
        for _ in range(3):  # @serve.batch must catch two requests of one length group
            padded = batch(v)
            if max(x["profile"]["batch_size"] for x in padded) > 1:
                break
        sizes = [x["profile"]["batch_size"] for x in padded]
        assert max(sizes) > 1, sizes
        grouped = [x for x in padded if x["profile"]["batch_size"] > 1]
        assert all(x["profile"]["padded_n"] >= x["n"] for x in grouped)
        assert any(x["profile"]["padded_n"] > x["n"] for x in grouped)  # really padded
        for a, b in zip(solo[v], padded, strict=True):
            assert a["n"] == b["n"] and a["label"] == b["label"]
            assert max(abs(x - y) for x, y in zip(a["probabilities"], b["probabilities"],
                                                  strict=True)) < 1e-5


def test_models_health_ready(service):
    m = service.client.get("/v1/models").json()
    assert set(m["variants"]) == {"mita", "dense"}
    mita = m["variants"]["mita"]["config"]
    assert (mita["attention"], mita["num_landmarks"], mita["topk"]) == ("mita", 16, 16)
    assert m["variants"]["dense"]["model_id"] == m["variants"]["mita"]["model_id"]
    # CPU host: MiTA serves on the CPU kernels (staged forwards: the PyTorch stages), so no
    # forward of its replica reaches the Triton top-k chooser
    assert m["variants"]["mita"]["topk"] == {"triton": False, "forced": None, "decisions": []}
    assert m["variants"]["dense"]["topk"] is None
    assert service.client.get("/healthz").json() == {"status": "ok"}
    assert service.client.get("/readyz").status_code == 200
    spec = service.client.get("/openapi.json").json()
    assert {"/v1/classify", "/v1/classify/batch", "/v1/models"} <= set(spec["paths"])


def _fire(service, bodies, headers_list):
    async def go():
        async with httpx.AsyncClient(base_url=service.url, timeout=120) as c:
            sem = asyncio.Semaphore(16)

            async def one(body, headers):
                async with sem:
                    return await c.post("/v1/classify", json=body, headers=headers)
            return await asyncio.gather(*(one(b, h) for b, h in
                                          zip(bodies, headers_list, strict=True)))
    responses = asyncio.run(go())
    for r in responses:
        assert r.status_code == 200, r.text
    return [r.json() for r in responses]


def test_ab_split_stickiness_and_shadow(service, serve_reset):
    short = "[MAX 2 [MIN 4 7 ] 0 ]"
    set_gateway(service, weights={"mita": 0.7, "dense": 0.3})
    n = 240
    got = _fire(service, [{"text": short}] * n, [{}] * n)
    mita = sum(r["variant"] == "mita" for r in got)
    sd = math.sqrt(n * 0.7 * 0.3)
    assert abs(mita - 0.7 * n) <= 4 * sd, mita  # binomial bound, 4 standard deviations

    keys = [f"client-{i}" for i in range(12)]
    got = _fire(service, [{"text": short}] * 60, [{"x-client-key": keys[i % 12]}
                                                   for i in range(60)])
    by_key: dict[str, set] = {}
    for i, r in enumerate(got):
        by_key.setdefault(keys[i % 12], set()).add(r["variant"])
    assert all(len(v) == 1 for v in by_key.values())
    assert {next(iter(v)) for v in by_key.values()} == {"mita", "dense"}
    got = _fire(service, [{"text": short, "variant": "dense"}] * 10,
                [{"x-client-key": keys[0]}] * 10)
    assert {r["variant"] for r in got} == {"dense"}  # explicit override beats stickiness

    comparisons_total = "ray_mita_serve_shadow_comparisons_total"
    text0 = service.metrics_text()
    # Room for every shadow call of the burst (the default cap of 2 in flight sheds most of
    # them: tests/service/test_shadow_load.py), so each request is compared.
    set_gateway(service, weights={"mita": 1.0, "dense": 0.0}, shadow=True,
                shadow_max_inflight=len(EXAMPLES))
    texts = [t for t, _ in EXAMPLES]
    got = _fire(service, [{"text": t} for t in texts], [{}] * len(texts))
    assert all(r["variant"] == "mita" and r["shadow"] == "dense" for r in got)
    models = {v: load_checkpoint(CHECKPOINT, attention=v) for v in ("mita", "dense")}
    agree = 0
    for t in texts:
        ids = torch.tensor([encode(t)])
        with torch.no_grad():
            agree += int(models["mita"](ids).argmax() == models["dense"](ids).argmax())

    def comparisons():  # per series (a replaced gateway's leave /metrics: helpers.delta)
        text = service.metrics_text()
        got = {a: delta(text, text0, comparisons_total, agree=a, primary="mita")
               for a in ("true", "false")}
        return got if sum(got.values()) == len(texts) else None
    got = wait_for(comparisons)
    assert got, "shadow comparisons never reached the metrics endpoint"
    assert got["true"] == agree


def stage_counts(service, stage: str) -> dict[str, float]:
    text = service.metrics_text()
    got = {"mita": 0.0, "dense": 0.0}
    for k, v in samples(text, "ray_mita_serve_stage_duration_seconds_count").items():
        labels = dict(k)
        if labels["stage"] == stage:
            got[labels["variant"]] += v
    return got


def test_metrics_counts_match_requests(service):
    """Deltas, so the test holds whatever ran before it in the session."""
    def settled(expected):
        return lambda: stage_counts(service, "embed") == expected or None
    before = stage_counts(service, "embed")
    wait_for(settled(before), 5)  # let earlier requests' metrics land first
    before = stage_counts(service, "embed")
    pool_before = stage_counts(service, "pool")
    refused_before = samples(service.metrics_text(), "ray_mita_serve_requests_total").get(
        (("status", "422"), ("variant", "none")), 0)
    flops_before = samples(service.metrics_text(), "ray_mita_serve_flops_total")
    sent = {"mita": 4, "dense": 3}
    flops = {"mita": 0.0, "dense": 0.0}
    for variant, count in sent.items():
        for text, _ in EXAMPLES[:count]:
            r = service.post("/v1/classify", json={"text": text, "variant": variant,
                                                   "profile": True})
            assert r.status_code == 200
            flops[variant] += r.json()["profile"]["flops_total"] / r.json()["profile"][
                "batch_size"]
    for body, status, _ in BAD:
        assert service.post("/v1/classify", json=body).status_code == status
    expected = {v: before[v] + sent[v] for v in sent}
    got = wait_for(settled(expected))
    assert got, (stage_counts(service, "embed"), expected)
    pool = stage_counts(service, "pool")
    assert pool["mita"] - pool_before["mita"] == sent["mita"] and pool["dense"] == 0
    text = service.metrics_text()
    buckets = {dict(k)["le"] for k in samples(text, "ray_mita_serve_stage_duration_seconds_bucket")}
    assert len(buckets) == len(DURATION_BUCKETS_S) + 1
    # Every BAD body counts once as a refusal, whether the schema or the gateway's own checks
    # refused it.
    n_bad = sum(status == 422 for _, status, _ in BAD)
    assert n_bad == 18
    refused = wait_for(lambda: samples(service.metrics_text(), "ray_mita_serve_requests_total")
                       .get((("status", "422"), ("variant", "none")), 0) - refused_before
                       == n_bad or None)
    assert refused
    tokens = samples(text, "ray_mita_serve_tokens_total")
    assert sum(tokens.values()) > 0
    # FLOPs: each answer's share of its forward, as the responses reported them (the
    # gateway's recorder adds the same floats; 1e-9 relative: summation order).
    def flops_delta():
        after = samples(service.metrics_text(), "ray_mita_serve_flops_total")
        return {v: after.get((("variant", v),), 0.0) - flops_before.get((("variant", v),), 0.0)
                for v in sent}
    wait_for(lambda: flops_delta() == pytest.approx(flops, rel=1e-9) or None, 10)
    assert flops_delta() == pytest.approx(flops, rel=1e-9)


def test_overload_gets_503_with_retry_after(service):
    """A classifier with one request in flight and one queued: a burst of concurrent requests
    sees 503 + Retry-After for the excess (max_queued_requests), the rest succeed, and the
    service answers normally afterwards."""
    overrides = copy.deepcopy(service.overrides)
    overrides["deployments"]["DenseClassifier"].update(max_ongoing_requests=1,
                                                       max_queued_requests=1)
    launch.deploy(launch.load_config(launch.CPU_CONFIG, overrides))
    text, _ = generate_long(2048, seed=5)

    async def burst():
        async with httpx.AsyncClient(base_url=service.url, timeout=120) as c:
            return await asyncio.gather(*(c.post("/v1/classify", json={
                "text": text, "variant": "dense"}) for _ in range(24)))
    try:
        responses = asyncio.run(burst())
    finally:
        launch.deploy(launch.load_config(launch.CPU_CONFIG, service.overrides))
    codes = [r.status_code for r in responses]
    rejected = [r for r in responses if r.status_code == 503]
    assert set(codes) <= {200, 503} and codes.count(200) >= 2, codes
    assert rejected, "no request was rejected by back-pressure"
    assert rejected[0].headers["retry-after"] == "1"
    assert "overloaded" in rejected[0].json()["error"]
    assert service.post("/v1/classify", json={"text": text, "variant": "dense"}
                        ).status_code == 200


def test_fused_mita_with_sampled_and_requested_staged_profiles(service, serve_reset):
    """The shipped CPU config runs MiTA on the compiled CPU kernels (fused stages). Stage
    metrics come from staged forwards only: one forward in staged_profile_every, or one asked
    for with "profile": "staged" — all seven stages timed apart — so a stage name always means
    the same work. Forward metrics count every forward."""
    set_classifier(service, staged_profile_every=0)
    ids = encode(EXAMPLES[2][0])
    before = service.metrics_text()
    r = service.post("/v1/classify", json={"ids": ids, "variant": "mita", "profile": True})
    prof = r.json()["profile"]
    assert r.status_code == 200 and prof["staged"] is False
    assert "topk" not in prof["stages_ms"] and "landmark_scores" in prof["stages_ms"]
    r2 = service.post("/v1/classify", json={"ids": ids, "variant": "mita",
                                            "profile": "staged"})
    prof2 = r2.json()["profile"]
    assert prof2["staged"] is True and set(MITA_STAGES) <= set(prof2["stages_ms"])
    assert r2.json()["label"] == r.json()["label"]
    assert max(abs(a - b) for a, b in zip(r.json()["probabilities"],
                                          r2.json()["probabilities"], strict=True)) < 1e-5
    bucket = n_bucket(len(ids))

    def counts():
        s = samples(service.metrics_text(), "ray_mita_serve_stage_duration_seconds_count")
        f = samples(service.metrics_text(), "ray_mita_serve_forward_duration_seconds_count")
        b0 = samples(before, "ray_mita_serve_stage_duration_seconds_count")
        f0 = samples(before, "ray_mita_serve_forward_duration_seconds_count")
        stage = {dict(k)["stage"]: v - b0.get(k, 0.0) for k, v in s.items()
                 if dict(k)["variant"] == "mita" and dict(k)["n_bucket"] == bucket}
        fwd = sum(v - f0.get(k, 0.0) for k, v in f.items()
                  if dict(k)["variant"] == "mita" and dict(k)["n_bucket"] == bucket)
        return stage, fwd
    want = {s: 1.0 for s in prof2["stages_ms"]}
    got = wait_for(lambda: (lambda c: c if c[0] == want and c[1] == 2 else None)(counts()),
                   timeout_s=20)
    assert got, counts()  # two forwards, stage records from the staged one only
    bad = service.post("/v1/classify", json={"ids": ids, "profile": "yes"})
    assert bad.status_code == 422
    r3 = service.client.post("/v1/classify/binary", content=bytes(ids),
                             params={"variant": "mita", "profile": "staged"},
                             headers={"content-type": "application/octet-stream"})
    assert r3.status_code == 200 and r3.json()["profile"]["staged"] is True


def test_classifier_replicas_as_the_controller_reports_them(service):
    """The gateway's view of its classifiers (what /readyz uses), from the
    running controller's own details: one serving replica each (num_replicas 1 here)."""
    from ray.serve.context import _get_global_client

    from service.replicas import classifier_replicas

    one = {"serving": 1, "stopping": 0, "scales_to_zero": False}
    details = _get_global_client().get_serve_details()
    assert classifier_replicas(details, "mita-serve") == {"mita": one, "dense": one}
