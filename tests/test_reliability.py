"""Reliability and security of the real service (Ray Serve on loopback, in this process):
fuzzed API, nasty bodies, overload, replica failure, timeouts, safe defaults, determinism."""

from __future__ import annotations

import asyncio
import copy
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest
import ray
import schemathesis
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.specs.openapi.checks import positive_data_acceptance

from loadtest.engine import LoadConfig, run_load
from mita.data.listops import encode, generate_long
from service import launch

from .conftest import CHECKPOINT, counter, set_gateway, wait_for
from .helpers import REFUSALS, REFUSALS_COUNTED, send_refusals

pytestmark = pytest.mark.service
ROOT = Path(__file__).resolve().parent.parent


def settled_metrics(service) -> str:
    """Metrics text once earlier requests have been exported (two equal reads 1.5 s apart):
    Ray exports every 0.5 s in tests, so a fresh snapshot can still miss the last test's."""
    text = service.metrics_text()
    for _ in range(20):
        time.sleep(1.5)
        again = service.metrics_text()
        if counter(again, "ray_mita_serve_requests_total") == counter(
                text, "ray_mita_serve_requests_total"):
            return again
        text = again
    return text


def save_report(name: str, report: dict) -> None:
    """Numbers for the issue note: printed, and kept in test-artifacts/ (gitignored)."""
    print(f"{name}: {report}")
    out = ROOT / "test-artifacts"
    out.mkdir(exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(report, indent=1) + "\n")


def delta(text: str, text0: str, name: str, **labels) -> float:
    """How much ``counter`` grew from exposition ``text0`` to ``text``."""
    return counter(text, name, **labels) - counter(text0, name, **labels)


# ---------------------------------------------------------------------------------------------
# Fuzzing: schemathesis against the service's own OpenAPI schema.

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
    ('{"ids": null, "text": null}', 422, "exactly one of 'text' or 'ids'"),
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


def test_body_limit_change_applies_without_restart(service):
    """The middleware used to keep a pickled copy of the limit: a new max_body_bytes in the
    user_config never reached it."""
    body = json.dumps({"ids": [3] * 1500})  # 4.5 KB
    assert raw(service, body).status_code == 200
    set_gateway(service, max_body_bytes=2048)
    try:
        r = raw(service, body)
    finally:
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


# ---------------------------------------------------------------------------------------------
# Timeouts.

def test_request_timeout_gives_504(service):
    ids = encode(generate_long(16384, seed=4)[0])  # ~1 s of CPU per forward
    set_gateway(service, request_timeout_s=0.05)
    try:
        r = service.post("/v1/classify", json={"ids": ids, "variant": "dense"})
    finally:
        set_gateway(service)
    assert r.status_code == 504, r.text
    assert r.json()["error"] == "the dense classifier did not answer within 0.05 s"
    assert service.post("/v1/classify", json={"ids": ids[:100]}).status_code == 200


# ---------------------------------------------------------------------------------------------
# Safe defaults.

def listening(port: int) -> set[str]:
    return {c.laddr.ip for c in psutil.net_connections(kind="inet")
            if c.status == psutil.CONN_LISTEN and c.laddr.port == port}


def test_http_and_metrics_bind_to_loopback_no_dashboard(service):
    http_port = int(service.url.rsplit(":", 1)[1])
    metrics_port = int(service.metrics_url.split(":")[2].split("/")[0])
    assert listening(http_port) == {"127.0.0.1"}
    assert listening(metrics_port) == {"127.0.0.1"}
    assert listening(8265) == set()  # Ray's dashboard port: not started by default


def test_tampered_checkpoint_refuses_to_start(tmp_path):
    bad = tmp_path / "ckpt"
    shutil.copytree(ROOT / CHECKPOINT, bad)
    weights = bytearray((bad / "model.safetensors").read_bytes())
    weights[-1] ^= 1  # one flipped bit in the last tensor
    (bad / "model.safetensors").write_bytes(bytes(weights))
    config = (ROOT / "deploy" / "serve_config.yaml").read_text().replace(
        "checkpoint: checkpoints/listops-default", f"checkpoint: {bad}")
    (tmp_path / "serve.yaml").write_text(config)
    t0 = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "service", "--config",
                           str(tmp_path / "serve.yaml")], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 1
    assert "refusing to start" in done.stderr and "does not match" in done.stderr
    assert "SHA-256" in done.stderr
    assert time.monotonic() - t0 < 60  # before Ray starts


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
# Determinism: same request, same variant → bit-identical probabilities, also in batches.

