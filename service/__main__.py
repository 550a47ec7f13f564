"""``python -m service``: run the service on the shipped checkpoint until Ctrl-C or SIGTERM,
then drain (new requests 503, in-flight ones finish) and stop."""

from __future__ import annotations

import os
import sys

# Ray Serve reads RAY_SERVE_THROUGHPUT_OPTIMIZED once, when it is imported (with launch,
# below): python -m service runs Ray's throughput mode unless --ray-serve-default-mode is
# given or the variable is set (benchmarks/serve_overhead.py: faster in both latency
# and throughput). Only when run as a program: importing this module changes nothing.
DEFAULT_MODE_FLAG = "--ray-serve-default-mode"
# How often a running service checks that Ray and its applications are still there
# (running.gone): Ray's core worker aborts a driver 60 s after its GCS went away.
WATCH_S = 2.0
if __name__ == "__main__":
    if DEFAULT_MODE_FLAG in sys.argv[1:]:
        os.environ["RAY_SERVE_THROUGHPUT_OPTIMIZED"] = "0"  # the flag wins over the variable
    else:
        os.environ.setdefault("RAY_SERVE_THROUGHPUT_OPTIMIZED", "1")

import argparse  # noqa: E402
import ipaddress  # noqa: E402
import json  # noqa: E402
import signal  # noqa: E402
import subprocess  # noqa: E402
import threading  # noqa: E402
from pathlib import Path  # noqa: E402

from mita.data.task import Task  # noqa: E402
from mita.tools.argtypes import Parser, bounded  # noqa: E402

from . import launch, preflight, running  # noqa: E402

# The start banner's examples: the README's ListOps expression (its value is 4) and, for a
# text task, a fixed neutral sentence (the checkpoint holds no text of its training rows).
LISTOPS_EXAMPLE = "[MAX 2 [MIN 4 7 ] 0 ]"
TEXT_EXAMPLE = "The quick brown fox jumps over the lazy dog."
JSON_HEADER = "-H 'content-type: application/json'"


def ip_address(text: str) -> str:
    """An IPv4/IPv6 address (Ray's node address is an IP, not a host name)."""
    try:
        return str(ipaddress.ip_address(text))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an IP address") from None


def netloc(ip: str, port: int) -> str:
    """``ip:port`` for a URL, IPv6 in brackets."""
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


def ip_address_or_off(text: str) -> str | None:
    """``ip_address``, or None for "off"."""
    return None if text == "off" else ip_address(text)


def describe(task: Task) -> str:
    """What ``task``'s application classifies, for the start banner's list."""
    if task.listops:
        what = "ListOps expressions"
    elif task.architecture is not None:  # a pretrained transformers model
        what = (f"{task.grid[0]}×{task.grid[1]} images ({task.grid[0] ** 2} pixel ids)"
                if task.grid is not None else
                f"text (its own tokenizer) or token ids, at most {task.positions} tokens")
        what = f"{task.architecture}: {what}"
    elif task.grid is not None:
        h, w = task.grid
        what = f"{h}×{w} grids of token ids ({h * w} tokens)"
    elif task.tokenizer.takes_text:
        what = f"text ({task.tokenizer.kind} tokens) or token ids"
    else:
        what = "token ids"
    what += f", {len(task.labels)} classes"
    if task.max_length is not None:
        kept = "first" if task.truncate == "tail" else "last"
        what += (f"; a longer sequence is cut to its {kept} {task.max_length} tokens "
                 f"(truncate {task.truncate}), as in training")
    return what


