"""The service on a real two-node Ray cluster on this machine (all addresses loopback).

Run by ``tests/own_ray/test_cluster.py`` in its own process (``python tests/two_node_cluster.py
--out DIR``); it writes ``DIR/cluster_report.json`` and prints one ``RESULT`` line.

1. A head node (custom resource ``mita_gateway``) and a worker node (``mita_classifier``),
   started with Ray's own ``ray.cluster_utils.Cluster``; the head runs Ray's dashboard (Ray's
   state API, as ``ray start --head`` does).
2. ``python -m service --address HEAD --config deploy/serve_config.cluster.yaml`` (the
   README's command, with test ports and short autoscaling delays) joins the cluster.
3. Real ListOps sequences to both variants, answered as the serving engine answers them in
   this process; every replica's node from Ray's state API; the stage metrics read from the
   exporter in the service's Prometheus file-SD list, and from the worker's exporter.
4. A second ``python -m service --address`` for the same application is refused and leaves
   the first one serving.
5. Autoscaling: a closed loop on the MiTA classifier past ``target_ongoing_requests`` until
   Serve's own status shows 2 running replicas, then none; the status is polled until 1.
6. Node loss: the worker is killed (SIGKILL, no drain) during a closed-loop load, restarted
   after ``--outage-s``; the load goes on until both classifiers answer again, and 5 s more.
   A probe sent while no classifier runs anywhere waits for the replacement.
7. Node loss with a replica of each classifier on the surviving node (redeployed: two
   replicas each, at most one per node, on a resource both nodes offer): the worker is killed
   again under load, which goes on for 8 s on the head's replicas.
8. Teardown: SIGTERM to the service (drain, delete the application), then every node.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from loadtest.engine import LoadConfig, run_load  # noqa: E402
from mita.data.listops import ListOpsConfig, encode, generate  # noqa: E402
from mita.tools.argtypes import Parser  # noqa: E402
from service import launch, proxy_guard  # noqa: E402
from tests.helpers import free_port, inherit_priority  # noqa: E402

APP = "mita-serve"
WORKER = {"num_cpus": 2, "resources": {"mita_classifier": 4, "mita_spread": 4}}
T0 = time.monotonic()


def log(*what) -> None:
    print(f"[{time.monotonic() - T0:6.1f} s]", *what, flush=True)


def cluster_config(path: Path, http_port: int) -> None:
    """The shipped cluster config with this run's HTTP port and autoscaling that reacts in
    seconds (the shipped delays are Serve's defaults: 30 s up, 600 s down)."""
    raw = yaml.safe_load((ROOT / "deploy" / "serve_config.cluster.yaml").read_text())
    raw["http_options"]["port"] = http_port
    for dep in raw["applications"][0]["deployments"]:
        if "autoscaling_config" in dep:
            dep["autoscaling_config"].update(metrics_interval_s=0.5, look_back_period_s=2.0,
                                             upscale_delay_s=1.0, downscale_delay_s=3.0)
    _written(path, raw)


def _written(path: Path, raw: dict) -> Path:
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


class Probe:
    """One MiTA request sent ``at_s`` seconds from now, in its own thread: (status, latency,
    Retry-After, body)."""

    def __init__(self, url: str, at_s: float):
        self.out: dict = {}
        self.thread = threading.Thread(target=self._run, args=(url, at_s), daemon=True)
        self.thread.start()

    def _run(self, url: str, at_s: float) -> None:
        time.sleep(at_s)
        t = time.monotonic()
        r = httpx.post(f"{url}/v1/classify", json={"ids": [12, 3, 5, 15], "variant": "mita"},
                       timeout=150)
        self.out = {"status": r.status_code, "latency_s": round(time.monotonic() - t, 2),
                    "retry_after": r.headers.get("retry-after"), "body": r.json()}

    def result(self) -> dict:
        self.thread.join(timeout=160)
        return self.out


def loss_report(samples: list, killed_at: float, restarted_at: float | None) -> dict:
    """What a closed loop saw around a node's loss at ``killed_at``: answers, failures (by
    status, with their messages), latency p50/p99/max, and the first answer and the last
    failure after ``restarted_at`` (when the node came back, if it did)."""
    statuses = [s.status for _, s in samples]
    ends = sorted((t + s.latency_s, s.status) for t, s in samples)
    failed = [s for _, s in samples if s.status != 200]
    last_failed = max((t for t, st in ends if st != 200), default=None)
    lat = np.array([s.latency_s for _, s in samples])
    out = {"load": {"n": 256, "variants": "ab", "concurrency": 4},
           "sent": len(samples), "ok": statuses.count(200), "failed": len(failed),
           "failed_by_status": {str(st): statuses.count(st) for st in set(statuses)
                                if st != 200},
           "errors": sorted({s.error for s in failed}),
           "p50_latency_s": round(float(np.percentile(lat, 50)), 3),
           "p99_latency_s": round(float(np.percentile(lat, 99)), 2),
           "max_latency_s": round(float(lat.max()), 2),
           # requests that were in flight or sent while the node was gone
           "during_loss": sum(1 for t, s in samples if t + s.latency_s > killed_at
                              and (restarted_at is None or t < restarted_at)),
           "last_status": ends[-1][1] if ends else None,
           "ok_after_last_failure": sum(1 for t, st in ends
                                        if last_failed is not None and t > last_failed)}
    if restarted_at is not None:
        first_ok = next((t for t, st in ends if st == 200 and t > restarted_at), None)
        out["first_ok_after_restart_s"] = (None if first_ok is None
                                           else round(first_ok - restarted_at, 1))
    return out


def retries(target: str) -> dict[str, float]:
    """``retries_total`` per variant at the exporter ``target``."""
    m = metric_sums(target)
    return {v: sum(val for k, val in m.items()
                   if k.startswith(f"ray_mita_serve_retries_total|variant={v}"))
            for v in ("mita", "dense")}


def replica_nodes() -> dict[str, list[str]]:
    """Node id of every live replica, per deployment, from Ray's state API."""
    from ray.util.state import list_actors

    out: dict[str, list[str]] = {}
    for actor in list_actors(filters=[("state", "=", "ALIVE")], limit=1000):
        prefix = f"ServeReplica:{APP}:"
        if actor.class_name.startswith(prefix):
            out.setdefault(actor.class_name.removeprefix(prefix), []).append(actor.node_id)
    return {name: sorted(nodes) for name, nodes in out.items()}


def replica_states(name: str) -> dict[str, int]:
    from ray import serve

    return dict(serve.status().applications[APP].deployments[name].replica_states)


def metric_sums(url: str) -> dict[str, float]:
    """``ray_mita_serve_*`` sample values at ``url``, summed by name and selected labels."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(httpx.get(url, timeout=10).text):
        for s in fam.samples:
            if not s.name.startswith("ray_mita_serve_"):
                continue
            key = s.name + "".join(f"|{k}={s.labels[k]}" for k in ("variant", "stage", "status")
                                   if k in s.labels)
            out[key] = out.get(key, 0.0) + s.value
    return out


class Load:
    """Closed-loop load from the project's load tester, in back-to-back phases of
    ``phase_s`` until ``stop()``, so a phase ends when the scenario has seen what it waits
    for (a slower machine takes longer, not a different path). ``samples``: (start time on
    ``time.monotonic``, Sample)."""

    def __init__(self, url: str, n: int, variant: str, concurrency: int, phase_s: float = 8):
        self.cfg = LoadConfig(url=url, ns=[n], variants=[variant], warmup=0,
                              concurrency=concurrency, requests=1_000_000, duration_s=phase_s,
                              timeout_s=150)
        self.samples: list = []
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            t0 = time.monotonic()  # the phase's own clock starts a few ms later
            self.samples += [(t0 + s.start_s, s) for s in asyncio.run(run_load(self.cfg))]

    def stop(self) -> list:
        self._stop.set()
        self.thread.join()
        return self.samples


def main() -> None:
    p = Parser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--outage-s", type=float, default=6.0)
    a = p.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    report: dict = {}

    import ray
    from ray.cluster_utils import Cluster

    launch.loopback_only()
    # The README's `export RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH=…` on every node: the
    # nodes below inherit it.
    os.environ[proxy_guard.CALLBACK_VARIABLE] = proxy_guard.CALLBACK
    head_metrics, worker_metrics, http_port = free_port(), free_port(), free_port()
    cluster = Cluster(initialize_head=True, head_node_args={
        "node_ip_address": "127.0.0.1", "num_cpus": 2,
        "resources": {"mita_gateway": 1, "mita_spread": 4},
        "metrics_export_port": head_metrics, "include_dashboard": True,
        "dashboard_host": "127.0.0.1", "dashboard_port": free_port(),
        "_system_config": {"metrics_report_interval_ms": 500}})
    # First, so the test can find and stop whatever this run leaves, whatever happens next.
    (a.out / "gcs_address").write_text(cluster.address)
    report["gcs_address"] = cluster.address
    service = None
    try:
        worker = cluster.add_node(node_ip_address="127.0.0.1",
                                  metrics_export_port=worker_metrics, **WORKER)
        report["nodes"] = {"head": cluster.head_node.node_id, "worker": worker.node_id}
        log("cluster up", cluster.address, report["nodes"])
        config = a.out / "serve_config.yaml"
        cluster_config(config, http_port)
        with open(a.out / "service.log", "w") as service_log:  # the child keeps its copy
            service = subprocess.Popen(
                [sys.executable, "-m", "service", "--address", cluster.address,
                 "--config", str(config)], cwd=ROOT, stdout=service_log,
                stderr=subprocess.STDOUT, start_new_session=True,
                preexec_fn=inherit_priority())
        deadline = time.monotonic() + 150
        while "mita-serve is up" not in (a.out / "service.log").read_text():
            if service.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("python -m service --address did not come up: "
                                   + (a.out / "service.log").read_text()[-3000:])
            time.sleep(0.5)
        report["service_up_s"] = round(time.monotonic() - T0, 1)
        log("service up")
        ray.init(address=cluster.address, namespace="serve", logging_level="warning")
        url = f"http://127.0.0.1:{http_port}"
        client = httpx.Client(base_url=url, timeout=60)
        # the cluster's proxy runs the guard: HTTP it cannot parse gets the JSON 400
        with socket.create_connection(("127.0.0.1", http_port), timeout=30) as s:
            s.sendall(b"POST /v1/classify HTTP/1.1\r\nHost: x\r\nContent-Length: 1x\r\n\r\n")
            raw = b"".join(iter(lambda: s.recv(65536), b""))
        head = raw.partition(b"\r\n\r\n")[0].decode(errors="replace").lower()
        report["proxy_guard_400"] = [int(head.split()[1]),
                                     "content-type: application/json" in head]

        # -- answers and placement ---------------------------------------------------------
        from service.engine import ClassifierEngine

        examples = generate(6, seed=21_001, cfg=ListOpsConfig(100, 400))
        answers = {}
        for variant in ("mita", "dense"):
            engine = ClassifierEngine("checkpoints/listops-default", variant, "cpu")
            got, want = [], []
            for text, _ in examples:
                r = client.post("/v1/classify", json={"text": text, "variant": variant,
                                                      "profile": "staged"})
                r.raise_for_status()
                got.append(r.json())
                want.append(engine.run([np.asarray(encode(text))], True, [True])[0])
            answers[variant] = {
                "labels": [g["label"] for g in got], "labels_here": [w["label"] for w in want],
                "max_abs_diff": max(float(np.max(np.abs(np.subtract(g["probabilities"],
                                                                    w["probabilities"]))))
                                    for g, w in zip(got, want, strict=True)),
                "tokens": sum(g["n"] for g in got)}
        report["answers"] = answers
        report["placement"] = replica_nodes()
        report["models_node_id"] = {v: info["node_id"] for v, info in
                                    client.get("/v1/models").json()["variants"].items()}
        log("answers", answers, "placement", report["placement"])

        # -- metrics: the file-SD list's exporter, and the worker's ------------------------
        sd = json.loads(launch.prometheus_sd_file(head_metrics).read_text())
        report["sd_targets"] = [t for group in sd for t in group["targets"]]
        target = f"http://{report['sd_targets'][0]}/metrics"
        want_count = float(len(examples))

        def exported():  # the histograms and the counters (exported apart, every 0.5 s)
            m = metric_sums(target)
            return all(m.get(f"ray_mita_serve_stage_duration_seconds_count|variant={v}"
                             f"|stage=attention", 0) >= want_count
                       and m.get(f"ray_mita_serve_requests_total|variant={v}|status=200", 0)
                       >= want_count for v in ("mita", "dense"))
        deadline = time.monotonic() + 30
        while not exported() and time.monotonic() < deadline:
            time.sleep(0.5)
        scraped = metric_sums(target)
        report["scraped"] = {k: v for k, v in scraped.items() if k.split("|")[0] in (
            "ray_mita_serve_stage_duration_seconds_count", "ray_mita_serve_tokens_total",
            "ray_mita_serve_requests_total")}
        report["worker_exporter_mita_serve_series"] = len(
            metric_sums(f"http://127.0.0.1:{worker_metrics}/metrics"))
        log("metrics", report["sd_targets"], report["worker_exporter_mita_serve_series"])

        # -- a second instance on the same cluster is refused, and deletes nothing ----------
        t = time.monotonic()
        second = subprocess.run(
            [sys.executable, "-m", "service", "--address", cluster.address, "--config",
             str(config)], cwd=ROOT, capture_output=True, text=True, timeout=120)
        report["second_instance"] = {
            "returncode": second.returncode, "seconds": round(time.monotonic() - t, 1),
            "message": [line for line in second.stderr.splitlines()
                        if line.startswith("mita-serve:")],
            "first_still_answers": client.post("/v1/classify", json={
                "ids": [12, 3, 5, 15], "variant": "mita"}).status_code}
        log("second instance", report["second_instance"])

        # -- autoscaling ---------------------------------------------------------------------
        load = Load(url, n=2048, variant="mita", concurrency=24)
        load_started = time.monotonic()
        counts = []
        while time.monotonic() - load_started < 120:
            counts.append((round(time.monotonic() - T0, 1), replica_states("MiTAClassifier")))
            if counts[-1][1].get("RUNNING", 0) == 2:
                report["scaled_up_nodes"] = replica_nodes().get("MiTAClassifier")
                break
            time.sleep(1.0)
        up_at = counts[-1][0] if counts[-1][1].get("RUNNING", 0) == 2 else None
        time.sleep(3)  # two replicas serving the load
        statuses = [s.status for _, s in load.stop()]
        load_ended = round(time.monotonic() - T0, 1)
        while time.monotonic() - T0 - load_ended < 60:
            counts.append((round(time.monotonic() - T0, 1), replica_states("MiTAClassifier")))
            if counts[-1][1] == {"RUNNING": 1}:
                break
            time.sleep(1.0)
        report["autoscaling"] = {
            "load": {"n": 2048, "concurrency": 24, "sent": len(statuses),
                     "ok": statuses.count(200)},
            "load_started_s": round(load_started - T0, 1), "load_ended_s": load_ended,
            "two_running_at_s": up_at, "status": counts,
            "max_running": max(c.get("RUNNING", 0) for _, c in counts),
            "final": counts[-1][1]}
        log("autoscaling", report["autoscaling"]["max_running"], counts[-1])

        # -- node loss: no classifier replica on the surviving node ------------------------
        load = Load(url, n=256, variant="ab", concurrency=4)
        time.sleep(4)
        killed_at = time.monotonic()
        cluster.remove_node(worker, allow_graceful=False)
        log("worker killed")
        probe = Probe(url, at_s=1.0)  # one request sent while no classifier runs anywhere
        time.sleep(a.outage_s)
        restarted_at = time.monotonic()
        worker = cluster.add_node(node_ip_address="127.0.0.1",
                                  metrics_export_port=free_port(), **WORKER)
        log("worker restarted")

        def both_answer() -> bool:
            return all(client.post("/v1/classify", json={"ids": [12, 3, 5, 15], "variant": v}
                                   ).status_code == 200 for v in ("mita", "dense"))
        while not both_answer() and time.monotonic() - restarted_at < 150:
            time.sleep(0.5)
        time.sleep(5)  # the load goes on with the service back
        report["node_loss"] = loss_report(load.stop(), killed_at, restarted_at) | {
            "outage_s": round(restarted_at - killed_at, 1), "probe": probe.result(),
            "answers_after": {v: client.post("/v1/classify", json={
                "ids": [12, 3, 5, 15], "variant": v}).status_code for v in ("mita", "dense")},
            "placement_after": replica_nodes(), "new_worker": worker.node_id,
            "retries": retries(target)}
        log("node loss", report["node_loss"])

        # -- node loss: a replica of each classifier on the surviving node too ------------
        # Both nodes offer mita_spread; two replicas of each classifier, at most one a node.
        spread = yaml.safe_load(config.read_text())
        for dep in spread["applications"][0]["deployments"]:
            if dep["name"] != "Gateway":
                dep.pop("autoscaling_config")
                dep.update(num_replicas=2, max_replicas_per_node=1)
                dep["ray_actor_options"]["resources"] = {"mita_spread": 1}
        launch.deploy(launch.load_config(_written(a.out / "spread.yaml", spread)))
        report["spread_placement"] = replica_nodes()
        log("spread", report["spread_placement"])
        load = Load(url, n=256, variant="ab", concurrency=4)
        time.sleep(4)
        before = retries(target)
        killed_at = time.monotonic()
        cluster.remove_node(worker, allow_graceful=False)
        log("worker killed again")
        time.sleep(8)  # the load goes on with one replica of each classifier, on the head
        report["node_loss_spread"] = loss_report(load.stop(), killed_at, None) | {
            "retries": {k: v - before.get(k, 0) for k, v in retries(target).items()},
            "placement_after": replica_nodes()}
        log("node loss, spread", report["node_loss_spread"])
    finally:
        if service is not None:
            service.send_signal(signal.SIGTERM)
            try:
                report["service_exit"] = service.wait(timeout=90)
            except subprocess.TimeoutExpired:
                os.killpg(service.pid, signal.SIGKILL)
                report["service_exit"] = "killed after 90 s"
        ray.shutdown()
        try:
            cluster.shutdown()
        except Exception as e:  # the test still kills what is left, by the GCS address
            report["cluster_shutdown_error"] = f"{type(e).__name__}: {e}"
        report["total_s"] = round(time.monotonic() - T0, 1)
        (a.out / "cluster_report.json").write_text(json.dumps(report, indent=1))
        print("RESULT " + json.dumps({"report": str(a.out / "cluster_report.json")}),
              flush=True)


if __name__ == "__main__":
    main()