def test_same_request_bit_identical_under_concurrent_batching(service):
    probe = encode(generate_long(700, seed=11)[0])
    others = [encode(generate_long(n, seed=20 + n)[0]) for n in (90, 350, 700, 1500, 2900)]

    async def go(variant):
        async with httpx.AsyncClient(base_url=service.url, timeout=120) as c:
            alone = [await c.post("/v1/classify", json={"ids": probe, "variant": variant})
                     for _ in range(2)]
            bodies = [{"ids": probe, "variant": variant}] * 6 + [
                {"ids": o, "variant": variant} for o in others * 3]
            mixed = await asyncio.gather(*(c.post("/v1/classify", json=b) for b in bodies))
            return alone, mixed[:6]

    for variant in ("mita", "dense"):
        alone, loaded = asyncio.run(go(variant))
        reference = alone[0].json()["probabilities"]
        assert all(r.status_code == 200 for r in alone + loaded)
        for r in alone[1:] + loaded:
            assert r.json()["probabilities"] == reference  # exact float equality


# ---------------------------------------------------------------------------------------------
# Overload: ~4x capacity for a bounded time; back-pressure, counted as rejections.

def replica_ids(service) -> dict[str, str]:
    variants = service.client.get("/v1/models").json()["variants"]
    return {v: info["replica"] for v, info in variants.items()}


# Long enough that the model, not the HTTP path, is what runs out: at N = 256 a forward is so
# cheap that 4x its capacity also saturated the HTTP proxy and gateway on a 2-core CI box:
# 17 of 1,288 requests got no answer within the client's 60 s (and 553 of 1,314 here with
# the whole service pinned to one core).
OVERLOAD_N = 2048


def load(service, **kw):
    cfg = LoadConfig(url=service.url, ns=[OVERLOAD_N], variants=["dense"], warmup=0,
                     sequences_per_n=4, timeout_s=60, **kw)
    return asyncio.run(run_load(cfg))


def ok_rate(samples) -> float:
    ok = [s for s in samples if s.status == 200]
    wall = max(s.start_s + s.latency_s for s in samples) - min(s.start_s for s in samples)
    return len(ok) / wall


def test_overload_4x_capacity(service):
    before_ids = replica_ids(service)
    capacity = ok_rate(load(service, mode="closed", concurrency=8, requests=10_000,
                            duration_s=4))
    text0 = service.metrics_text()
    rate = 4 * capacity
    burst = load(service, mode="open", rate=rate, concurrency=512,
                 requests=int(rate * 8), duration_s=8)
    accepted = [s for s in burst if s.status == 200]
    rejected = [s for s in burst if s.status == 503]
    lost = [s for s in burst if s.status == 0]  # no HTTP answer reached the client
    OVERLOAD_REPORT.update(capacity_rps=capacity, offered_rps=rate, sent=len(burst),
                           accepted=len(accepted), rejected=len(rejected),
                           failed=len(burst) - len(accepted) - len(rejected),
                           transport_errors=sorted({s.error for s in lost}))
    save_report("overload", OVERLOAD_REPORT)
    answered = {s.status for s in burst if s.status}
    assert answered <= {200, 503}, {st: [s.status for s in burst].count(st) for st in answered}
    # Every HTTP answer is 200 or 503. A 2-core CI box once lost 5 of 1,033 answers in the
    # transport under this burst (status 0, error text not kept); the load tester now retries
    # failed connects and keeps connections alive, and any such loss must stay rare.
    assert len(lost) <= 0.01 * len(burst), [s.error for s in lost]
    assert rejected and accepted
    assert all("overloaded" in s.error for s in rejected)
    after = load(service, mode="closed", concurrency=8, requests=10_000, duration_s=4)
    assert all(s.status == 200 for s in after)
    assert ok_rate(after) > 0.5 * capacity  # back to normal (noisy 2-core machine: half)
    assert replica_ids(service) == before_ids  # no replica died (e.g. OOM-killed)

    def rejections_counted():
        text = service.metrics_text()
        got = delta(text, text0, "ray_mita_serve_rejections_total", variant="dense",
                    role="primary")
        errors = delta(text, text0, "ray_mita_serve_requests_total", status="503")
        return (got, errors) if got >= len(rejected) else None
    counted = wait_for(rejections_counted, timeout_s=20)
    assert counted is not None, "rejections never reached the metrics"
    got, errors = counted
    assert errors == 0  # rejections, not errors
    assert len(rejected) <= got <= len(rejected) + len(lost)  # a lost answer may be a 503


