"""Start Ray and deploy the service from a Serve config file, in this process.

The config file is the standard Serve schema (``ServeDeploySchema``), deployed the way
``serve run CONFIG`` deploys it, so the same file works with ``serve deploy`` on a cluster and
in a KubeRay ``RayService``. This module adds what ``serve run`` cannot set: Ray's metrics
export port and interval, and binding Ray to loopback. The checks made before Ray starts:
``service.preflight``.
"""

from __future__ import annotations

import copy
import ipaddress
import json
import os
import signal
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import psutil
import ray
import torch
from ray import serve
from ray._private import ray_constants
from ray.serve._private import api as serve_api
from ray.serve.handle import DeploymentHandle
from ray.serve.schema import ServeDeploySchema

from . import PROJECT_ROOT, proxy_guard
from .config_file import check_serve_file, read_yaml
from .preflight import (
    DEFAULT_DASHBOARD_PORT,
    DEFAULT_METRICS_PORT,
    check_not_running,
    check_service_config,
    missing_resources,
    use_token_auth,
)
from .settings import DEPLOYMENTS, validated

CPU_CONFIG = PROJECT_ROOT / "deploy" / "serve_config.yaml"
GPU_CONFIG = PROJECT_ROOT / "deploy" / "serve_config.gpu.yaml"
# Prometheus file-SD lists, one per instance (named by its metrics port): a second instance on
# the host (another checkout, the test suite while `make serve` runs) writes its own file
# instead of overwriting the one deploy/prometheus/prometheus.yml reads (the default port's).
PROMETHEUS_SD_DIR = Path("/tmp/mita-serve/prometheus")
_written_sd_files: list[Path] = []
# On a cluster this process joined (start(address=...)), stop() deletes the applications
# this process deployed and leaves the cluster's Serve running.
_joined = False
_joined_apps: list[str] = []
# The Serve client start() made, which deploy() uses (None once stop() ran).
_client = None
# The Ray processes (GCS, raylet, agents) of the instance start() started, which stop() makes
# sure have ended: Ray's agents outlived ray.shutdown() once the GCS was stopped under it.
_own_ray: list[psutil.Process] = []
# (port, ip) of the metrics exporter of the Gateway's node, once start() has deployed.
metrics_exporter: tuple[int, str] | None = None


def prometheus_sd_file(metrics_port: int) -> Path:
    """The file-SD list of the instance whose Ray metrics exporter listens on
    ``metrics_port``."""
    return PROMETHEUS_SD_DIR / f"metrics-{metrics_port}.json"


def default_config() -> Path:
    return GPU_CONFIG if torch.cuda.is_available() else CPU_CONFIG


def load_config(path: str | Path, overrides: dict | None = None) -> ServeDeploySchema:
    """Read a Serve config file and apply ``overrides``: ``{"http_options": {...},
    "args": {...}, "deployments": {name: {field: value}}}`` merged into the first (only)
    application. The file and the merged result are parsed strictly (``config_file``: no
    duplicate keys, no unknown keys, finite bounded numbers), then by Serve's
    ``ServeDeploySchema`` and this service's own schemas (``check_service_config``).
    Raises OSError when the file cannot be read, ValueError naming the file and each refused
    field."""
    raw = read_yaml(path)
    check_serve_file(raw, str(path))
    overrides = overrides or {}
    raw.setdefault("http_options", {}).update(overrides.get("http_options", {}))
    app = raw["applications"][0]
    app.setdefault("args", {}).update(overrides.get("args", {}))
    by_name = {d["name"]: d for d in app.get("deployments", [])}
    for name, fields in overrides.get("deployments", {}).items():
        target = by_name.setdefault(name, {"name": name})
        for key, value in fields.items():
            if isinstance(value, dict) and isinstance(target.get(key), dict):
                target[key] = {**copy.deepcopy(target[key]), **value}
            else:
                target[key] = value
    app["deployments"] = list(by_name.values())
    if overrides:
        check_serve_file(raw, f"{path} with overrides")
    config = validated(ServeDeploySchema, raw, str(path))
    try:
        check_service_config(config)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None
    return config