def example_command(base: str, task: Task) -> str:
    """A curl command that classifies a valid example of ``task`` at ``base`` (the
    application's URL: the service's, with its route prefix): a ListOps expression, a short
    fixed sentence for a text task, valid ``ids`` for an ids task — exactly H·W of them,
    made by python3, for a grid task."""
    url = f"{base}/v1/classify"
    if task.listops:
        body = json.dumps({"text": LISTOPS_EXAMPLE, "profile": True})
    elif task.grid is None and task.tokenizer.takes_text:
        body = json.dumps({"text": TEXT_EXAMPLE})
    else:
        vocab = task.vocab
        valid = [i for i in range(vocab.size) if i != vocab.pad_id][:8]
        if task.grid is None:
            body = json.dumps({"ids": valid})
        else:
            n = task.grid[0] * task.grid[1]
            code = f"import json; print(json.dumps({{\"ids\": [{valid[0]}] * {n}}}))"
            return f"python3 -c '{code}' | curl -s -X POST {url} {JSON_HEADER} -d @-"
    return f"curl -s -X POST {url} {JSON_HEADER} -d '{body}'"


def banner_lines(url: str, apps: list[tuple[str, str, Task | None]]) -> list[str]:
    """The start banner's list of the applications and their examples: ``apps`` is
    ``(name, route prefix, task)`` per application of the config (task None: unknown, e.g. a
    checkpoint this process could not read; no example then). Every application is listed
    with its prefix and task; each gets a curl example of its own task, at its own prefix."""
    width = max(len(prefix) for _, prefix, _ in apps)
    lines = ["Applications:"]
    for name, prefix, task in apps:
        what = f"task {task.name}: {describe(task)}" if task is not None else "task unknown"
        lines.append(f"  {prefix:<{width}}  {name}, {what}")
    lines.append("Try:")
    for _, prefix, task in apps:
        if task is None:
            continue
        lines.append("  " + example_command(url + prefix.rstrip("/"), task))
        if task.listops:
            lines.append("  (the expression's value is 4; \"label\" is the model's answer, "
                         "right or wrong: see the README for its accuracy)")
    return lines


def served_apps(config) -> list[tuple[str, str, Task | None]]:
    """``(name, route prefix, task)`` of each of the config's applications of this service
    (``banner_lines``); the task None where its checkpoint cannot be read here."""
    from .app import served_config

    apps = []
    for app in config.applications:
        if app.import_path.replace(":", ".") != "service.app.build_app":  # Ray takes both
            continue
        try:
            task = served_config(app.args)[2]
        except (OSError, ValueError):  # checked before the start; e.g. a cluster's own path
            task = None
        apps.append((app.name, app.route_prefix or "/", task))
    return apps