OVERLOAD_REPORT: dict = {}


def test_overloaded_shadow_does_not_fail_primary(service):
    """Primary dense (fast), shadow MiTA limited to one request in flight and one queued, the
    gateway's shadow cap lifted so that the classifier's back-pressure is what refuses: every
    primary answers 200; each shadow call is either compared or counted as a rejection with
    role=shadow."""
    overrides = copy.deepcopy(service.overrides)
    overrides["deployments"]["MiTAClassifier"].update(max_ongoing_requests=1,
                                                       max_queued_requests=1)
    gateway = next(d for d in launch.load_config(launch.CPU_CONFIG).applications[0].deployments
                   if d.name == "Gateway").user_config
    overrides["deployments"]["Gateway"]["user_config"] = {
        **gateway, "weights": {"mita": 0.0, "dense": 1.0}, "shadow": True,
        "shadow_max_inflight": 24}
    launch.deploy(launch.load_config(launch.CPU_CONFIG, overrides))  # both changes at once
    assert wait_for(lambda: service.client.get("/v1/models").json()["ab_policy"]["shadow"])
    ids = encode(generate_long(2048, seed=8)[0])
    text0 = service.metrics_text()

    async def burst():
        async with httpx.AsyncClient(base_url=service.url, timeout=120) as c:
            return await asyncio.gather(*(c.post("/v1/classify", json={"ids": ids})
                                          for _ in range(24)))
    try:
        responses = asyncio.run(burst())

        def shadow_outcomes():
            text = service.metrics_text()
            rej = delta(text, text0, "ray_mita_serve_rejections_total", variant="mita",
                        role="shadow")
            cmp = delta(text, text0, "ray_mita_serve_shadow_comparisons_total", primary="dense")
            return (rej, cmp) if rej + cmp == 24 else None
        outcome = wait_for(shadow_outcomes, timeout_s=60)
    finally:
        set_gateway(service)
        launch.deploy(launch.load_config(launch.CPU_CONFIG, service.overrides))
    assert [r.status_code for r in responses] == [200] * 24
    assert all(r.json()["variant"] == "dense" and r.json()["shadow"] == "mita"
               for r in responses)
    assert outcome is not None and outcome[0] >= 1 and outcome[1] >= 1, outcome


# ---------------------------------------------------------------------------------------------
# Replica failure: kill the MiTA classifier replica during a load run.

def test_replica_killed_mid_load(service):
    set_gateway(service, request_timeout_s=30)
    old = replica_ids(service)["mita"]
    name = next(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                if "MiTAClassifier" in a["name"] and old in a["name"])
    cfg = LoadConfig(url=service.url, ns=[1024], variants=["mita"], warmup=0, mode="closed",
                     concurrency=8, requests=100_000, duration_s=20, timeout_s=45)
    result: dict = {}

    def run():
        result["samples"] = asyncio.run(run_load(cfg))
    import threading
    thread = threading.Thread(target=run)
    thread.start()
    try:
        time.sleep(4)
        killed_at = time.monotonic()
        ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)

        def healthy_again():
            try:
                ids = replica_ids(service)
            except (httpx.HTTPError, KeyError, ValueError):
                return None
            return ids["mita"] != old and service.post(
                "/v1/classify", json={"ids": [3, 4, 5], "variant": "mita"}).status_code == 200
        assert wait_for(healthy_again, timeout_s=90, interval_s=0.25)
        recovery_s = time.monotonic() - killed_at
    finally:
        thread.join(timeout=120)
        set_gateway(service)
    samples = result["samples"]
    statuses = [s.status for s in samples]
    failed = [s for s in samples if s.status != 200]
    KILL_REPORT.update(sent=len(samples), ok=statuses.count(200), failed=len(failed),
                       failed_by_status={st: statuses.count(st) for st in set(statuses)
                                         if st != 200},
                       recovery_s=round(recovery_s, 1))
    save_report("replica_kill", KILL_REPORT)
    assert 0 not in statuses  # every request got an HTTP reply (no transport error/hang)
    assert set(statuses) <= {200, 503}, KILL_REPORT
    assert all("replica" in s.error for s in failed)  # explicit error naming the failure
    assert max(s.latency_s for s in samples) < 30 + 5  # nothing past the request timeout
    assert statuses.count(200) > 0 and samples[-1].status == 200
    assert recovery_s < 90


