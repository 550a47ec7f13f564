"""Deployment files: Serve configs, KubeRay manifest, Prometheus config and rules, Grafana."""

from __future__ import annotations

import json
import re
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


def test_build_app_refuses_bad_args_at_deploy_time():
    from ray.serve import Application

    from service.app import build_app

    with pytest.raises(ValueError, match=r"application args: dtype: Input should be 'auto'"):
        build_app({"dtype": "half"})
    with pytest.raises(ValueError, match=r"cuda_graphs: Input should be a valid boolean"):
        build_app({"cuda_graphs": "no"})
    with pytest.raises(ValueError, match=r"devise: Extra inputs are not permitted"):
        build_app({"devise": "cpu"})
    assert isinstance(build_app({"dtype": "bfloat16"}), Application)


BAD_CONFIGS = [  # (overrides, the refusal's text): one per kind, each named by deployment/field
    ({"MiTAClassifier": {"deterministic": "false"}},  # was read as True ("false" is truthy)
     "deployment 'MiTAClassifier' user_config: deterministic: Input should be a valid boolean"),
    ({"MiTAClassifier": {"max_batch_sise": 4}},  # a typo was ignored
     "deployment 'MiTAClassifier' user_config: max_batch_sise: Extra inputs are not permitted"),
    ({"DenseClassifier": {"max_batch_size": 8.9}},  # was truncated to 8
     "deployment 'DenseClassifier' user_config: max_batch_size: Input should be a valid integer"),
    ({"MiTAClassifier": {"batch_wait_timeout_s": "nan"}},  # was passed on to Ray
     "batch_wait_timeout_s: Input should be a valid number (got 'nan')"),
    ({"MiTAClassifier": {"batch_wait_timeout_s": float("inf")}},
     "batch_wait_timeout_s: Input should be a finite number"),
    ({"MiTAClassifier": {"staged_profile_every": -1}},
     "staged_profile_every: Input should be greater than or equal to 0"),
    ({"Gateway": {"shadow": "true"}},
     "deployment 'Gateway' user_config: shadow: Input should be a valid boolean"),
    ({"Gateway": {"max_n": 1024.0}}, "max_n: Input should be a valid integer"),
    ({"Gateway": {"request_timeout_s": float("nan")}},
     "request_timeout_s: Input should be a finite number"),
    ({"Gateway": {"weights": {"mita": "1", "dense": 1}}}, "weights.mita: Input should be a "
                                                           "valid number"),
]


@pytest.mark.parametrize("user_configs,message", BAD_CONFIGS)
def test_every_user_config_is_parsed_strictly(user_configs, message):
    """A refusal at start time (``python -m service`` loads the file with these checks, before
    Ray starts) names the application, the deployment and the field; nothing is coerced."""
    from service import launch

    overrides = {"deployments": {name: {"user_config": fields}
                                 for name, fields in user_configs.items()}}
    with pytest.raises(ValueError) as refused:
        launch.load_config(launch.CPU_CONFIG, overrides)
    assert "application 'mita-serve'" in str(refused.value)
    assert message in str(refused.value)


@pytest.mark.parametrize("grace", [float("inf"), 601])
def test_drain_time_is_finite_and_bounded(grace):
    """Ray accepts graceful_shutdown_timeout_s: .inf; a shutdown would then wait forever."""
    from service import launch

    with pytest.raises(ValueError, match=r"deployment 'Gateway': graceful_shutdown_timeout_s "
                                         r"must be in \[0, 600\] s"):
        launch.load_config(launch.CPU_CONFIG, {"deployments": {"Gateway": {
            "graceful_shutdown_timeout_s": grace}}})
    assert launch.drain_time_s(launch.load_config(launch.CPU_CONFIG)) == 30.0


def test_shipped_configs_parse_and_unknown_deployments_are_refused():
    from service import launch
    from service.schemas import ClassifierConfig

    for path in (launch.CPU_CONFIG, launch.GPU_CONFIG):
        app = launch.load_config(path).applications[0]
        mita = next(d for d in app.deployments if d.name == "MiTAClassifier")
        assert ClassifierConfig.model_validate(mita.user_config).staged_profile_every == 100
    with pytest.raises(ValueError, match="no deployment named 'MitaClassifier'"):
        launch.load_config(launch.CPU_CONFIG,
                           {"deployments": {"MitaClassifier": {"num_replicas": 1}}})


