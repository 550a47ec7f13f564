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
    assert "SUCCESS: 6 rules found" in out.stdout and "SUCCESS: 4 rules found" in out.stdout


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

    with pytest.raises(ValueError, match=r"deployments.0.graceful_shutdown_timeout_s: Input "
                                         r"should be (a finite number|less than or equal to "
                                         r"600)"):
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


@pytest.mark.slow  # one interpreter per case
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
    # Each of these was a traceback (ValueError / RuntimeError / AssertionError) after start.
    (["-m", "mita.train", "--out", "/nonexistent/x", "--dim", "63"],
     "config field 'dim' (63) must be even and divisible by num_heads (2)"),
    (["-m", "mita.train", "--out", "/nonexistent/x", "--shared-scale", ""],
     "--shared-scale: invalid choice: ''"),
    (["-m", "mita.train", "--out", "/nonexistent/x", "--min-length", "500"],
     "empty length range (500, 500)"),
    (["-m", "profiler", "sweep", "--settings", "garbage"],
     "setting 'garbage' is neither 'fig5' nor 'MxK'"),
    (["-m", "profiler", "sweep", "--settings", "0x64"], "m and k must be at least 1"),
    (["-m", "profiler", "sweep", "--device", "gpu"], "device 'gpu' is not a torch device"),
    (["-m", "profiler", "sweep", "--heads", "3"], "'dim' (128) must be even and divisible by "
                                                  "num_heads (3)"),
    (["-m", "profiler", "sweep", "--settings", "99999999999x1"],
     "'num_landmarks' must be an int in [1, 65536]"),
    (["-m", "profiler", "sweep", "--out", "/dev/null/x"], "Not a directory"),
    (["-m", "mita.evaluate", "/nonexistent"], "checkpoint file missing: /nonexistent"),
    (["-m", "mita.evaluate", "checkpoints/listops-default", "--min-length", "500"],
     "empty length range (500, 500)"),
    # hung forever: no tree has length 2
    (["-m", "mita.train", "--out", "/tmp/mita-never", "--min-length", "1", "--max-length", "3",
      "--train-size", "1"], "drew 101,000 trees and found 0 of 1"),
    (["-m", "loadtest", "run", "--url", "ftp://127.0.0.1:1"], "--url must start with http://"),
    (["-m", "loadtest", "run", "--n", "2000000"], "--n: 2000000 is outside [1, 1048576]"),
    (["-m", "loadtest", "run", "--out", "/dev/null/x"], "Not a directory"),
    (["-m", "service", "--node-ip", "bogus"], "--node-ip: 'bogus' is not an IP address"),
])
def test_command_line_numbers_are_parsed_strictly(argv, message):
    """Every numeric CLI flag is finite and in range (``mita.argtypes``); argparse exits 2
    naming the flag before anything starts."""
    import sys

    done = subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).resolve().parents[1])
    assert done.returncode == 2, done.stderr[-1000:]
    assert message in done.stderr, done.stderr[-1000:]


@pytest.mark.slow
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
    assert (f"refusing to start: {tmp_path / 'bad.yaml'}: application 'mita-serve' deployment "
            "'MiTAClassifier' user_config: deterministic: Input should be a valid boolean"
            ) in done.stderr


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
    assert preflight.DEFAULT_METRICS_PORT == 9100


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
    with pytest.raises(ValueError, match=r"http_options.request_timeout_s: Input should be "
                                         r"less than or equal to 300"):
        launch.load_config(launch.CPU_CONFIG, {"http_options": {"request_timeout_s": 600}})