def start(config: ServeDeploySchema, metrics_port: int = DEFAULT_METRICS_PORT,
          metrics_interval_ms: int = 10000, timeout_s: float = 300.0,
          node_ip: str = "127.0.0.1", dashboard_host: str | None = None,
          dashboard_port: int = DEFAULT_DASHBOARD_PORT, address: str | None = None) -> str:
    """Start Ray and Serve's HTTP proxy, deploy ``config`` and wait until it runs. Returns the
    base URL.

    Safe defaults: the HTTP proxy binds to ``config.http_options.host`` (127.0.0.1 in the
    shipped configs); Ray's node address is ``node_ip`` (127.0.0.1), which makes Ray's metrics
    exporter on ``metrics_port`` bind to loopback; the Ray dashboard (and with it the REST
    API of Ray's ``serve`` CLI: ``serve status``, ``serve deploy``) runs only when
    ``dashboard_host`` is given, on ``dashboard_port`` ("127.0.0.1": this machine only, what
    ``python -m service`` passes by default).

    Without ``address`` this process starts a Ray of its own, even where ``ray start`` ran on
    this machine. ``address`` (a running cluster's GCS address, ``ip:port``, or ``auto``):
    join that cluster as a driver instead of starting Ray; the node settings above are the
    cluster's own and are ignored, and ``stop()`` then deletes only this config's applications.
    Either way the Prometheus file-SD list (``prometheus_sd_file``) names the metrics exporter
    of the node the Gateway runs on, where every ``mita_serve`` metric is recorded
    (``gateway_exporter``). Proxy variables never reach traffic to this machine: loopback (and
    a non-loopback ``node_ip``) is added to ``NO_PROXY`` first (``no_proxy_for_this_machine``),
    with a warning when a proxy variable is set.

    Raises: RuntimeError if an application fails to deploy or ``timeout_s`` passes;
    ConnectionError if no cluster answers at ``address``.
    """
    # Serve waits 5 s for a new HTTP proxy by default; a loaded 2-core machine needs longer,
    # and the config file has no field for it.
    os.environ.setdefault("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", "60")
    # Deadlines for slow and stalled clients in Serve's HTTP proxy (service.proxy_guard):
    # read from the environment of the Ray started here (a joined cluster's nodes: theirs).
    os.environ.setdefault(proxy_guard.CALLBACK_VARIABLE, proxy_guard.CALLBACK)
    local = [] if address is not None or ipaddress.ip_address(node_ip).is_loopback else [node_ip]
    proxies = no_proxy_for_this_machine(local)
    if proxies:
        print(f"mita-serve: warning: {', '.join(proxies)} set: traffic to this machine "
              f"bypasses the proxy (NO_PROXY and no_proxy now include "
              f"{', '.join([*LOOPBACK_HOSTS, *local])}); "
              "on a joined cluster the nodes keep their own environment: start them with "
              "NO_PROXY naming loopback and their addresses", flush=True)
    global _joined, metrics_exporter
    if address is not None:
        _joined = True  # from here on stop() never shuts down the cluster's Serve
        if not ray.is_initialized():
            host = address.rsplit(":", 1)[0].strip("[]")
            if host in ("localhost", "127.0.0.1", "::1"):
                loopback_only()  # else Ray dials the machine's routable address instead
            try:
                with own_sigterm_kept():
                    ray.init(address=address, namespace="serve")
            except ConnectionError as e:
                if os.environ.get("RAY_AUTH_MODE") != "token":
                    raise ConnectionError(
                        f"{e} If the cluster uses Ray's token authentication (`ray start "
                        "--head` turns it on in Ray 2.60), export RAY_AUTH_MODE=token with the "
                        "cluster's token (~/.ray/auth_token or RAY_AUTH_TOKEN).") from None
                raise
        check_not_running(config)
        for line in missing_resources(config):
            print(f"mita-serve: warning: {line}", flush=True)
    elif not ray.is_initialized():
        # Serve's throughput mode keeps a stopping ingress replica 30 s on its direct-ingress
        # port, for external load balancers aimed at that port. Ours come through Serve's
        # proxy, and drain() has finished the requests in flight, so every stop and SIGTERM
        # waited those 30 s for nothing. On a joined cluster the cluster's setting holds.
        os.environ.setdefault("RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S", "0")
        use_token_auth()
        if ipaddress.ip_address(node_ip).is_loopback:
            loopback_only()
        # address="local": a Ray of its own. Without it ray.init() joins the cluster the last
        # `ray start` on this machine recorded (RAY_TMPDIR/ray/ray_current_cluster), and there
        # refuses _system_config: a ValueError at every start. (python -m service passes
        # RAY_ADDRESS as address.)
        with own_sigterm_kept():
            ray.init(address="local", namespace="serve",
                     include_dashboard=dashboard_host is not None,
                     dashboard_host=dashboard_host or "127.0.0.1", dashboard_port=dashboard_port,
                     _node_ip_address=node_ip,
                     _metrics_export_port=metrics_port,
                     _system_config={"metrics_report_interval_ms": metrics_interval_ms})
    global _client
    if not _joined:
        _own_ray.extend(ray_processes())  # its GCS, raylet and agents, for stop()
    began = time.monotonic()
    client = _client = serve_api.serve_start(http_options=config.http_options.model_dump(),
                                             proxy_location=config.proxy_location)
    names = [a.name for a in config.applications]
    if _joined:
        _joined_apps.extend(names)  # from here on, stop() deletes them
        deploy(with_cluster_apps(config, client.get_serve_details()), timeout_s, names)
    else:
        deploy(config, timeout_s)
    where = (f"joined the Ray cluster at {address} and its Serve" if _joined else
             f"started a Ray of its own (node {node_ip}) and Serve's HTTP proxy")
    print(f"mita-serve: {where}; deployed {', '.join(names)} "
          f"({sum(len(a.deployments) for a in config.applications)} deployments) in "
          f"{time.monotonic() - began:.0f} s", flush=True)
    for app in config.applications:
        if app.import_path.replace(":", ".") == "service.app.build_app":
            metrics_exporter = gateway_exporter(app.name)
            write_prometheus_sd(*metrics_exporter)
    http = config.http_options
    return f"http://{http.host}:{http.port}"