KILL_REPORT: dict = {}


def overflowing_checkpoint(dst: Path) -> Path:
    """The shipped checkpoint re-saved with finite but huge head rows (±3e38): the loader
    accepts it, and the logits overflow float32 to ±inf, so the probabilities are NaN."""
    from safetensors.torch import load_file, save_file

    import mita.model as M

    src = launch.PROJECT_ROOT / CHECKPOINT
    dst.mkdir()
    state = load_file(src / M.WEIGHTS_FILE)
    head = state["head.weight"].clone()
    head[3], head[4] = 3e38, -3e38
    save_file(state | {"head.weight": head}, dst / M.WEIGHTS_FILE)
    meta = json.loads((src / M.CONFIG_FILE).read_text())
    meta["weights_sha256"] = M._sha256(dst / M.WEIGHTS_FILE)
    (dst / M.CONFIG_FILE).write_text(json.dumps(meta))
    return dst


def test_non_finite_logits_answer_500_and_count_as_errors(service, tmp_path):
    """A forward whose logits are not finite is a JSON 500 (never a 200 with NaN
    probabilities), counted with status 500 in requests_total and in /v1/stats."""
    import torch

    from mita.model import load_checkpoint

    folder = overflowing_checkpoint(tmp_path / "overflow")
    ids = encode("[MAX 2 [MIN 4 7 ] 0 ]")
    with torch.no_grad():  # the precondition, on the plain model
        logits = load_checkpoint(folder, attention="dense")(torch.tensor([ids]))
    assert not torch.isfinite(logits).all()
    overrides = copy.deepcopy(service.overrides)
    overrides["args"] = {**overrides["args"], "checkpoint": str(folder)}
    launch.deploy(launch.load_config(launch.CPU_CONFIG, overrides))
    try:
        assert wait_for(lambda: "overflow@" in service.client.get("/v1/models").json()[
            "variants"]["dense"]["model_id"], timeout_s=90)
        text0 = service.metrics_text()
        r = service.post("/v1/classify", json={"ids": ids, "variant": "dense"})
        assert r.status_code == 500, r.text
        assert r.json()["error"] == ("the dense classifier failed: non-finite logits (NaN or "
                                     "infinity) from the model")
        assert wait_for(lambda: delta(service.metrics_text(), text0,
                                      "ray_mita_serve_requests_total", variant="dense",
                                      status="500") == 1, timeout_s=30)
        stats = service.client.get("/v1/stats").json()["requests"]
        assert any(c["variant"] == "dense" and c["status"] == "500" and c["count"] >= 1
                   for c in stats)
    finally:
        launch.deploy(launch.load_config(launch.CPU_CONFIG, service.overrides))
        assert wait_for(lambda: "overflow@" not in service.client.get("/v1/models").json()[
            "variants"]["dense"]["model_id"], timeout_s=90)


