"""Reliability of the real service (Ray Serve on loopback, in this process): timeouts,
determinism, overload, replica failure, non-finite logits, readiness behind classify work."""

from __future__ import annotations

import asyncio
import copy
import json
import math
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import ray

from loadtest.engine import LoadConfig, run_load
from mita.data.listops import encode, generate_long
from service import launch, metrics, proxy_guard

from ..helpers import CHECKPOINT, CounterHighs, delta, set_gateway, wait_for

ROOT = Path(__file__).resolve().parents[2]


def save_report(name: str, report: dict) -> None:
    """Numbers for the issue note: printed, and kept in test-artifacts/ (gitignored)."""
    print(f"{name}: {report}")
    out = ROOT / "test-artifacts"
    out.mkdir(exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(report, indent=1) + "\n")


# ---------------------------------------------------------------------------------------------
# Timeouts.

def test_request_timeout_gives_504(service, serve_reset):
    ids = encode(generate_long(16384, seed=4)[0])  # ~1 s of CPU per forward
    set_gateway(service, request_timeout_s=0.05)
    r = service.post("/v1/classify", json={"ids": ids, "variant": "dense"})
    set_gateway(service)
    assert r.status_code == 504, r.text
    assert r.json()["error"] == "the dense classifier did not answer within 0.05 s"
    assert service.post("/v1/classify", json={"ids": ids[:100]}).status_code == 200


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


@pytest.mark.sharing  # counts outcomes, times nothing
def test_overloaded_shadow_does_not_fail_primary(service):
    """Primary dense (padded batching), shadow MiTA limited to one request in flight and one
    queued, the gateway's shadow cap lifted so that the classifier's back-pressure is what
    refuses: every primary answers 200; each shadow call is either compared or counted as a
    rejection with role=shadow."""
    overrides = copy.deepcopy(service.overrides)
    overrides["deployments"]["MiTAClassifier"].update(max_ongoing_requests=1,
                                                       max_queued_requests=1)
    # Dense primaries of one padded batch answer together, so their shadows reach MiTA at
    # once (one forward per request would answer, and start the shadows, one by one).
    overrides["deployments"]["DenseClassifier"]["user_config"] = {
        **overrides["deployments"]["DenseClassifier"].get("user_config", {}),
        "deterministic": False, "batch_wait_timeout_s": 0.05}
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

def kill_mid_load(cfg: LoadConfig, actor: str, back) -> tuple[list, float, float]:
    """Run ``cfg``'s load in a thread, kill the Serve actor ``actor`` (as SIGKILL:
    ``ray.kill``) 4 s in, wait until ``back()`` is true: (the load's samples, the monotonic
    time of the kill, seconds until ``back``)."""
    import threading

    result: dict = {}
    thread = threading.Thread(target=lambda: result.update(samples=asyncio.run(run_load(cfg))))
    thread.start()
    try:
        time.sleep(4)
        killed_at = time.monotonic()
        ray.kill(ray.get_actor(actor, namespace="serve"), no_restart=True)
        assert wait_for(back, timeout_s=90, interval_s=0.25)
        recovery_s = time.monotonic() - killed_at
    finally:
        thread.join(timeout=180)
    return result["samples"], killed_at, recovery_s


def test_replica_killed_mid_load(service, serve_reset):
    """The only MiTA replica is killed under a closed loop of 8: the requests it held are sent
    again by the gateway (counted in retries_total) and answered once Serve's replacement
    runs, so none fails (on main 23 of 1,148 got a 503), none waits past the deadline.
    N = 8,192 makes the replica the loop's bottleneck (a MiTA forward of ~25 ms on one core
    against a few ms of HTTP and gateway work), so requests wait in it when it dies: at
    N = 1,024 (~3 ms) it was often empty, and a clean-clone CI run killed it holding none
    (1,125 answered, no resend to count)."""
    set_gateway(service, request_timeout_s=30)
    old = replica_ids(service)["mita"]
    name = next(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                if "MiTAClassifier" in a["name"] and old in a["name"])
    cfg = LoadConfig(url=service.url, ns=[8192], variants=["mita"], warmup=0, mode="closed",
                     concurrency=8, requests=100_000, duration_s=20, timeout_s=45)
    text0 = service.metrics_text()

    def healthy_again():
        try:
            ids = replica_ids(service)
        except (httpx.HTTPError, KeyError, ValueError):
            return None
        return ids["mita"] != old and service.post(
            "/v1/classify", json={"ids": [3, 4, 5], "variant": "mita"}).status_code == 200
    samples, _, recovery_s = kill_mid_load(cfg, name, healthy_again)
    statuses = [s.status for s in samples]
    latencies = np.array([s.latency_s for s in samples])

    def retries():
        text = service.metrics_text()
        return sum(delta(text, text0, "ray_mita_serve_retries_total", variant="mita",
                         reason=r) for r in ("replica_died", "replica_unavailable")) or None
    counted = wait_for(retries, timeout_s=20)
    KILL_REPORT.update(sent=len(samples), ok=statuses.count(200),
                       failed=len(samples) - statuses.count(200),
                       failed_by_status={st: statuses.count(st) for st in set(statuses)
                                         if st != 200},
                       retries=counted, recovery_s=round(recovery_s, 1),
                       p50_s=round(float(np.percentile(latencies, 50)), 3),
                       p99_s=round(float(np.percentile(latencies, 99)), 3),
                       max_s=round(float(latencies.max()), 2))
    save_report("replica_kill", KILL_REPORT)
    assert statuses == [200] * len(samples), KILL_REPORT  # nothing lost to the death
    assert counted is not None and counted >= 1, KILL_REPORT  # the resends were counted
    assert latencies.max() < 30 + 5  # nothing past the request timeout
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