@contextmanager
def own_sigterm_kept():
    """Put back, after the block (``ray.init``), a SIGTERM handler of the caller's own (a
    Python callable, e.g. ``python -m service``'s "stop once start-up is done"). ray.init
    installs Ray's, which exits at once, and Ray's C++ failure handler then aborts the
    process (SIGABRT, a stack dump) in the middle of the deployments' start. A default or
    ignored SIGTERM, or a call off the main thread, is left to Ray."""
    main = threading.current_thread() is threading.main_thread()
    own = signal.getsignal(signal.SIGTERM) if main else None
    try:
        yield
    finally:
        if callable(own):
            signal.signal(signal.SIGTERM, own)


def with_cluster_apps(config: ServeDeploySchema, details: dict) -> ServeDeploySchema:
    """``config`` plus, unchanged, every application another user deployed on the cluster
    from a config (``serve deploy``, the declarative API; ``details``: the controller's
    ``get_serve_details()``). Serve applies a config as the whole set of such applications
    and deletes those it does not name; applications started from Python (``serve.run``)
    are not affected either way."""
    ours = {a.name for a in config.applications}
    others = [app["deployed_app_config"] for name, app in details.get("applications", {}).items()
              if name not in ours and app.get("source") == "declarative"
              and app.get("deployed_app_config")]
    if not others:
        return config
    raw = config.model_dump(exclude_unset=True)
    raw["applications"] = others + raw["applications"]
    return ServeDeploySchema.model_validate(raw)


LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
PROXY_VARIABLES = ("http_proxy", "https_proxy", "all_proxy", "grpc_proxy")


def no_proxy_for_this_machine(hosts: list[str] | None = None) -> list[str]:
    """Add loopback (``LOOPBACK_HOSTS``) and ``hosts`` to ``NO_PROXY`` and ``no_proxy`` (and to
    ``no_grpc_proxy`` when set, which gRPC then reads instead) of this process, keeping what
    they name; the Ray processes started from here inherit them. With a proxy variable set,
    Ray workers' metric export to the node's agent (gRPC, which honours the variables) went to
    the proxy: ``/metrics`` lost every ``ray_mita_serve_*`` and ``ray_serve_*`` series.
    Returns the proxy variables that are set (either case), for a warning."""
    for name in ("NO_PROXY", "no_proxy", "no_grpc_proxy"):
        if name == "no_grpc_proxy" and name not in os.environ:
            continue
        have = [h.strip() for h in os.environ.get(name, "").split(",") if h.strip()]
        os.environ[name] = ",".join(have + [h for h in (*LOOPBACK_HOSTS, *(hosts or ()))
                                           if h not in have])
    return [name for name in os.environ if name.lower() in PROXY_VARIABLES
            and os.environ[name]]


def loopback_only() -> None:
    """Keep this process's Ray on loopback addresses. On Linux Ray swaps a loopback address
    (of a node it starts, or of a cluster it joins) for the machine's routable one
    (``services.resolve_ip_for_localhost``) unless it runs in its single-machine mode; that
    mode keeps Ray's servers, and the metrics exporter, on loopback."""
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    ray_constants.ENABLE_RAY_CLUSTER = False


def driver_handle(deployment: str, app_name: str) -> DeploymentHandle:
    """A handle to ``deployment`` of ``app_name`` that this (synchronous) process can call
    with ``.remote().result()`` in either of Ray Serve's modes. With
    ``RAY_SERVE_THROUGHPUT_OPTIMIZED=1`` Serve runs a handle's router on the caller's event
    loop, and a call from outside one raised "No event loop running"; this handle's router
    runs on Serve's own router thread, as in the default mode (the way Ray's own LLM
    broadcast helper initialises its handles)."""
    handle = serve.get_deployment_handle(deployment, app_name=app_name)
    if not handle.is_initialized:  # Serve hands out one cached handle per deployment
        handle._init(_run_router_in_separate_loop=True)
    return handle


def gateway_exporter(app_name: str) -> tuple[int, str]:
    """``(port, ip)`` of Ray's metrics exporter on the node that runs application
    ``app_name``'s Gateway replica (asked of the replica, then looked up in ``ray.nodes()``).
    The gateway records all of the service's metrics, from the profiles the classifiers send
    back, so on a cluster this one exporter has them whichever node ran the forwards.
    Raises RuntimeError when Ray lists no such node."""
    node_id = driver_handle(DEPLOYMENTS["gateway"], app_name).node_id.remote().result(
        timeout_s=30)
    node = next((n for n in ray.nodes() if n["NodeID"] == node_id and n["Alive"]), None)
    if node is None:
        raise RuntimeError(f"the Gateway's node {node_id} is not among Ray's live nodes")
    return int(node["MetricsExportPort"]), node["NodeManagerAddress"]


