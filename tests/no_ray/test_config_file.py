"""Config files read strictly: every user_config and every field of a Serve file, refused at
start time (``python -m service`` in one line) naming the file, the deployment and the field;
and what the strict reading must let through."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"


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
    from service import launch, running

    with pytest.raises(ValueError, match=r"deployments.0.graceful_shutdown_timeout_s: Input "
                                         r"should be (a finite number|less than or equal to "
                                         r"600)"):
        launch.load_config(launch.CPU_CONFIG, {"deployments": {"Gateway": {
            "graceful_shutdown_timeout_s": grace}}})
    assert running.drain_time_s(launch.load_config(launch.CPU_CONFIG)) == 30.0


def test_shipped_configs_parse_and_unknown_deployments_are_refused():
    from service import launch
    from service.settings import ClassifierConfig

    for path in (launch.CPU_CONFIG, launch.GPU_CONFIG):
        app = launch.load_config(path).applications[0]
        mita = next(d for d in app.deployments if d.name == "MiTAClassifier")
        assert ClassifierConfig.model_validate(mita.user_config).staged_profile_every == 100
    with pytest.raises(ValueError, match="no deployment named 'MitaClassifier'"):
        launch.load_config(launch.CPU_CONFIG,
                           {"deployments": {"MitaClassifier": {"num_replicas": 1}}})


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
     "deployments.0.health_check_period_s: Input should be a finite number"),
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

    root = Path(__file__).resolve().parents[2]
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