SHIPPED = (DEPLOY / "serve_config.yaml").read_text()
# (the shipped CPU config edited, the refusal's text). Before the strict file schema
# (service.config_file) the first five were tracebacks from python -m service (ParserError,
# AttributeError, KeyError, IndexError, KeyError) and the rest were accepted silently.
BAD_FILES = [
    ("applications: [\n", "not valid YAML: while parsing a flow node"),
    ("", "expected a mapping with 'applications', got NoneType"),
    ("http_options: {port: 8000}\n", "applications: Field required"),
    ("applications: []\n", "applications: List should have at least 1 item"),
    (SHIPPED.replace("- name: Gateway", "- graceful_shutdown_wait_loop_s: 1"),
     "applications.0.deployments.0.name: Field required"),
    (SHIPPED.replace("port: 8000", "port: 70000"),
     "http_options.port: Input should be less than or equal to 65535 (got 70000)"),
    (SHIPPED.replace("port: 8000", "port: '8000'"),
     "http_options.port: Input should be a valid integer (got '8000')"),
    (SHIPPED.replace("port: 8000", "prot: 8000"),
     "http_options.prot: Extra inputs are not permitted"),
    (SHIPPED.replace("route_prefix:", "route_prefx:"),
     "applications.0.route_prefx: Extra inputs are not permitted"),
    (SHIPPED.replace("num_cpus: 0.25", "num_cpu: 0.25"),
     "applications.0.deployments.0.ray_actor_options.num_cpu: Extra inputs are not permitted"),
    (SHIPPED.replace("max_replicas: 2", "max_replica: 2", 1),
     "deployments.1.autoscaling_config.max_replica: Extra inputs are not permitted"),
    (SHIPPED.replace("graceful_shutdown_timeout_s: 30", "graceful_shutdown_timeout: 30", 1),
     "deployments.0.graceful_shutdown_timeout: Extra inputs are not permitted"),
    (SHIPPED.replace("port: 8000", "port: 8000\n  port: 8001"), "duplicate key 'port'"),
    (SHIPPED.replace("- name: DenseClassifier", "- name: MiTAClassifier"),
     "deployment(s) MiTAClassifier listed more than once"),
    (SHIPPED.replace("health_check_period_s: 2", "health_check_period_s: .inf", 1),
     "deployments.1.health_check_period_s: Input should be a finite number"),
    (SHIPPED.replace("target_ongoing_requests: 8", "target_ongoing_requests: .nan", 1),
     "autoscaling_config.target_ongoing_requests: Input should be a finite number"),
    (SHIPPED.replace("min_replicas: 1", "min_replicas: 3", 1),
     "need min_replicas ≤ initial_replicas ≤ max_replicas, got 3, 1, 2"),
    (SHIPPED.replace("max_queued_requests: 64", "max_queued_requests: -2", 1),
     "deployments.1.max_queued_requests: Input should be greater than or equal to -1"),
    (SHIPPED.replace("dense: 0.5}", "dense: 1.0e+308}").replace("{mita: 0.5", "{mita: 1.0e+308"),
     "weights.mita: Input should be less than or equal to 1000000"),
    (SHIPPED.replace("sticky_header: x-client-key", "sticky_header: ''"),
     "sticky_header: String should match pattern"),
    (SHIPPED.replace("max_batch_items: 64", "max_batch_items: 1000000"),
     "max_batch_items: Input should be less than or equal to 4096"),
    (SHIPPED.replace("retry_after_s: 1", "retry_after_s: 100000000"),
     "retry_after_s: Input should be less than or equal to 3600"),
    (SHIPPED.replace("staged_profile_every: 100", "staged_profile_every: 10000000000"),
     "staged_profile_every: Input should be less than or equal to 1000000"),
    # From a second operator-style pass: tracebacks (TypeError, RecursionError, ValueError)
    # and values Ray refuses only after start-up, or that cannot work.
    ("? [a, b]\n: 1\n" + SHIPPED, "a mapping key must be a plain value"),
    ("a: " + "[" * 20_000 + "]" * 20_000 + "\n", "nested too deeply"),
    (SHIPPED.replace("port: 8000", "port: " + "9" * 5000), "Exceeds the limit (4300 digits)"),
    (SHIPPED.replace("num_cpus: 0.25", "num_cpus: 0.25\n          resources: {x: -5.0}"),
     "ray_actor_options.resources.x: Input should be greater than or equal to 0"),
    (SHIPPED.replace("num_cpus: 0.25", "resources: {CPU: 1.0}"),
     "CPU, GPU and memory are set with num_cpus, num_gpus and memory"),
    (SHIPPED.replace("num_cpus: 0.25", "num_cpus: 0.00001"), "must be a multiple of 0.0001"),
    (SHIPPED.replace("num_cpus: 0.25", "runtime_env: {pip: [requests]}"),
     "ray_actor_options.runtime_env: Extra inputs are not permitted"),
    (SHIPPED.replace("health_check_period_s: 2", "health_check_period_s: 1.0e-300", 1),
     "health_check_period_s: Input should be greater than or equal to 0.1"),
    (SHIPPED.replace("service.app:build_app", "service.app.build_app").replace(
        "max_batch_size: 8", "max_batch_size: -5", 1),  # the dot form skipped the user_configs
     "deployment 'MiTAClassifier' user_config: max_batch_size: Input should be greater"),
    ("proxy_location: Disabled\n" + SHIPPED.replace("proxy_location: HeadOnly\n", ""),
     "HTTP is off (proxy_location Disabled or route_prefix null)"),
    (SHIPPED.replace("request_timeout_s: 120", "request_timeout_s: 200"),
     "request_timeout_s (200 s) exceeds http_options.request_timeout_s (180 s)"),
    (SHIPPED.replace("# prometheus_url: http://127.0.0.1:9090",
                     "prometheus_url: 'http://127.0.0.1:9090/?x=1'"),
     "a base URL without query, fragment or user:password"),
]