def own_instance(tmp_path, *args: str, route_prefix: str = "/"
                 ) -> tuple[subprocess.Popen, int, int]:
    """``python -m service`` on the shipped CPU config with the tests' fixed replicas, on free
    loopback ports, as a subprocess with its own Ray; ``args``: more flags (default: no Ray
    dashboard); ``route_prefix``: the application's. Returns (process, HTTP port, metrics
    port)."""
    from .conftest import TEST_OVERRIDES, free_port

    http_port, metrics_port = free_port(), free_port()
    config = yaml.safe_load((ROOT / "deploy" / "serve_config.yaml").read_text())
    config["http_options"]["port"] = http_port
    config["applications"][0]["route_prefix"] = route_prefix
    for dep in config["applications"][0]["deployments"]:
        for key, value in TEST_OVERRIDES["deployments"][dep["name"]].items():
            if key != "user_config":
                dep[key] = value
    (tmp_path / "serve.yaml").write_text(yaml.safe_dump(config))
    proc = subprocess.Popen([sys.executable, "-m", "service", "--config",
                             str(tmp_path / "serve.yaml"), "--metrics-port", str(metrics_port),
                             *(args or ("--dashboard-host", "off"))],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return proc, http_port, metrics_port


def test_ctrl_c_during_start_up_stops_ray_cleanly(tmp_path):
    """SIGINT while Ray starts (its metrics exporter is up, the deployments are not): one
    line, exit status 1, and no Ray process left holding the metrics port (a
    KeyboardInterrupt inside ray.init left Ray's agents running, and the next start was
    refused: "port ... is in use")."""
    import signal

    proc, http_port, metrics_port = own_instance(tmp_path)
    try:
        assert wait_for(lambda: listening(metrics_port), timeout_s=120, interval_s=0.1)
        assert not listening(http_port)  # still starting
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 1, out[-2000:]
    assert "mita-serve: stopping once start-up is done" in out, out[-2000:]
    assert out.rstrip().endswith("mita-serve: interrupted during start-up; stopped"), out[-2000:]
    assert "Traceback" not in out, out[-2000:]
    assert wait_for(lambda: not listening(metrics_port), timeout_s=20), "Ray left running"


def test_sigterm_drains_in_flight_requests(tmp_path):
    """SIGTERM to ``python -m service`` while 6 dense requests are in flight: every one is
    answered 200 (on main all failed after 0.2 s with "Server disconnected"), a request sent
    during the drain gets 503 with Retry-After, /healthz stays 200 and /readyz says not ready,
    and the process exits 0 once they are done — well before the 30 s drain time. Its own Ray
    instance, loopback ports, and the application under a route prefix (the drain counted 0
    requests in flight there and cut them)."""
    import signal

    proc, http_port, _ = own_instance(tmp_path, route_prefix="/m2")
    url = f"http://127.0.0.1:{http_port}/m2"
    try:
        def up():
            try:
                return httpx.get(f"{url}/readyz", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False
        assert wait_for(up, timeout_s=180), "service did not start"
        ids = encode(generate_long(16384, seed=4)[0])  # dense: ~1-2 s per forward here

        async def scenario():
            async with httpx.AsyncClient(base_url=url, timeout=120) as c:
                inflight = [asyncio.ensure_future(c.post("/v1/classify", json={
                    "ids": ids, "variant": "dense"})) for _ in range(6)]
                await asyncio.sleep(1.0)
                proc.send_signal(signal.SIGTERM)
                await asyncio.sleep(0.5)
                late = await c.post("/v1/classify", json={"ids": ids[:100]})
                health = await c.get("/healthz")
                ready = await c.get("/readyz")
                return await asyncio.gather(*inflight), late, health, ready
        answers, late, health, ready = asyncio.run(scenario())
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert [r.status_code for r in answers] == [200] * 6
    assert late.status_code == 503 and late.headers["retry-after"] == "1", late.text
    assert late.json()["error"] == "the service is shutting down; retry on another instance"
    assert health.status_code == 200 and ready.status_code == 503
    assert proc.returncode == 0, out[-2000:]
    assert "drained (0 request(s) still in flight)" in out, out[-2000:]
    assert "stopping once start-up is done" not in out  # said on every stop, once


def test_readiness_does_not_wait_behind_classify_work(service):
    """With the MiTA classifier busy (48 long requests: 16 running, the rest queued), /readyz
    answers 200 at once: it asks Serve's controller, not the classifiers (it called their
    info(), which queued behind the work)."""
    ids = encode(generate_long(16384, seed=6)[0])

    async def busy():
        async with httpx.AsyncClient(base_url=service.url, timeout=300) as c:
            work = [asyncio.ensure_future(c.post("/v1/classify", json={
                "ids": ids, "variant": "mita"})) for _ in range(48)]
            await asyncio.sleep(0.5)
            still_busy = sum(not w.done() for w in work)
            t0 = time.monotonic()
            ready = await c.get("/readyz")
            took = time.monotonic() - t0
            return ready, took, still_busy, await asyncio.gather(*work)
    ready, took, still_busy, answers = asyncio.run(busy())
    assert still_busy > 16  # the readiness call overlapped a full classifier queue
    assert ready.status_code == 200 and took < 2.0, (ready.text, took)
    assert all(r.status_code == 200 for r in answers)
