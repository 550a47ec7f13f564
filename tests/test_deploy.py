"""Deployment files: Serve configs, KubeRay manifest, Prometheus config and rules, Grafana."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from service import launch

ROOT = Path(__file__).resolve().parent.parent
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
    assert launch.replica_gpus(gpu, "min") == [0.25, 0.25]  # MiTA, dense
    assert launch.gpus_needed(launch.replica_gpus(gpu, "min")) == 1
    assert launch.replica_gpus(gpu, "max") == [0.25] * 4
    assert launch.gpus_needed(launch.replica_gpus(gpu, "max")) == 1
    assert launch.replica_gpus(launch.load_config(launch.CPU_CONFIG), "max") == []
    # "each its own GPU", as the config's comment says: num_gpus 1 → two GPUs at the minimum.
    own = launch.load_config(launch.GPU_CONFIG, {"deployments": {
        name: {"ray_actor_options": {"num_gpus": 1}}
        for name in ("MiTAClassifier", "DenseClassifier")}})
    assert launch.gpus_needed(launch.replica_gpus(own, "min")) == 2
    assert launch.gpus_needed(launch.replica_gpus(own, "max")) == 4


@pytest.mark.parametrize("gpus,needed", [([], 0), ([1, 1], 2), ([0.6, 0.6], 2),
                                         ([0.5, 0.25, 0.25, 0.5], 2), ([0.7, 0.3, 0.3], 2),
                                         ([2, 0.5], 3)])
def test_gpus_needed_packs_fractions_per_gpu(gpus, needed):
    assert launch.gpus_needed(gpus) == needed


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
    assert "SUCCESS: 6 rules found" in out.stdout and "SUCCESS: 3 rules found" in out.stdout


def test_grafana_dashboard_and_provisioning():
    dash = json.loads((DEPLOY / "grafana" / "mita-serve-dashboard.json").read_text())
    titles = [p["title"] for p in dash["panels"]]
    for needle in ("MiTA: per-stage", "Dense: per-stage", "Request latency p50 / p99",
                   "Throughput", "MiTA / dense", "Shadow agreement", "Peak memory"):
        assert any(needle in t for t in titles), needle
    assert all(t["expr"] for p in dash["panels"] for t in p["targets"])
    ds = yaml.safe_load((DEPLOY / "grafana" / "provisioning" / "datasources" /
                         "prometheus.yml").read_text())
    assert ds["datasources"][0]["uid"] == dash["panels"][0]["datasource"]["uid"]


def test_build_app_refuses_unknown_dtype_at_deploy_time():
    from ray.serve import Application

    from service.app import build_app

    with pytest.raises(ValueError, match="application arg 'dtype' must be one of"):
        build_app({"dtype": "half"})
    assert isinstance(build_app({"dtype": "bfloat16"}), Application)