@pytest.mark.sharing  # statuses and counts, no timing
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


# ---------------------------------------------------------------------------------------------
# Gateway failure: kill the only Gateway replica during a load run (issue 62).

def test_gateway_killed_mid_load(service, serve_reset):
    """The Gateway replica is killed (as SIGKILL: ``ray.kill``) under a closed loop of 8: the
    requests it held got uvicorn's plain-text 500, counted nowhere (6 and 5 in two runs on
    main). The HTTP proxy now resends them (``proxy_guard.ResendLost``); Serve holds the
    resends until the replacement runs (health_check_period_s 2), so none fails, each resend
    answered is counted in proxy_resends_total{outcome="answered"}, and none gave up.
    N = 8,192 keeps the gateway holding requests (waiting on ~25-100 ms forwards) when it
    dies. The dead replica's answers stay counted, and its counter series leave /metrics
    within ``metrics.DEAD_SERIES_S`` (they stayed for good as Ray's own counters)."""
    gateways = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                if "#Gateway#" in a["name"]]
    assert len(gateways) == 1, gateways
    cfg = LoadConfig(url=service.url, ns=[8192], variants=["mita"], warmup=0, mode="closed",
                     concurrency=8, requests=100_000, duration_s=12, timeout_s=60)
    time.sleep(metrics.EXPORT_INTERVAL_S + 1)  # earlier tests' counts exported first
    text0 = service.metrics_text()

    def replaced():
        names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                 if "#Gateway#" in a["name"]]
        return names and gateways[0] not in names and service.post(
            "/v1/classify", json={"ids": [3, 4, 5], "variant": "dense"}).status_code == 200
    dead = gateways[0].rsplit("#", 1)[1]  # the replica tag of its series
    assert dead in text0  # the string its series carry, before the kill

    def dead_series_gone(text):  # the service's counters (its histograms and Serve's own stay)
        return not any(line.startswith("ray_mita_serve_") and "_total{" in line
                       and dead in line for line in text.splitlines())
    # Read by a poller from before the kill on: the dead replica's series leave /metrics
    # DEAD_SERIES_S after the kill, and one read after a slow recovery on 2 busy cores missed
    # them (a CI run read its answers as -7, and their leaving 31.8 s after the kill)
    with CounterHighs(service.metrics_text, "ray_mita_serve_requests_total",
                      variant="mita", status="200") as answers:
        answers.track("dead series gone", dead_series_gone)
        samples, killed_at, recovery_s = kill_mid_load(cfg, gateways[0], replaced)
        statuses = [s.status for s in samples]
        latencies = np.array([s.latency_s for s in samples])

        def resent():
            text = service.metrics_text()
            answered = delta(text, text0, "ray_mita_serve_proxy_resends_total",
                             outcome="answered")
            return (answered, delta(text, text0, "ray_mita_serve_proxy_resends_total",
                                    outcome="gave_up")) if answered else None
        counted = wait_for(resent, timeout_s=10)

        # The answers counted by both replicas, the dead one's included (the probes above
        # went to dense): all of the load's 200s but what the dead replica counted in its last
        # export window (EXPORT_INTERVAL_S + the suite's 0.5 s Ray export interval) before the
        # SIGKILL; allowed: the answers of two such windows at the load's mean rate. Measured:
        # 0 of 114, 4 of 137 and 9 of 134 lost (22 allowed in the last).
        seen = []

        def mita_ok():
            seen.append(answers.grown(text0))
            return seen[-1] == statuses.count(200)
        wait_for(mita_ok, timeout_s=3, interval_s=0.25)
        answers_counted = seen[-1]
        rate = statuses.count(200) / max(s.start_s + s.latency_s for s in samples)
        may_lose = math.ceil(2 * rate * (metrics.EXPORT_INTERVAL_S + 0.5))
        gone = wait_for(lambda: "dead series gone" in answers.first,
                        timeout_s=max(0.0, killed_at + metrics.DEAD_SERIES_S + 1
                                      - time.monotonic()), interval_s=0.25)
    gone_s = answers.first.get("dead series gone", time.monotonic()) - killed_at
    report = dict(sent=len(samples), ok=statuses.count(200),
                  failed_by_status={st: statuses.count(st) for st in set(statuses) if st != 200},
                  resends_answered_gave_up=counted, recovery_s=round(recovery_s, 1),
                  answers_counted=answers_counted, may_lose=may_lose,
                  dead_series_gone_s=round(gone_s, 1),
                  p50_s=round(float(np.percentile(latencies, 50)), 3),
                  max_s=round(float(latencies.max()), 2))
    save_report("gateway_kill", report)
    assert statuses == [200] * len(samples), report  # nothing lost with the gateway
    assert counted is not None and counted[0] >= 1 and counted[1] == 0, report
    assert latencies.max() < proxy_guard.RESEND_WITHIN_S + 10, report
    # a request the dying gateway answered (and counted) but whose answer never reached the
    # proxy is resent and counted again: at most one extra count per answered resend
    assert -counted[0] <= statuses.count(200) - answers_counted <= may_lose, report
    assert gone and gone_s <= metrics.DEAD_SERIES_S, report  # its series left /metrics