def test_valid_serve_files_are_not_refused(tmp_path):
    """What the strict reading must let through (a review found the first two refused):
    any multiple of 0.0001 CPUs (0.07 failed a float comparison) and a YAML merge key whose
    mapping overrides a merged key (reported as a duplicate). And the gateway's default
    timeout is checked against the proxy's like a written one."""
    from service import launch

    for text in (SHIPPED.replace("num_cpus: 0.25", "num_cpus: 0.07"),
                 SHIPPED.replace("num_cpus: 0.25", "num_cpus: 0.0003")):
        path = tmp_path / "ok.yaml"
        path.write_text(text)
        launch.load_config(path)
    # merge keys resolve and may be overridden (here by the file's own host line)
    from service.config_file import read_yaml

    path = tmp_path / "merge.yaml"
    path.write_text("base: &b {port: 1, host: a}\nhttp: {<<: *b, port: 2}\n")
    assert read_yaml(path)["http"] == {"port": 2, "host": "a"}
    # The gateway's default request_timeout_s (120 s) counts against the proxy's
    gateway_defaults = SHIPPED.replace("request_timeout_s: 180", "request_timeout_s: 60")
    gateway_defaults = gateway_defaults.replace("          request_timeout_s: 120\n", "")
    path.write_text(gateway_defaults)
    with pytest.raises(ValueError, match=r"request_timeout_s \(120 s\) exceeds "
                                         r"http_options.request_timeout_s \(60 s\)"):
        launch.load_config(path)


@pytest.mark.parametrize("text,message", BAD_FILES)
def test_every_serve_config_field_is_parsed_strictly(tmp_path, text, message):
    """The whole Serve file, not only the service's user_configs: no duplicate keys, no
    unknown keys, no str -> number coercion, finite bounded numbers; the refusal names the
    file and the field's path in it."""
    from service import launch

    path = tmp_path / "serve.yaml"
    path.write_text(text)
    with pytest.raises(ValueError) as refused:
        launch.load_config(path)
    assert str(refused.value).startswith(f"{path}: ")
    assert message in str(refused.value)


