"""The running service under live updates and route prefixes (Ray Serve on loopback, in this
process): a refused ``serve deploy`` leaves the running version serving with its old config
and says so; every path-keyed check of the gateway holds under an application route prefix."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from ray.serve.schema import ServeDeploySchema

from mita.data.listops import encode, generate_long
from service import launch

from ..helpers import (
    REFUSALS,
    REFUSALS_COUNTED,
    counter,
    delta,
    metric_families,
    send_refusals,
    set_gateway,
    wait_for,
)

# sharing: answers, counts and refusals, nothing timed: runs beside the tests/own_ray/
# tests instead of waiting for the cores lock (tests/lanes.py)
pytestmark = pytest.mark.sharing


def classifier_refused(service, variant: str) -> float | None:
    """``ray_mita_serve_classifier_config_refused{variant}`` as the gateway exports it, or
    None while the series is absent (so a 0 is a real 0)."""
    name = "ray_mita_serve_classifier_config_refused"
    values = [s.value for fam in metric_families(service.metrics_text(), name)
              for s in fam.samples if s.name == name
              and s.labels.get("variant") == variant]
    return values[0] if values else None


def serve_deploy(service, route_prefix: str | None = None, **user_configs: dict) -> None:
    """Deploy the session's config with some deployments' ``user_config`` replaced
    (``user_configs``: deployment name → user_config) through Serve's own deploy path — what
    ``serve deploy FILE`` sends to the controller — so none of this service's strict checks
    runs first, exactly as with ``serve deploy``."""
    raw = launch.load_config(launch.CPU_CONFIG, service.overrides).model_dump(exclude_unset=True)
    app = raw["applications"][0]
    if route_prefix is not None:
        app["route_prefix"] = route_prefix
    for dep in app["deployments"]:
        if dep["name"] in user_configs:
            dep["user_config"] = user_configs[dep["name"]]
    launch.deploy(ServeDeploySchema.model_validate(raw))


def restore(service) -> None:
    launch.deploy(launch.load_config(launch.CPU_CONFIG, service.overrides))
    assert wait_for(lambda: service.client.get("/healthz").status_code == 200)


def shipped_user_config(name: str) -> dict:
    app = launch.load_config(launch.CPU_CONFIG).applications[0]
    return dict(next(d for d in app.deployments if d.name == name).user_config)


def test_refused_live_update_keeps_the_running_version(service):
    """Found by a user: ``weights.mita: -0.5`` through ``serve deploy`` made the Gateway's
    reconfigure raise, Serve stopped the replica, and every request, /healthz included, got
    408 then 503 until a good config came. Now the replicas refuse the update, keep serving
    with the old config (all traffic to dense here), and the refusal is in /v1/models, the
    log and, for the gateway, ``mita_serve_config_updates_total{outcome="refused"}``, for
    the classifier ``mita_serve_classifier_config_refused{variant="mita"}`` (no metric at all
    before: only the gateway's refusals were counted); a good deploy applies."""
    c = service.client
    set_gateway(service, weights={"mita": 0.0, "dense": 1.0})
    replicas = {v: i["replica"] for v, i in c.get("/v1/models").json()["variants"].items()}
    text0 = service.metrics_text()
    gateway_bad = shipped_user_config("Gateway") | {"weights": {"mita": -0.5, "dense": 1.0}}
    mita_bad = shipped_user_config("MiTAClassifier") | {"max_batch_size": 0}
    try:
        serve_deploy(service, Gateway=gateway_bad, MiTAClassifier=mita_bad)

        def refused():
            m = c.get("/v1/models").json()
            return m if (m["config_update"]["state"] == "refused" and m["variants"]["mita"]
                         ["config_update"]["state"] == "refused") else None
        models = wait_for(refused, timeout_s=30)
        assert models, c.get("/v1/models").json()
        assert "weights" in models["config_update"]["error"], models["config_update"]
        assert "max_batch_size" in models["variants"]["mita"]["config_update"]["error"]
        assert models["ab_policy"]["weights"] == {"mita": 0.0, "dense": 1.0}
        assert {v: i["replica"] for v, i in models["variants"].items()} == replicas
        answers = [c.post("/v1/classify", json={"text": "[MAX 2 9 ]"}) for _ in range(8)]
        assert [r.status_code for r in answers] == [200] * 8
        assert {r.json()["variant"] for r in answers} == {"dense"}  # the old policy
        mita = c.post("/v1/classify", json={"text": "[MAX 2 9 ]", "variant": "mita"})
        assert mita.status_code == 200 and c.get("/healthz").status_code == 200

        def counted():
            text = service.metrics_text()
            return delta(text, text0, "ray_mita_serve_config_updates_total",
                         outcome="refused", deployment="Gateway") or None
        assert wait_for(counted, timeout_s=20) == 1, service.metrics_text()[-3000:]
        assert wait_for(lambda: counter(service.metrics_text(), "ray_mita_serve_config_"
                                        "refused", deployment="Gateway") == 1, timeout_s=20)
        # the classifier's refusal, exported by the gateway (classifier replicas export none)
        assert wait_for(lambda: classifier_refused(service, "mita") == 1, timeout_s=30)
        assert classifier_refused(service, "dense") == 0
    finally:
        set_gateway(service)  # a good deploy applies again
        restore(service)
    models = c.get("/v1/models").json()
    assert models["config_update"]["state"] == "applied"
    assert models["variants"]["mita"]["config_update"]["state"] == "applied"
    assert models["ab_policy"]["weights"] == shipped_user_config("Gateway")["weights"]
    assert wait_for(lambda: counter(service.metrics_text(), "ray_mita_serve_config_refused",
                                    deployment="Gateway") == 0, timeout_s=20)
    assert wait_for(lambda: classifier_refused(service, "mita") == 0, timeout_s=30)


def test_every_check_holds_under_a_route_prefix(service):
    """Found by a user: under ``route_prefix: /m2`` the gateway compared the full path
    (``/m2/v1/classify``) with its bare routes, so every body check was skipped (gzip bodies,
    two Content-Types, ``?variant=`` on the JSON endpoint: 200), refusals went uncounted and
    the drain saw 0 requests in flight. The whole refusal table and the in-flight count,
    under a prefix."""
    app_name = service.config.applications[0].name
    gateway = launch.driver_handle("Gateway", app_name)
    try:
        serve_deploy(service, route_prefix="/m2")
        assert wait_for(lambda: service.client.get("/m2/healthz").status_code == 200)
        time.sleep(1.5)  # earlier tests' requests exported (every 0.5 s in the tests)
        text0 = service.metrics_text()
        assert send_refusals(service.client, "/m2") == [status for status, *_ in REFUSALS]

        def counted():
            text = service.metrics_text()
            got = {st: delta(text, text0, "ray_mita_serve_requests_total", variant="none",
                             status=str(st))
                   for st in REFUSALS_COUNTED}
            return got if got == REFUSALS_COUNTED else None
        assert wait_for(counted, timeout_s=20) == REFUSALS_COUNTED

        ids = encode(generate_long(16384, seed=11)[0])  # dense: ~1-2 s per forward here

        async def inflight_during_a_request():
            async with httpx.AsyncClient(base_url=service.url, timeout=120) as c:
                slow = asyncio.ensure_future(c.post("/m2/v1/classify",
                                                    json={"ids": ids, "variant": "dense"}))
                await asyncio.sleep(0.5)
                seen = await gateway.inflight.remote()
                return seen, await slow
        seen, answer = asyncio.run(inflight_during_a_request())
        assert answer.status_code == 200 and seen == 1, (seen, answer.text)
    finally:
        restore(service)


def test_replicas_started_after_a_refused_update_serve_the_last_applied_config(service):
    """Serve keeps a refused user_config as its target, so replicas that start later (here: a
    change of actor options restarts the Gateway and the MiTA classifier with it) are handed
    the bad config and have no old one in memory; they start on the last applied config
    (kept in Ray's key-value store) and report the refusal, instead of failing to start (a
    Gateway that cannot start is the whole service down)."""
    c = service.client
    set_gateway(service, weights={"mita": 0.0, "dense": 1.0})
    replicas = {v: i["replica"] for v, i in c.get("/v1/models").json()["variants"].items()}
    bad = {"Gateway": shipped_user_config("Gateway") | {"weights": {"mita": -0.5}},
           "MiTAClassifier": shipped_user_config("MiTAClassifier") | {"max_batch_size": 0}}
    try:
        raw = launch.load_config(launch.CPU_CONFIG, service.overrides).model_dump(
            exclude_unset=True)
        for dep in raw["applications"][0]["deployments"]:
            if dep["name"] in bad:  # new actor options: new replicas
                dep["user_config"] = bad[dep["name"]]
                dep["ray_actor_options"] = {"num_cpus": 0.0001}
        launch.deploy(ServeDeploySchema.model_validate(raw))

        def restarted():
            r = c.get("/v1/models")
            m = r.json() if r.status_code == 200 else None
            return m if m and m["variants"]["mita"]["replica"] != replicas["mita"] else None
        models = wait_for(restarted, timeout_s=120, interval_s=1.0)
        assert models, c.get("/v1/models").text
        assert models["config_update"]["state"] == "refused" and "weights" in models[
            "config_update"]["error"], models["config_update"]
        assert models["config_update"]["applied_at"] is None  # started on the stored config
        assert models["ab_policy"]["weights"] == {"mita": 0.0, "dense": 1.0}
        mita = models["variants"]["mita"]
        assert mita["config_update"]["state"] == "refused", mita["config_update"]
        assert mita["config_update"]["applied_at"] is None
        answers = [c.post("/v1/classify", json={"text": "[MAX 2 9 ]"}) for _ in range(4)]
        assert [(r.status_code, r.json()["variant"]) for r in answers] == [(200, "dense")] * 4
        r = c.post("/v1/classify", json={"text": "[MAX 2 9 ]", "variant": "mita"})
        assert r.status_code == 200, r.text
    finally:
        set_gateway(service)
        restore(service)
