"""What ``python -m service`` checks around a start: command-line numbers, a busy port and
a bad config refused before Ray starts, devices, hosts and checkpoints, cluster addresses, the
applications others deployed, each instance's Prometheus file; and how the gateway reads
Serve's replica states."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from service import launch, preflight

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"


# (argv after the interpreter, the message argparse exits 2 with)
STRICT = [
    (["-m", "service", "--metrics-port", "70000"], "--metrics-port: 70000 is outside [1, 65535]"),
    (["-m", "service", "--metrics-interval-ms", "5e3"], "'5e3' is not a valid int"),
    (["-m", "loadtest", "run", "--rate", "nan"], "--rate: 'nan' is not a finite number"),
    (["-m", "loadtest", "run", "--rate", "0"], "--rate: 0 is outside (0.0, inf]"),
    (["-m", "loadtest", "run", "--concurrency", "0"], "--concurrency: 0 is outside [1, inf]"),
    (["-m", "profiler", "sweep", "--budget-s", "inf"], "--budget-s: 'inf' is not a finite"),
    (["-m", "mita.training.train", "--lr", "-1"], "--lr: -1 is outside (0.0, inf]"),
    (["-m", "mita.training.evaluate", "checkpoints/listops-default", "--test-size", "2.5"],
     "--test-size: '2.5' is not a valid int"),
    # Each of these was a traceback (ValueError / RuntimeError / AssertionError) after start.
    (["-m", "mita.training.train", "--out", "/nonexistent/x", "--dim", "63"],
     "config field 'dim' (63) must be even and divisible by num_heads (2)"),
    (["-m", "mita.training.train", "--out", "/nonexistent/x", "--shared-scale", ""],
     "--shared-scale: invalid choice: ''"),
    (["-m", "mita.training.train", "--out", "/nonexistent/x", "--min-length", "500"],
     "empty length range (500, 500)"),
    (["-m", "profiler", "sweep", "--settings", "garbage"],
     "setting 'garbage' is not 'fig5' or MxK (e.g. 32x128)"),
    (["-m", "profiler", "sweep", "--settings", "0x64"],
     "setting '0x64': 'num_landmarks' must be an int ≥ 1, got 0"),
    (["-m", "profiler", "sweep", "--device", "gpu"], "device 'gpu' is not a torch device"),
    (["-m", "profiler", "sweep", "--heads", "3"], "'dim' (128) must be even and divisible by "
                                                  "num_heads (3)"),
    (["-m", "profiler", "sweep", "--settings", "99999999999x1"],
     "'num_landmarks' must be an int in [1, 65536]"),
    (["-m", "profiler", "sweep", "--out", "/dev/null/x"], "Not a directory"),
    (["-m", "mita.training.evaluate", "/nonexistent"], "checkpoint file missing: /nonexistent"),
    (["-m", "mita.training.evaluate", "checkpoints/listops-default", "--min-length", "500"],
     "empty length range (500, 500)"),
    # hung forever: no tree has length 2
    (["-m", "mita.training", "--out", "/tmp/mita-never", "--min-length", "1", "--max-length",
      "3", "--train-size", "1"], "drew 101,000 trees and found 0 of 1"),
    (["-m", "loadtest", "run", "--url", "ftp://127.0.0.1:1"], "--url must start with http://"),
    (["-m", "loadtest", "run", "--n", "2000000"], "--n: 2000000 is outside [1, 1048576]"),
    (["-m", "loadtest", "run", "--out", "/dev/null/x"], "Not a directory"),
    (["-m", "service", "--node-ip", "bogus"], "--node-ip: 'bogus' is not an IP address"),
]
# Every case of STRICT in one interpreter, as `python argv...` runs it: runpy executes the
# module as __main__ with that argv and the exit status is its SystemExit's code (25 fresh
# interpreters, each importing torch and Ray, took ~70 s on 2 cores).
STRICT_DRIVER = """
import contextlib, io, json, runpy, sys, traceback
out = []
for argv in json.loads(sys.argv[1]):
    assert argv[0] == "-m"
    sys.argv = [argv[1], *argv[2:]]
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as e:
            code = e.code
        except BaseException:
            code, _ = "exception", traceback.print_exc()
    out.append([code, err.getvalue()])
print("RESULT " + json.dumps(out))
"""


@pytest.fixture(scope="module")
def strict_exits() -> list:
    """(exit status, stderr) of each case of ``STRICT``, run by ``STRICT_DRIVER``."""
    import sys

    done = subprocess.run([sys.executable, "-c", STRICT_DRIVER,
                           json.dumps([argv for argv, _ in STRICT])], capture_output=True,
                          text=True, timeout=300, cwd=ROOT)
    line = next((x for x in done.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert line, done.stdout[-2000:] + done.stderr[-3000:]
    return json.loads(line.removeprefix("RESULT "))


@pytest.mark.slow  # a subprocess that imports every CLI
@pytest.mark.parametrize("argv,message", STRICT)
def test_command_line_numbers_are_parsed_strictly(argv, message, strict_exits):
    """Every numeric CLI flag is finite and in range (``mita.tools.argtypes``); argparse exits 2
    naming the flag before anything starts."""
    code, stderr = strict_exits[[a for a, _ in STRICT].index(argv)]
    assert code == 2, stderr[-1000:]
    assert message in stderr, stderr[-1000:]




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
    shutil.copytree(Path(__file__).resolve().parents[2] / "checkpoints" / "listops-default",
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