@pytest.mark.parametrize("argv,message", [
    (["-m", "service", "--metrics-port", "70000"], "--metrics-port: 70000 is outside [1, 65535]"),
    (["-m", "service", "--metrics-interval-ms", "5e3"], "'5e3' is not a valid int"),
    (["-m", "loadtest", "run", "--rate", "nan"], "--rate: 'nan' is not a finite number"),
    (["-m", "loadtest", "run", "--rate", "0"], "--rate: 0 is outside (0.0, inf]"),
    (["-m", "loadtest", "run", "--concurrency", "0"], "--concurrency: 0 is outside [1, inf]"),
    (["-m", "profiler", "sweep", "--budget-s", "inf"], "--budget-s: 'inf' is not a finite"),
    (["-m", "mita.train", "--lr", "-1"], "--lr: -1 is outside (0.0, inf]"),
    (["-m", "mita.evaluate", "checkpoints/listops-default", "--test-size", "2.5"],
     "--test-size: '2.5' is not a valid int"),
])
def test_command_line_numbers_are_parsed_strictly(argv, message):
    """Every numeric CLI flag is finite and in range (``mita.argtypes``); argparse exits 2
    naming the flag before anything starts."""
    import sys

    done = subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).resolve().parents[1])
    assert done.returncode == 2, done.stderr[-1000:]
    assert message in done.stderr, done.stderr[-1000:]


def test_busy_port_and_bad_config_refused_before_ray_starts(tmp_path):
    """``python -m service`` on a port another process listens on exits at once naming the
    port (it waited ~37 s for Ray's start-up timeout before); a config with a bad user_config
    exits naming the deployment and field."""
    import socket
    import sys
    import time

    root = Path(__file__).resolve().parents[1]
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        config = yaml.safe_load((root / "deploy" / "serve_config.yaml").read_text())
        config["http_options"]["port"] = port
        (tmp_path / "busy.yaml").write_text(yaml.safe_dump(config))
        start = time.monotonic()
        done = subprocess.run([sys.executable, "-m", "service", "--config",
                               str(tmp_path / "busy.yaml")], capture_output=True, text=True,
                              timeout=120, cwd=root)
        took = time.monotonic() - start
    assert done.returncode == 1 and took < 30, (took, done.stderr[-800:])
    assert (f"refusing to start: port {port} on 127.0.0.1 is in use" in done.stderr
            and "http_options.port" in done.stderr), done.stderr[-800:]
    config["http_options"]["port"] = 8000
    config["applications"][0]["deployments"][1]["user_config"]["deterministic"] = "false"
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(config))
    done = subprocess.run([sys.executable, "-m", "service", "--config", str(tmp_path / "bad.yaml")],
                          capture_output=True, text=True, timeout=120, cwd=root)
    assert done.returncode == 1
    assert ("refusing to start: application 'mita-serve' deployment 'MiTAClassifier' "
            "user_config: deterministic: Input should be a valid boolean") in done.stderr


def test_each_instance_has_its_own_prometheus_sd_file(monkeypatch, tmp_path):
    """Two instances on the host write two files (one target each) instead of one fixed path
    the last launch overwrote; stop() removes only its own; the shipped prometheus.yml reads
    the default --metrics-port's file."""
    from service import launch

    monkeypatch.setattr(launch, "PROMETHEUS_SD_DIR", tmp_path)
    monkeypatch.setattr(launch, "_written_sd_files", [])
    monkeypatch.setattr(launch.serve, "shutdown", lambda: None)  # no Ray here: files only
    monkeypatch.setattr(launch.ray, "shutdown", lambda: None)
    first = launch.write_prometheus_sd(9100)
    launch._written_sd_files.clear()  # as if another process had written it
    second = launch.write_prometheus_sd(9200)
    assert first != second
    assert json.loads(first.read_text())[0]["targets"] == ["127.0.0.1:9100"]
    assert json.loads(second.read_text())[0]["targets"] == ["127.0.0.1:9200"]
    launch.stop()
    assert first.exists() and not second.exists()
    shipped = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    assert shipped["scrape_configs"][0]["file_sd_configs"][0]["files"] == [
        "/tmp/mita-serve/prometheus/metrics-9100.json"]
    assert launch.DEFAULT_METRICS_PORT == 9100


def test_duration_buckets_cover_every_allowed_timeout():
    """No request duration the service allows lands in +Inf (histogram_quantile cannot place
    it there): the last finite bucket is at least every timeout in the shipped configs (CPU,
    GPU, KubeRay) and the largest a config may set; larger timeouts are refused."""
    from service import launch
    from service.metrics import DURATION_BUCKETS_S
    from service.schemas import MAX_REQUEST_TIMEOUT_S, GatewayConfig

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
    with pytest.raises(ValueError, match=r"http_options.request_timeout_s must be in \(0, 300\]"):
        launch.load_config(launch.CPU_CONFIG, {"http_options": {"request_timeout_s": 600}})
