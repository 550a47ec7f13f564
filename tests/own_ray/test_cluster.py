"""The service on a two-node Ray cluster (``tests/two_node_cluster.py``, in its own process):
placement by custom resource, answers, metrics through the head's exporter, autoscaling seen
in Serve's status, and the loss and return of the worker node under load."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from ..helpers import inherit_priority

pytestmark = pytest.mark.service
ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = ROOT / "test-artifacts"


def cluster_processes(gcs_address: str) -> list[psutil.Process]:
    """Live processes of the cluster at ``gcs_address``: its GCS server, raylets, agents and
    workers all carry the address (or its port) on their command line."""
    port = gcs_address.rsplit(":", 1)[1]
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        line = " ".join(proc.info["cmdline"] or [])
        if gcs_address in line or f"--gcs_server_port={port}" in line:
            found.append(proc)
    return found


@pytest.fixture(scope="module")
def report():
    out = ARTIFACTS / "cluster"
    out.mkdir(parents=True, exist_ok=True)
    for name in ("cluster_report.json", "gcs_address"):
        (out / name).unlink(missing_ok=True)
    proc = subprocess.Popen([sys.executable, str(ROOT / "tests" / "two_node_cluster.py"),
                             "--out", str(out)], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            preexec_fn=inherit_priority())
    leftovers: list = []
    try:
        output, _ = proc.communicate(timeout=360)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
    finally:
        # Whatever happened, nothing of the cluster may outlive the test: its nodes, and the
        # service (its own session; its command line carries the address too).
        if (out / "gcs_address").exists():
            leftovers = cluster_processes((out / "gcs_address").read_text())
            for p in leftovers:
                try:
                    p.kill()
                except psutil.NoSuchProcess:  # it exited meanwhile
                    pass
    (out / "driver.log").write_text(output)
    path = out / "cluster_report.json"
    assert path.exists(), output[-4000:]
    result = json.loads(path.read_text())
    result["leftover_processes"] = len(leftovers)
    print("cluster report:", json.dumps({k: v for k, v in result.items()
                                         if k not in ("scraped", "answers")}))
    return result


def test_the_driver_ran_every_phase_and_cleaned_up(report):
    assert "node_loss_spread" in report, report  # the driver reached the last phase
    assert report["proxy_guard_400"] == [400, True]
    assert report["service_exit"] == 0  # SIGTERM: drained, deleted its application, exited
    assert report["leftover_processes"] == 0  # every Ray process of the cluster stopped
    assert report["total_s"] < 300


def test_gateway_on_the_head_classifiers_on_the_worker(report):
    head, worker = report["nodes"]["head"], report["nodes"]["worker"]
    assert report["placement"] == {"Gateway": [head], "MiTAClassifier": [worker],
                                   "DenseClassifier": [worker]}
    assert report["models_node_id"] == {"mita": worker, "dense": worker}


def test_answers_from_the_worker_equal_the_engine_here(report):
    for variant, got in report["answers"].items():
        assert got["labels"] == got["labels_here"], variant
        # Same checkpoint, same engine, one unpadded float32 forward per sequence; only
        # BLAS blocking by thread count could differ (seen: 0; ≤ 1e-6 allowed).
        assert got["max_abs_diff"] <= 1e-6, variant


def test_worker_stage_metrics_reach_the_exporter_prometheus_scrapes(report):
    # The file-SD list that python -m service writes names one exporter: the head's, where
    # the gateway runs; the forwards ran on the worker, whose exporter has no mita_serve
    # series at all (the classifiers record none).
    assert len(report["sd_targets"]) == 1 and report["sd_targets"][0].startswith("127.0.0.1:")
    scraped = report["scraped"]
    sent = 6  # staged requests per variant (two_node_cluster.py)
    mita_stages = ("pool", "landmark_scores", "topk", "shared_compress", "route", "gather",
                   "attention")
    for stage in mita_stages:
        key = f"ray_mita_serve_stage_duration_seconds_count|variant=mita|stage={stage}"
        assert scraped[key] == sent, key
    assert scraped["ray_mita_serve_stage_duration_seconds_count|variant=dense|stage=attention"
                   ] == sent
    for variant in ("mita", "dense"):
        assert scraped[f"ray_mita_serve_requests_total|variant={variant}|status=200"] == sent
        assert (scraped[f"ray_mita_serve_tokens_total|variant={variant}"]
                == report["answers"][variant]["tokens"])
    assert report["worker_exporter_mita_serve_series"] == 0


def test_mita_classifier_scales_up_on_the_worker_and_back_down(report):
    auto = report["autoscaling"]
    assert auto["max_running"] == 2 and auto["two_running_at_s"] is not None, auto["status"]
    assert report["scaled_up_nodes"] == [report["nodes"]["worker"]] * 2
    assert auto["final"] == {"RUNNING": 1}, auto["status"]
    assert auto["load"]["ok"] == auto["load"]["sent"] > 0  # scaling dropped no request


def test_node_loss_without_a_surviving_replica_waits_for_the_replacement(report):
    """Both classifiers only on the worker, which is killed and comes back after the outage:
    the requests it held are sent again and, with no replica anywhere, wait in Serve's queue
    within their deadline (120 s) until the new worker's replicas run. On main 76 of 385
    failed with 503 ("no ... replica is running"); now every request is answered 200, later."""
    loss = report["node_loss"]
    assert loss["failed"] == 0, loss
    assert loss["during_loss"] > 0
    # the probe sent a second after the loss waited for the replacement, within the deadline
    probe = loss["probe"]
    assert probe["status"] == 200 and probe["body"]["variant"] == "mita", probe
    assert loss["outage_s"] - 1 < probe["latency_s"] < 120, probe
    assert loss["max_latency_s"] < 120 and loss["last_status"] == 200
    assert loss["first_ok_after_restart_s"] is not None
    assert loss["answers_after"] == {"mita": 200, "dense": 200}
    new = loss["new_worker"]
    assert loss["placement_after"]["MiTAClassifier"] == [new]
    assert loss["placement_after"]["DenseClassifier"] == [new]
    assert loss["placement_after"]["Gateway"] == [report["nodes"]["head"]]


def test_node_loss_with_a_replica_of_each_classifier_on_the_survivor_fails_nothing(report):
    head = report["nodes"]["head"]
    placed = report["spread_placement"]
    for name in ("MiTAClassifier", "DenseClassifier"):
        assert len(placed[name]) == 2 and head in placed[name], placed
    loss = report["node_loss_spread"]
    assert loss["failed"] == 0 and loss["during_loss"] > 0, loss
    assert loss["ok"] == loss["sent"] and loss["last_status"] == 200
    assert loss["placement_after"]["MiTAClassifier"] == [head]
    assert loss["placement_after"]["DenseClassifier"] == [head]


def test_a_second_instance_is_refused_and_deletes_nothing(report):
    second = report["second_instance"]
    assert second["returncode"] == 1
    assert second["message"] == [
        "mita-serve: could not start: ValueError: application(s) 'mita-serve' already run on "
        "this cluster (another python -m service, or serve deploy): stop that one (`serve "
        "delete NAME`) or give the application another name and route_prefix in the config"]
    assert second["first_still_answers"] == 200