def main(argv: list[str] | None = None) -> None:
    # Parser never matches a prefix: DEFAULT_MODE_FLAG is looked for whole, before argparse runs
    p = Parser(prog="python -m service", description=__doc__)
    p.add_argument("--config", type=Path, default=None,
                   help="Serve config file (default: deploy/serve_config.yaml, or "
                        "deploy/serve_config.gpu.yaml when CUDA is available)")
    p.add_argument("--metrics-port", type=bounded(int, 1, 65535),
                   default=preflight.DEFAULT_METRICS_PORT,
                   help="Ray's metrics exporter; its Prometheus file-SD list is "
                        "/tmp/mita-serve/prometheus/metrics-PORT.json")
    p.add_argument("--metrics-interval-ms", type=bounded(int, 100, 3_600_000), default=5000)
    p.add_argument("--node-ip", default="127.0.0.1", type=ip_address,
                   help="Ray's node address; Ray's metrics exporter binds to it when it is "
                        "loopback (the HTTP host is http_options.host in the config)")
    p.add_argument("--dashboard-host", default="127.0.0.1", type=ip_address_or_off,
                   help="the Ray dashboard, and with it Ray's `serve` CLI (serve status, serve "
                        "deploy FILE, serve config), on this address; 'off': neither")
    p.add_argument("--dashboard-port", type=bounded(int, 1, 65535),
                   default=preflight.DEFAULT_DASHBOARD_PORT,
                   help="the Ray dashboard's port (the serve CLI's default address is "
                        "http://localhost:8265; otherwise pass it with -a)")
    p.add_argument("--address", default=os.environ.get("RAY_ADDRESS") or None,
                   help="deploy on this running Ray cluster (its GCS address, HEAD_IP:6379, or "
                        "'auto' on one of its nodes; default: $RAY_ADDRESS) instead of starting "
                        "Ray here; Ctrl-C then drains and deletes only this application. "
                        "--metrics-*, --node-ip and --dashboard-* are the cluster's own and "
                        "are not used")
    p.add_argument(DEFAULT_MODE_FLAG, action="store_true",
                   help="run Ray Serve in its default mode instead of its throughput mode "
                        "(RAY_SERVE_THROUGHPUT_OPTIMIZED=1, which python -m service sets "
                        "unless the variable is already set; this flag sets it to 0); on a "
                        "cluster joined with --address the replicas run the mode their nodes "
                        "were started in")
    p.add_argument("--check", action="store_true",
                   help="run every check a start makes that starts nothing (the file, its "
                        "user_configs, checkpoints, devices, listening addresses; with "
                        "--address, that a cluster answers there), print the verdict and exit "
                        "(use it before `serve deploy FILE`, which does not)")
    a = p.parse_args(argv)
    path = a.config or launch.default_config()
    dashboard = None if a.dashboard_host is None else (a.dashboard_host, a.dashboard_port)
    try:  # refuse before starting Ray: a bad config, checkpoint or busy port would only
        # fail inside a replica or after Ray's start-up timeout
        config = launch.load_config(path)
        warnings = preflight.preflight(config, address=a.address, metrics_port=a.metrics_port,
                                       node_ip=a.node_ip, dashboard=dashboard,
                                       check_only=a.check)
        for line in warnings:
            print(f"mita-serve: warning: {line}", flush=True)
        if a.check:
            print(f"mita-serve: {path}: OK (the file, its user_configs, checkpoints, devices "
                  "and listening addresses)")
            return
        if a.address is None:
            preflight.use_token_auth()
            launch.prebuild_cpu_kernels(config)  # once here, not in each replica
    except (OSError, ValueError, subprocess.SubprocessError) as e:
        if a.check:
            raise SystemExit(f"mita-serve: {e}") from None
        raise SystemExit(f"mita-serve: refusing to start: {e}") from None
    except KeyboardInterrupt:
        raise SystemExit("mita-serve: interrupted before start-up") from None
    stop = threading.Event()

    def on_signal(*_):
        if not stop.is_set():  # os.write: print() may be mid-write in the main thread
            os.write(sys.stderr.fileno(), b"mita-serve: stopping once start-up is done\n")
        stop.set()
    # From here on a signal only asks to stop: a KeyboardInterrupt inside ray.init left Ray's
    # agents running (holding the metrics port), which ray.shutdown() did not reach. Own
    # handlers, not sigwait: a shell's `&` starts us with SIGINT ignored.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    # A `ray stop` under us: our own line (running.gone), not Serve's long-poll traceback
    running.quiet_dead_controller_polls()
    try:
        url = launch.start(config, a.metrics_port, a.metrics_interval_ms, node_ip=a.node_ip,
                           dashboard_host=a.dashboard_host, dashboard_port=a.dashboard_port,
                           address=a.address)
    except Exception as e:  # e.g. an application failed to deploy, or start-up timed out
        launch.stop()
        raise SystemExit(f"mita-serve: could not start: {type(e).__name__}: {e}") from None
    for sig in (signal.SIGINT, signal.SIGTERM):  # again (ray.init installs its own SIGTERM),
        signal.signal(sig, lambda *_: stop.set())  # and now a signal stops at once
    if stop.is_set():
        launch.stop()
        raise SystemExit("mita-serve: interrupted during start-up; stopped")
    print(f"\nmita-serve is up at {url}  (API docs: {url}/docs)")
    print(f"Live dashboard: {url}/dashboard")
    throughput = os.environ.get("RAY_SERVE_THROUGHPUT_OPTIMIZED") == "1"  # as Serve reads it
    print("Ray Serve mode: " + ("throughput (RAY_SERVE_THROUGHPUT_OPTIMIZED=1; "
                                f"{DEFAULT_MODE_FLAG} for the default mode)" if throughput
                                else "default"))
    metrics_port, metrics_ip = launch.metrics_exporter
    print(f"Prometheus metrics: http://{netloc(metrics_ip, metrics_port)}/metrics (the Gateway's "
          f"node; file-SD list {launch.prometheus_sd_file(metrics_port)}; "
          f"deploy/prometheus/prometheus.yml reads port {preflight.DEFAULT_METRICS_PORT}'s)")
    if a.address is not None:
        print(f"On the Ray cluster at {a.address}: Ctrl-C deletes this application only",
              flush=True)
    elif dashboard is not None:
        address = f"http://{netloc(a.dashboard_host, a.dashboard_port)}"
        print(f"Ray dashboard: {address}  (Ray's serve CLI, with Ray's token authentication: "
              f"RAY_AUTH_MODE=token serve status -a {address}; live changes: "
              f"RAY_AUTH_MODE=token serve deploy FILE -a {address})")
    print("\n".join([*banner_lines(url, served_apps(config)), "Ctrl-C stops."]), flush=True)
    why, seen = None, 0
    try:
        # twice in a row: a controller Ray is restarting answers nothing for a moment
        while seen < 2 and not stop.wait(WATCH_S):
            why = running.gone(config)
            seen = seen + 1 if why else 0
        if seen >= 2:
            raise Gone(why)
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, stop_at_once)
        drain_s = running.drain_time_s(config)
        print(f"mita-serve: draining: new requests get 503, in-flight ones finish (up to "
              f"{drain_s:g} s, the Gateway's graceful_shutdown_timeout_s)", flush=True)
        left = running.drain(config, drain_s)
        print(f"mita-serve: drained ({left} request(s) still in flight); stopping"
              + (": those are cut" if left else ""), flush=True)
    except StopAtOnce:
        stop_now()
    except Gone as e:
        # what is left (our own Ray's processes after serve shutdown) stops; nothing to drain.
        # Said again once stopped: Ray's shutdown may print after the first line (gRPC's
        # "skipping fork() handlers" when a process forks beside a gRPC call), and the last
        # line is what a user or a supervisor reads.
        print(f"mita-serve: {e}; stopping", file=sys.stderr, flush=True)
        launch.stop(at_once=True)
        print(f"mita-serve: {e}; stopped, exiting with status 1", file=sys.stderr, flush=True)
        raise SystemExit(1) from None
    except BaseException:
        launch.stop()
        raise
    try:
        # After the drain, Ray's processes stop without Serve's graceful shutdown: it would
        # wait for requests still in flight once more, up to each deployment's
        # graceful_shutdown_timeout_s (drain 5 s + 11 s to exit with 21 dense requests left;
        # with the shipped 30 s past Serve's own 30 s, "Controller failed to shut down within
        # 30.0s"), and took ~6 s more with none left. On a cluster joined, this application
        # is still deleted (and waited for).
        launch.stop(at_once=a.address is None)
    except StopAtOnce:
        stop_now()


class Gone(Exception):
    """The service was stopped from outside (``running.gone`` says how)."""


class StopAtOnce(BaseException):
    """A second Ctrl-C / SIGTERM, during the drain or Serve's shutdown."""


def stop_at_once(*_):
    # Not SIG_DFL: dying at once left Ray's dashboard and runtime-env agents running, the
    # first still holding the metrics port, and the next start was refused.
    raise StopAtOnce


def stop_now() -> None:
    """After a second signal: Ray's processes stopped without Serve's graceful shutdown,
    exit status 1; a third signal kills."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)
    os.write(sys.stderr.fileno(), b"mita-serve: a second signal: stopping at once, the "
             b"requests in flight are cut\n")
    launch.stop(at_once=True)
    raise SystemExit(1)


if __name__ == "__main__":
    main()
