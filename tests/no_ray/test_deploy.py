"""Deployment files: Serve configs, KubeRay manifest, Prometheus config and rules, Grafana."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from mita.hooks import STAGE_COLORS, STAGE_ORDER
from service import launch, preflight

from .. import pages

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"


def test_serve_configs_validate_and_differ_only_in_gpu_settings():
    cpu, gpu = launch.load_config(launch.CPU_CONFIG), launch.load_config(launch.GPU_CONFIG)
    assert cpu.http_options.host == "127.0.0.1"
    names = [d.name for d in cpu.applications[0].deployments]
    assert names == ["Gateway", "MiTAClassifier", "DenseClassifier"]
    for c, g in zip(cpu.applications[0].deployments[1:], gpu.applications[0].deployments[1:],
                    strict=True):
        assert c.ray_actor_options.num_gpus == 0 and 0 < g.ray_actor_options.num_gpus < 1
        assert c.max_queued_requests == g.max_queued_requests > 0
    assert gpu.applications[0].args["dtype"] == cpu.applications[0].args["dtype"] == "auto"


def test_shipped_gpu_config_places_both_variants_on_one_gpu():
    """The A/B comparison needs MiTA and dense placed at once: on a single-GPU host their
    minimum replicas (and the autoscaling maximum) must fit one GPU."""
    gpu = launch.load_config(launch.GPU_CONFIG)
    assert preflight.replica_gpus(gpu, "min") == [0.25, 0.25]  # MiTA, dense
    assert preflight.gpus_needed(preflight.replica_gpus(gpu, "min")) == 1
    assert preflight.replica_gpus(gpu, "max") == [0.25] * 4
    assert preflight.gpus_needed(preflight.replica_gpus(gpu, "max")) == 1
    assert preflight.replica_gpus(launch.load_config(launch.CPU_CONFIG), "max") == []
    # "each its own GPU", as the config's comment says: num_gpus 1 → two GPUs at the minimum.
    own = launch.load_config(launch.GPU_CONFIG, {"deployments": {
        name: {"ray_actor_options": {"num_gpus": 1}}
        for name in ("MiTAClassifier", "DenseClassifier")}})
    assert preflight.gpus_needed(preflight.replica_gpus(own, "min")) == 2
    assert preflight.gpus_needed(preflight.replica_gpus(own, "max")) == 4


@pytest.mark.parametrize("gpus,needed", [([], 0), ([1, 1], 2), ([0.6, 0.6], 2),
                                         ([0.5, 0.25, 0.25, 0.5], 2), ([0.7, 0.3, 0.3], 2),
                                         ([2, 0.5], 3)])
def test_gpus_needed_packs_fractions_per_gpu(gpus, needed):
    assert preflight.gpus_needed(gpus) == needed


def test_kuberay_manifest_structure_and_embedded_serve_config():
    manifest = yaml.safe_load((DEPLOY / "kuberay" / "rayservice.yaml").read_text())
    assert manifest["apiVersion"] == "ray.io/v1" and manifest["kind"] == "RayService"
    spec = manifest["spec"]
    cluster = spec["rayClusterConfig"]
    assert cluster["headGroupSpec"]["template"]["spec"]["containers"][0]["image"]
    workers = cluster["workerGroupSpecs"]
    gpu = workers[0]["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert gpu["nvidia.com/gpu"] == "1"
    assert workers[0]["minReplicas"] <= workers[0]["replicas"] <= workers[0]["maxReplicas"]
    embedded = yaml.safe_load(spec["serveConfigV2"])
    reference = yaml.safe_load(launch.GPU_CONFIG.read_text())
    assert embedded == {"applications": reference["applications"]}


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed "
                    "(.ci/run installs Debian's prometheus)")
def test_promtool_accepts_config_and_rules():
    prom = DEPLOY / "prometheus"
    subprocess.run(["promtool", "check", "config", str(prom / "prometheus.yml")], check=True,
                   capture_output=True)
    out = subprocess.run(["promtool", "check", "rules", str(prom / "rules.yml"),
                          str(prom / "alerts.yml")], check=True, capture_output=True, text=True)
    assert "SUCCESS: 6 rules found" in out.stdout and "SUCCESS: 5 rules found" in out.stdout


def test_grafana_dashboard_and_provisioning():
    dash = json.loads((DEPLOY / "grafana" / "mita-serve-dashboard.json").read_text())
    titles = [p["title"] for p in dash["panels"]]
    for needle in ("MiTA: per-stage", "Dense: per-stage", "Request latency p50 / p99",
                   "Throughput", "MiTA / dense", "Shadow agreement", "Peak memory",
                   "Routing decisions of policy auto"):
        assert any(needle in t for t in titles), needle
    assert all(t["expr"] for p in dash["panels"] for t in p["targets"])
    ds = yaml.safe_load((DEPLOY / "grafana" / "provisioning" / "datasources" /
                         "prometheus.yml").read_text())
    assert ds["datasources"][0]["uid"] == dash["panels"][0]["datasource"]["uid"]

    # Stage panels: one query per stage in forward order, each stage in its colour (the same
    # as the plots and /dashboard: mita.hooks.STAGE_COLORS).
    stage_panels = [p for p in dash["panels"] if "per-stage" in p["title"].lower()]
    assert len(stage_panels) == 3
    for panel in stage_panels:
        stages = [re.search(r'stage="(\w+)"', t["expr"]).group(1) for t in panel["targets"]]
        for variant in ("mita", "dense"):
            mine = [st for st, t in zip(stages, panel["targets"], strict=True)
                    if f'variant="{variant}"' in t["expr"]]
            assert mine == [st for st in STAGE_ORDER if st in mine]
            assert len(mine) in (0, 6 if variant == "dense" else 12)
        colours = {o["matcher"]["options"]: o["properties"][0]["value"]["fixedColor"]
                   for o in panel["fieldConfig"]["overrides"]
                   if o["properties"][0]["id"] == "color"}
        assert colours == {f"^{st} .*": STAGE_COLORS[st] for st in STAGE_ORDER}
        for t in panel["targets"]:  # each legend name matches its own stage's colour only
            name = t["legendFormat"].replace("{{n_bucket}}", "le_1024")
            assert [st for st in STAGE_ORDER if re.match(f"^{st} .*", name)] == [
                re.search(r'stage="(\w+)"', t["expr"]).group(1)]


def test_duration_buckets_cover_every_allowed_timeout():
    """No request duration the service allows lands in +Inf (histogram_quantile cannot place
    it there): the last finite bucket is at least every timeout in the shipped configs (CPU,
    GPU, KubeRay) and the largest a config may set; larger timeouts are refused."""
    from service import launch
    from service.metrics import DURATION_BUCKETS_S
    from service.settings import MAX_REQUEST_TIMEOUT_S, GatewayConfig

    timeouts = []
    for path in (launch.CPU_CONFIG, launch.GPU_CONFIG):
        config = launch.load_config(path)
        timeouts.append(config.http_options.request_timeout_s)
        timeouts += [d.user_config["request_timeout_s"] for d in config.applications[0].deployments
                     if d.name == "Gateway"]
    rayservice = (DEPLOY / "kuberay" / "rayservice.yaml").read_text()  # serveConfigV2 is text
    timeouts += [float(t) for t in re.findall(r"request_timeout_s:\s*(\d+)", rayservice)]
    assert len(timeouts) >= 5 and max(timeouts) <= DURATION_BUCKETS_S[-1]
    assert DURATION_BUCKETS_S[-1] == MAX_REQUEST_TIMEOUT_S == 300
    assert GatewayConfig.model_fields["request_timeout_s"].metadata[-1].le == 300
    with pytest.raises(ValueError, match="request_timeout_s: Input should be less than or "
                                         "equal to 300"):
        launch.load_config(launch.CPU_CONFIG,
                           {"deployments": {"Gateway": {"user_config": {"request_timeout_s":
                                                                         400}}}})
    with pytest.raises(ValueError, match=r"http_options.request_timeout_s: Input should be "
                                         r"less than or equal to 300"):
        launch.load_config(launch.CPU_CONFIG, {"http_options": {"request_timeout_s": 600}})


def test_cluster_config_is_the_cpu_config_with_placement_resources():
    """deploy/serve_config.cluster.yaml differs from the CPU config only by the custom
    resources that put the Gateway on the head and the classifiers on workers (the README's
    `ray start --resources` lines name the same)."""
    cluster = yaml.safe_load((DEPLOY / "serve_config.cluster.yaml").read_text())
    cpu = yaml.safe_load(launch.CPU_CONFIG.read_text())
    resources = {}
    for dep in cluster["applications"][0]["deployments"]:
        resources[dep["name"]] = dep["ray_actor_options"].pop("resources")
    assert cluster == cpu
    assert resources == {"Gateway": {"mita_gateway": 0.01},
                         "MiTAClassifier": {"mita_classifier": 1},
                         "DenseClassifier": {"mita_classifier": 1}}
    launch.load_config(DEPLOY / "serve_config.cluster.yaml")  # the strict checks pass
    readme = pages.text()  # README.md and docs/
    assert "--resources '{\"mita_gateway\": 1}'" in readme
    assert "--resources '{\"mita_classifier\": 4}'" in readme