@pytest.mark.slow
def test_python_m_service_refuses_bad_files_in_one_line(tmp_path):
    """No traceback from ``python -m service --config``: one line, exit status 1."""
    import sys

    root = Path(__file__).resolve().parents[1]
    for name, text in [("bad.yaml", BAD_FILES[0][0]), ("empty.yaml", ""),
                       ("typo.yaml", SHIPPED.replace("port: 8000", "prot: 8000"))]:
        (tmp_path / name).write_text(text)
        done = subprocess.run([sys.executable, "-m", "service", "--config",
                               str(tmp_path / name)], capture_output=True, text=True,
                              timeout=120, cwd=root)
        assert done.returncode == 1, done.stderr[-800:]
        assert "Traceback" not in done.stderr, done.stderr[-800:]
        assert done.stderr.startswith(f"mita-serve: refusing to start: {tmp_path / name}: "), (
            done.stderr[-800:])


def test_device_host_and_checkpoint_length_checked_before_start(monkeypatch, tmp_path):
    """Refused before Ray starts: ``device: cuda`` without CUDA (the replicas failed one by
    one after start), an HTTP host that is not this machine's (was reported as "port in
    use"), and a checkpoint whose max_len is below the gateway's max_n (requests in between
    were accepted, then failed)."""
    from service import launch

    monkeypatch.setattr(preflight, "local_gpu_count", lambda: 0)  # a machine without CUDA
    monkeypatch.setattr(preflight.torch.cuda, "is_available", lambda: False)
    cuda = launch.load_config(launch.CPU_CONFIG, {"args": {"device": "cuda:1"}})
    with pytest.raises(ValueError, match=r"args: device 'cuda:1': this machine's torch .* sees 0 "
                                         r"CUDA device\(s\); use device: auto or cpu"):
        preflight.check_devices(cuda)
    triton = launch.load_config(launch.CPU_CONFIG, {"args": {"mita_backend": "triton"}})
    with pytest.raises(ValueError, match="mita_backend 'triton' needs a CUDA device"):
        preflight.check_devices(triton)
    preflight.check_devices(launch.load_config(launch.CPU_CONFIG))  # auto: fine
    with pytest.raises(ValueError, match=r"device: String should match pattern"):
        launch.load_config(launch.CPU_CONFIG, {"args": {"device": "cuda:" + "9" * 20}})
    with pytest.raises(OSError, match=r"http_options.port in the config, --metrics-port "
                                      r"must differ, got \[8000, 8000\]"):
        preflight.check_ports_free(launch.load_config(launch.CPU_CONFIG), 8000)
    with pytest.raises(OSError, match=r"--metrics-port, --dashboard-port must differ, got "
                                      r"\[8000, 9100, 9100\]"):
        preflight.check_ports_free(launch.load_config(launch.CPU_CONFIG), 9100,
                                   dashboard=("127.0.0.1", 9100))

    for host, message in [("192.0.2.1", "cannot listen on 192.0.2.1:"),
                          ("no-such-host.invalid", "http_options.host 'no-such-host.invalid' "
                                                   "is not an address of this machine")]:
        config = launch.load_config(launch.CPU_CONFIG, {"http_options": {"host": host}})
        with pytest.raises(OSError, match=message):
            preflight.check_ports_free(config, 0)
    with pytest.raises(OSError, match=r"cannot listen on 192.0.2.1:9100 .* is --node-ip"):
        preflight.check_ports_free(launch.load_config(launch.CPU_CONFIG), 9100, "192.0.2.1")

    short = tmp_path / "short"
    shutil.copytree(Path(__file__).resolve().parents[1] / "checkpoints" / "listops-default",
                    short)
    meta = json.loads((short / "config.json").read_text())
    meta["config"]["max_len"] = 1024
    (short / "config.json").write_text(json.dumps(meta))
    config = launch.load_config(launch.CPU_CONFIG, {"args": {"checkpoint": str(short)}})
    with pytest.raises(ValueError, match=r"max_len \(1024\) is below the Gateway's max_n "
                                         r"\(16384\)"):
        preflight.verify_checkpoints(config)
    preflight.verify_checkpoints(launch.load_config(launch.CPU_CONFIG, {
        "args": {"checkpoint": str(short)},
        "deployments": {"Gateway": {"user_config": {"max_n": 1024}}}}))


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
    readme = (ROOT / "README.md").read_text()
    assert "--resources '{\"mita_gateway\": 1}'" in readme
    assert "--resources '{\"mita_classifier\": 4}'" in readme