def prebuild_cpu_kernels(config: ServeDeploySchema) -> None:
    """Build MiTA's CPU kernels (``mita.kernels.cpu``, ~1 min the first time on a machine)
    before the replicas start, when an application will run them: its classifier on the CPU
    with ``mita_backend`` other than ``torch``. Replicas then import the cached build in their
    constructor. A failed build, or another process's build still holding the lock after
    ``MITA_CPU_BUILD_TIMEOUT_S``, is logged in one line and the replicas try again (bounded)."""
    from .engine import pick_device

    for app in config.applications:
        args = app.args or {}
        on_cpu = pick_device(args.get("device", "auto")).type == "cpu"
        if on_cpu and args.get("mita_backend", "auto") != "torch":
            from mita.kernels import cpu

            cpu.load()
            return


def write_prometheus_sd(metrics_port: int, host: str = "127.0.0.1") -> Path:
    """Write this instance's file-SD list (``prometheus_sd_file``): one target, the metrics
    exporter at ``host:metrics_port`` (``start`` passes the Gateway's node's). ``stop()``
    removes it. Returns the path."""
    path = prometheus_sd_file(metrics_port)
    path.parent.mkdir(parents=True, exist_ok=True)
    target = f"[{host}]:{metrics_port}" if ":" in host else f"{host}:{metrics_port}"
    path.write_text(json.dumps([{"labels": {"job": "ray"}, "targets": [target]}]) + "\n")
    _written_sd_files.append(path)
    return path


def deploy(config: ServeDeploySchema, timeout_s: float = 300.0,
           names: list[str] | None = None) -> None:
    """(Re)deploy ``config`` on the running Serve instance — a changed ``user_config`` is
    applied through ``reconfigure`` without restarting replicas — and wait until its
    applications (or those in ``names``) are RUNNING. Raises RuntimeError when one fails to
    deploy or ``timeout_s`` passes."""
    # The client start() made: serve_start() again logs "Connecting to existing Serve app …
    # New http_options/controller_options will not be applied", which reads like an error.
    (_client or serve_api.serve_start()).deploy_apps(config, _blocking=False)
    deadline = time.monotonic() + timeout_s
    names = names or [a.name for a in config.applications]
    while True:
        status = serve.status().applications
        states = {n: status[n].status if n in status else "NOT_STARTED" for n in names}
        if all(s == "RUNNING" for s in states.values()):
            return
        failed = {n: status[n].message for n, s in states.items() if s == "DEPLOY_FAILED"}
        if failed:
            raise RuntimeError(f"deployment failed: {failed}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"not running after {timeout_s:.0f} s: {states}")
        time.sleep(0.5)


def ray_processes() -> list[psutil.Process]:
    """The processes this one started that are Ray's (GCS, raylet, agents, workers: ``ray::``
    titles and programs in Ray's package), at any depth; the ones that ended are left out."""
    package = str(Path(ray.__file__).parent)
    found = []
    for proc in psutil.Process().children(recursive=True):
        try:
            line = proc.cmdline()
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
        if line and (line[0].startswith("ray::") or any(package in part for part in line)):
            found.append(proc)
    return found


def stop(at_once: bool = False) -> None:
    """Shut Serve and Ray down and remove this instance's Prometheus file-SD list. On a
    cluster joined with ``start(address=...)``: delete this config's applications only and
    disconnect, leaving the cluster and its Serve instance running. ``at_once``: skip Serve's
    graceful shutdown (and, joined, the deletion); Ray's processes on this machine still
    stop."""
    global _joined, _client
    _client = None
    if at_once:
        _joined_apps.clear()
        _joined = False
    elif _joined:
        try:
            for name in _joined_apps:
                serve.delete(name)
        except Exception as e:  # e.g. the cluster went away: still disconnect
            print(f"mita-serve: could not delete {', '.join(_joined_apps)} on the cluster: "
                  f"{type(e).__name__}: {e}", file=sys.stderr, flush=True)
        _joined_apps.clear()
        _joined = False
    else:
        serve.shutdown()
    ray.shutdown()
    ours = _own_ray[:]
    _own_ray.clear()
    for proc in psutil.wait_procs(ours, timeout=5)[1]:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    while _written_sd_files:
        _written_sd_files.pop().unlink(missing_ok=True)
