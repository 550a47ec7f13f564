"""The running service under live updates and route prefixes (Ray Serve on loopback, in this
process): a refused ``serve deploy`` leaves the running version serving with its old config
and says so; every path-keyed check of the gateway holds under an application route prefix."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from ray import serve
from ray.serve.schema import ServeDeploySchema

from mita.data.listops import encode, generate_long
from service import launch

from .conftest import counter, set_gateway, wait_for
from .helpers import REFUSALS, REFUSALS_COUNTED, send_refusals

pytestmark = pytest.mark.service


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
    log and, for the gateway, ``mita_serve_config_updates_total{outcome="refused"}``; a good
    deploy applies."""
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
            return counter(text, "ray_mita_serve_config_updates_total", outcome="refused",
                           deployment="Gateway") - counter(
                text0, "ray_mita_serve_config_updates_total", outcome="refused",
                deployment="Gateway") or None
        assert wait_for(counted, timeout_s=20) == 1, service.metrics_text()[-3000:]
    finally:
        set_gateway(service)  # a good deploy applies again
        restore(service)
    models = c.get("/v1/models").json()
    assert models["config_update"]["state"] == "applied"
    assert models["variants"]["mita"]["config_update"]["state"] == "applied"
    assert models["ab_policy"]["weights"] == shipped_user_config("Gateway")["weights"]


def test_every_check_holds_under_a_route_prefix(service):
    """Found by a user: under ``route_prefix: /m2`` the gateway compared the full path
    (``/m2/v1/classify``) with its bare routes, so every body check was skipped (gzip bodies,
    two Content-Types, ``?variant=`` on the JSON endpoint: 200), refusals went uncounted and
    the drain saw 0 requests in flight. The whole refusal table and the in-flight count,
    under a prefix."""
    app_name = service.config.applications[0].name
    gateway = serve.get_deployment_handle("Gateway", app_name=app_name)
    try:
        serve_deploy(service, route_prefix="/m2")
        assert wait_for(lambda: service.client.get("/m2/healthz").status_code == 200)
        time.sleep(1.5)  # earlier tests' requests exported (every 0.5 s in the tests)
        text0 = service.metrics_text()
        assert send_refusals(service.client, "/m2") == [status for status, *_ in REFUSALS]

        def counted():
            text = service.metrics_text()
            got = {st: counter(text, "ray_mita_serve_requests_total", variant="none",
                               status=str(st)) - counter(text0, "ray_mita_serve_requests_"
                                                         "total", variant="none", status=str(st))
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


def test_a_variant_that_cannot_start_gets_503_with_retry_after(service):
    """A classifier whose new replicas cannot start (a bad user_config together with a change
    that restarts them, so no replica has an old config to keep): its requests get 503 +
    Retry-After, never a 500 or a wait until the timeout; the other variant and the gateway
    keep answering, and a good deploy brings it back."""
    c = service.client
    mita_bad = shipped_user_config("MiTAClassifier") | {"max_batch_size": 0}
    try:
        raw = launch.load_config(launch.CPU_CONFIG, service.overrides).model_dump(
            exclude_unset=True)
        for dep in raw["applications"][0]["deployments"]:
            if dep["name"] == "MiTAClassifier":  # new actor options: new replicas
                dep["user_config"] = mita_bad
                dep["ray_actor_options"] = {"num_cpus": 0.0001}
        serve_api_deploy = launch.serve_api.serve_start().deploy_apps
        serve_api_deploy(ServeDeploySchema.model_validate(raw), _blocking=False)

        def refused_503():
            r = c.post("/v1/classify", json={"text": "[MAX 2 9 ]", "variant": "mita"})
            return r if r.status_code == 503 else None
        r = wait_for(refused_503, timeout_s=90, interval_s=1.0)
        assert r is not None, "the MiTA variant kept answering"
        assert r.headers["retry-after"] == "1" and "mita" in r.json()["error"], r.text
        statuses = {c.post("/v1/classify", json={"text": "[MAX 2 9 ]", "variant": "mita"})
                    .status_code for _ in range(5)}
        assert statuses <= {503}, statuses  # never a 500 while it cannot start
        dense = c.post("/v1/classify", json={"text": "[MAX 2 9 ]", "variant": "dense"})
        assert dense.status_code == 200 and c.get("/healthz").status_code == 200
    finally:
        restore(service)
    assert wait_for(lambda: c.post("/v1/classify", json={"text": "[MAX 2 9 ]",
                                                         "variant": "mita"}).status_code == 200,
                    timeout_s=120)