@pytest.mark.parametrize("address,message", [
    ("127.0.0.1:1", "no Ray cluster answers at 127.0.0.1:1 (Connection refused)"),
    ("head-node", "expected HOST:PORT"),
    ("10.0.0.5:port", "expected HOST:PORT"),
    ("http://10.0.0.5:8265", "not a URL"),  # the dashboard's address, as Ray's job CLI takes
])
def test_unreachable_cluster_address_refused_at_once(address, message):
    # ray.init would retry a dead address for minutes
    with pytest.raises(OSError, match=re.escape(message)):
        preflight.check_cluster_reachable(address, timeout_s=2)
    preflight.check_cluster_reachable("auto")  # Ray's own lookup, which fails fast by itself


def test_a_server_that_is_not_rays_gcs_is_refused():
    """An HTTP server (e.g. the metrics port given by mistake) accepts the connection, so a
    plain connect passed and ray.init then retried for minutes: the probe wants gRPC."""
    import http.server
    import threading

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0),
                                             http.server.BaseHTTPRequestHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        with pytest.raises(OSError, match="is not a Ray cluster's GCS"):
            preflight.check_cluster_reachable(f"127.0.0.1:{server.server_address[1]}", 2)
    finally:
        server.shutdown()


def test_joining_keeps_the_applications_others_deployed_from_a_config():
    """Serve deletes every config-deployed application a new config does not name, so the
    service deploys those, unchanged, with its own; Python-deployed ones are left alone."""
    config = launch.load_config(DEPLOY / "serve_config.cluster.yaml")
    other = {"name": "other", "route_prefix": "/other", "import_path": "shop.app:build",
             "args": {"size": 3}}
    details = {"applications": {
        "other": {"source": "declarative", "deployed_app_config": other},
        "from-python": {"source": "imperative", "deployed_app_config": None},
        "broken": {"source": "declarative"}}}
    merged = launch.with_cluster_apps(config, details)
    assert [a.name for a in merged.applications] == ["other", "mita-serve"]
    assert merged.applications[0].model_dump(exclude_unset=True) == other
    assert merged.applications[1] == config.applications[0]
    assert launch.with_cluster_apps(config, {"applications": {}}) is config


def test_classifier_replicas_reads_serves_replica_states():
    from service.replicas import classifier_replicas

    def deployment(*states, min_replicas=1):
        return {"replicas": [{"state": s} for s in states],
                "deployment_config": {"autoscaling_config": {"min_replicas": min_replicas}}}
    details = {"applications": {"app": {"deployments": {
        "Gateway": deployment("RUNNING"),
        "MiTAClassifier": deployment("STOPPING", "STARTING"),  # a lost node's, being replaced
        "DenseClassifier": deployment(min_replicas=0)}}}}  # scaled to zero
    assert classifier_replicas(details, "app") == {
        "mita": {"serving": 0, "stopping": 1, "scales_to_zero": False},
        "dense": {"serving": 0, "stopping": 0, "scales_to_zero": True}}
    details["applications"]["app"]["deployments"]["MiTAClassifier"] = deployment(
        "RUNNING", "UPDATING", "RECOVERING", "PENDING_MIGRATION", "STARTING")
    assert classifier_replicas(details, "app")["mita"]["serving"] == 4
    # as the controller's own objects come: str enums (str() of one is 'ReplicaState.RUNNING')
    from ray.serve._private.common import ReplicaState
    details["applications"]["app"]["deployments"]["MiTAClassifier"] = deployment(
        ReplicaState.RUNNING, ReplicaState.STOPPING)
    assert classifier_replicas(details, "app")["mita"] == {"serving": 1, "stopping": 1,
                                                           "scales_to_zero": False}
