"""Start Ray and deploy the service from a Serve config file, in this process.

The config file is the standard Serve schema (``ServeDeploySchema``), deployed the way
``serve run CONFIG`` deploys it, so the same file works with ``serve deploy`` on a cluster and
in a KubeRay ``RayService``. This module adds what ``serve run`` cannot set: Ray's metrics
export port and interval, and binding Ray to loopback.
"""

from __future__ import annotations

import copy
import errno
import ipaddress
import json
import math
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import ray
import torch
from ray import serve
from ray._private import ray_constants
from ray.serve._private import api as serve_api
from ray.serve.schema import ServeDeploySchema

from . import PROJECT_ROOT
from .config_file import check_serve_file, read_yaml
from .schemas import AppArgs, ClassifierConfig, GatewayConfig, validated

CPU_CONFIG = PROJECT_ROOT / "deploy" / "serve_config.yaml"
# Prometheus file-SD lists, one per instance (named by its metrics port): a second instance on
# the host (another checkout, the test suite while `make serve` runs) writes its own file
# instead of overwriting the one deploy/prometheus/prometheus.yml reads (the default port's).
PROMETHEUS_SD_DIR = Path("/tmp/mita-serve/prometheus")
DEFAULT_METRICS_PORT = 9100
DEFAULT_DASHBOARD_PORT = 8265  # Ray's; the `serve` CLI's default address
_written_sd_files: list[Path] = []
# On a cluster this process joined (start(address=...)), stop() deletes the applications
# this process deployed and leaves the cluster's Serve running.
_joined = False
_joined_apps: list[str] = []
# (port, ip) of the metrics exporter of the Gateway's node, once start() has deployed.
metrics_exporter: tuple[int, str] | None = None


def prometheus_sd_file(metrics_port: int) -> Path:
    """The file-SD list of the instance whose Ray metrics exporter listens on
    ``metrics_port``."""
    return PROMETHEUS_SD_DIR / f"metrics-{metrics_port}.json"
GPU_CONFIG = PROJECT_ROOT / "deploy" / "serve_config.gpu.yaml"


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


# The project's own schema for each deployment's user_config (service.app builds these names).
USER_CONFIGS = {"Gateway": GatewayConfig, "MiTAClassifier": ClassifierConfig,
                "DenseClassifier": ClassifierConfig}


def check_service_config(config: ServeDeploySchema) -> None:
    """Parse this service's application args and every deployment's ``user_config`` with the
    strict schemas (``schemas.AppArgs``, ``ClassifierConfig``, ``GatewayConfig``) before
    anything starts; Serve would otherwise refuse them only inside a replica. Raises
    ValueError naming the application, the deployment and each refused field. Applications
    of other import paths are left to Serve."""
    http_timeout = config.http_options.request_timeout_s
    for app in config.applications:
        if app.import_path.replace(":", ".") != "service.app.build_app":  # Ray takes both
            continue
        if config.proxy_location == "Disabled" or app.route_prefix is None:
            raise ValueError(f"application {app.name!r}: HTTP is off (proxy_location Disabled "
                             "or route_prefix null); the service answers only over HTTP")
        validated(AppArgs, app.args, f"application {app.name!r} args")
        for dep in app.deployments:
            schema = USER_CONFIGS.get(dep.name)
            if schema is None:
                raise ValueError(f"application {app.name!r}: no deployment named {dep.name!r} "
                                 f"(the service has {', '.join(USER_CONFIGS)})")
            if isinstance(dep.user_config, dict):
                validated(schema, dep.user_config,
                          f"application {app.name!r} deployment {dep.name!r} user_config")
        gateway = gateway_config(app)  # its defaults count too
        if http_timeout is not None and gateway.request_timeout_s > http_timeout:
            raise ValueError(
                f"application {app.name!r} deployment 'Gateway' user_config: "
                f"request_timeout_s ({gateway.request_timeout_s:g} s) exceeds "
                f"http_options.request_timeout_s ({http_timeout:g} s): the proxy would time "
                "requests out first, without the gateway's JSON 504")


def gateway_config(app) -> GatewayConfig:
    """The Gateway's ``user_config`` of application ``app`` (a ``ServeApplicationSchema``),
    with the schema's defaults where it sets nothing. Raises ValueError as ``validated``."""
    gateway = next((d for d in app.deployments if d.name == "Gateway"), None)
    values = gateway.user_config if gateway and isinstance(gateway.user_config, dict) else None
    return validated(GatewayConfig, values,
                     f"application {app.name!r} deployment 'Gateway' user_config")


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

    ``address`` (a running cluster's GCS address, ``ip:port``, or ``auto``): join that cluster
    as a driver instead of starting Ray; the node settings above are the cluster's own and are
    ignored, and ``stop()`` then deletes only this config's applications. Either way the
    Prometheus file-SD list (``prometheus_sd_file``) names the metrics exporter of the node the
    Gateway runs on, where every ``mita_serve`` metric is recorded (``gateway_exporter``).
    Proxy variables never reach traffic to this machine: loopback (and a non-loopback
    ``node_ip``) is added to ``NO_PROXY`` first (``no_proxy_for_this_machine``), with a
    warning when a proxy variable is set.

    Raises: RuntimeError if an application fails to deploy or ``timeout_s`` passes;
    ConnectionError if no cluster answers at ``address``.
    """
    # Serve waits 5 s for a new HTTP proxy by default; a loaded 2-core machine needs longer,
    # and the config file has no field for it.
    os.environ.setdefault("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", "60")
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
        use_token_auth()
        if ipaddress.ip_address(node_ip).is_loopback:
            loopback_only()
        ray.init(namespace="serve", include_dashboard=dashboard_host is not None,
                 dashboard_host=dashboard_host or "127.0.0.1", dashboard_port=dashboard_port,
                 _node_ip_address=node_ip,
                 _metrics_export_port=metrics_port,
                 _system_config={"metrics_report_interval_ms": metrics_interval_ms})
    client = serve_api.serve_start(http_options=config.http_options.model_dump(),
                                   proxy_location=config.proxy_location)
    names = [a.name for a in config.applications]
    if _joined:
        _joined_apps.extend(names)  # from here on, stop() deletes them
        deploy(with_cluster_apps(config, client.get_serve_details()), timeout_s, names)
    else:
        deploy(config, timeout_s)
    for app in config.applications:
        if app.import_path.replace(":", ".") == "service.app.build_app":
            metrics_exporter = gateway_exporter(app.name)
            write_prometheus_sd(*metrics_exporter)
    http = config.http_options
    return f"http://{http.host}:{http.port}"


def check_cluster_reachable(address: str, timeout_s: float = 5.0) -> None:
    """Refuse (OSError) a cluster address nothing listens on: ``ray.init`` would retry it for
    minutes. ``address`` is ``HOST:PORT``, the head node's GCS address; ``auto`` is left to
    Ray, which fails at once when it finds no cluster. Without TLS (``RAY_USE_TLS``) the
    server must answer as a gRPC server does, which refuses e.g. the metrics port."""
    if address == "auto":
        return
    if "://" in address:  # e.g. the dashboard's http://HEAD:8265, which Ray's job CLI takes
        raise OSError(f"--address {address!r}: expected the head node's GCS address HOST:PORT "
                      "(e.g. 10.0.0.5:6379), not a URL")
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise OSError(f"--address {address!r}: expected HOST:PORT (the head node's GCS "
                      "address, e.g. 10.0.0.5:6379) or auto")
    hint = ("is it the head node's address and GCS port (`ray start --head --port`, "
            "default 6379)?")
    tls = os.environ.get("RAY_USE_TLS", "0").lower() in ("1", "true")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s) as c:
            if tls:  # a TLS GCS answers only after a handshake; the connect is all we check
                return
            # Ray's GCS is a gRPC server: it answers the HTTP/2 client preface with a SETTINGS
            # frame (type 4 in the 9-byte frame header). Another server (the metrics port, the
            # dashboard) would leave ray.init retrying for minutes; another gRPC port of Ray
            # (Ray Client's 10001) still passes.
            c.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0]))
            header = b""
            while len(header) < 9:
                chunk = c.recv(9 - len(header))
                if not chunk:
                    break
                header += chunk
    except OSError as e:
        raise OSError(f"no Ray cluster answers at {address} ({e.strerror or e}); {hint}"
                      ) from None
    if len(header) < 9 or header[3] != 4:
        raise OSError(f"the server at {address} is not a Ray cluster's GCS (it does not speak "
                      f"gRPC); {hint}")


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


def check_not_running(config: ServeDeploySchema) -> None:
    """Refuse (ValueError) to deploy over an application of the same name already on the
    joined cluster: two ``python -m service`` would share one application, and the first to
    stop would delete it under the other."""
    running = serve.status().applications
    taken = [a.name for a in config.applications if a.name in running]
    if taken:
        raise ValueError(f"application(s) {', '.join(map(repr, taken))} already run on this "
                         "cluster (another python -m service, or serve deploy): stop that one "
                         "(`serve delete NAME`) or give the application another name and "
                         "route_prefix in the config")


def missing_resources(config: ServeDeploySchema) -> list[str]:
    """One line per custom resource a deployment asks for (``ray_actor_options.resources``)
    that no node of the joined cluster offers now: its replicas stay pending until a node
    with it joins (an autoscaling cluster may add one)."""
    have = ray.cluster_resources()
    lines = []
    for app in config.applications:
        for dep in app.deployments:
            options = dep.model_dump(exclude_unset=True).get("ray_actor_options") or {}
            for name, amount in (options.get("resources") or {}).items():
                if have.get(name, 0) < amount:
                    lines.append(f"no node of the cluster offers resource {name!r} "
                                 f"({dep.name} asks {amount:g} per replica): its replicas "
                                 f"stay pending until a node started with `ray start "
                                 f"--resources '{{\"{name}\": N}}'` joins")
    return lines


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


def gateway_exporter(app_name: str) -> tuple[int, str]:
    """``(port, ip)`` of Ray's metrics exporter on the node that runs application
    ``app_name``'s Gateway replica (asked of the replica, then looked up in ``ray.nodes()``).
    The gateway records all of the service's metrics, from the profiles the classifiers send
    back, so on a cluster this one exporter has them whichever node ran the forwards.
    Raises RuntimeError when Ray lists no such node."""
    gateway = serve.get_deployment_handle("Gateway", app_name=app_name)
    node_id = gateway.node_id.remote().result(timeout_s=30)
    node = next((n for n in ray.nodes() if n["NodeID"] == node_id and n["Alive"]), None)
    if node is None:
        raise RuntimeError(f"the Gateway's node {node_id} is not among Ray's live nodes")
    return int(node["MetricsExportPort"]), node["NodeManagerAddress"]


def use_token_auth() -> None:
    """Make sure the Ray this process starts uses Ray's token authentication: with
    ``RAY_AUTH_MODE`` unset, ``ray.init`` turns it on exactly when a token exists, so one is
    made (``ray get-auth-token --generate``, into ``~/.ray/auth_token``) when there is none.
    Without this, whether Ray's ``serve`` CLI needed ``RAY_AUTH_MODE=token`` depended on the
    machine. An explicit ``RAY_AUTH_MODE`` is left to the user. Raises CalledProcessError
    when the token cannot be made."""
    if "RAY_AUTH_MODE" in os.environ:
        return
    have = (os.environ.get("RAY_AUTH_TOKEN") or os.environ.get("RAY_AUTH_TOKEN_PATH")
            or (Path.home() / ".ray" / "auth_token").is_file())
    if not have:  # the command prints the token: kept out of the output
        subprocess.run([sys.executable, "-m", "ray.scripts.scripts", "get-auth-token",
                        "--generate"], check=True, capture_output=True, timeout=120)


def _listeners(config: ServeDeploySchema, metrics_port: int, node_ip: str,
               dashboard: tuple[str, int] | None) -> list[tuple[str, int, str, str]]:
    """(host, port, the flag or field that sets the host, the one that sets the port) of
    every socket a start listens on: HTTP, Ray's metrics exporter, the Ray dashboard."""
    http = config.http_options
    out = [(http.host, http.port, "http_options.host", "http_options.port in the config"),
           (node_ip, metrics_port, "--node-ip", "--metrics-port")]
    if dashboard is not None:
        out.append((*dashboard, "--dashboard-host", "--dashboard-port"))
    return out


def _bind(host: str, port: int, host_from: str, shown_port: int | None = None) -> None:
    """Bind a socket to ``(host, port)`` and close it. Raises OSError: errno EADDRINUSE when
    the port is taken, or naming ``host_from`` (and ``shown_port``, default ``port``) when
    ``host`` is not this machine's."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    except socket.gaierror as e:
        raise OSError(f"{host_from} {host!r} is not an address of this machine "
                      f"({e.strerror})") from None
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise
            raise OSError(f"cannot listen on {host}:{shown_port or port} ({e.strerror}); "
                          f"is {host_from} an address of this machine?") from None


def check_addresses(config: ServeDeploySchema, metrics_port: int,
                    node_ip: str = "127.0.0.1",
                    dashboard: tuple[str, int] | None = None) -> None:
    """Refuse (OSError) listening addresses a start could not use, whatever runs now: two of
    the ports equal, or a host that is not this machine's (each host is bound on a free
    port, so a port in use does not count here: ``busy_ports``)."""
    listeners = _listeners(config, metrics_port, node_ip, dashboard)
    numbers = [port for _, port, _, _ in listeners]
    if len(set(numbers)) < len(numbers):
        raise OSError(f"{', '.join(p for _, _, _, p in listeners)} must differ, got {numbers}")
    for host, port, host_from, _ in listeners:
        try:
            _bind(host, 0, host_from, port)
        except OSError as e:
            if e.errno != errno.EADDRINUSE:  # EADDRINUSE: no free port at all; the start says
                raise


def busy_ports(config: ServeDeploySchema, metrics_port: int, node_ip: str = "127.0.0.1",
               dashboard: tuple[str, int] | None = None) -> list[str]:
    """One line per port of a start that another process listens on now, naming the port and
    the flag or config field that sets it. Raises OSError as ``check_addresses``."""
    lines = []
    for host, port, host_from, port_from in _listeners(config, metrics_port, node_ip,
                                                       dashboard):
        try:
            _bind(host, port, host_from)
        except OSError as e:
            if e.errno != errno.EADDRINUSE:
                raise
            lines.append(f"port {port} on {host} is in use ({e.strerror}): another "
                         f"instance, or another program; choose a free one with {port_from}")
    return lines


def check_ports_free(config: ServeDeploySchema, metrics_port: int,
                     node_ip: str = "127.0.0.1",
                     dashboard: tuple[str, int] | None = None) -> None:
    """Refuse to start on ports another process listens on (a second ``make serve`` would
    otherwise wait ~40 s and fail with "The current node timed out during startup"): the
    HTTP port of ``config.http_options``, Ray's metrics export port on ``node_ip`` and the
    Ray dashboard's ``(host, port)`` when it runs.
    Raises OSError naming the port and the flag or config field that sets it, or the address
    when it is not this machine's (``check_addresses``)."""
    check_addresses(config, metrics_port, node_ip, dashboard)
    busy = busy_ports(config, metrics_port, node_ip, dashboard)
    if busy:
        raise OSError(busy[0])


def preflight(config: ServeDeploySchema, *, address: str | None = None,
              metrics_port: int = DEFAULT_METRICS_PORT, node_ip: str = "127.0.0.1",
              dashboard: tuple[str, int] | None = None, check_only: bool = False) -> list[str]:
    """Every check ``python -m service`` makes before it starts anything, for a start and for
    ``--check`` alike (one path, so ``--check`` cannot pass what the start refuses): the
    devices (``check_devices``), or with ``address`` the cluster (``check_cluster_reachable``);
    the checkpoints (``verify_checkpoints``); the listening addresses and ports. Returns
    warnings, one line each. With ``check_only`` a port in use is a warning, not a refusal:
    the file checked may be the running instance's next config (``serve deploy``).
    Raises OSError or ValueError naming what is wrong."""
    warnings = []
    if address is None:  # on a cluster the nodes' devices count, not this machine's
        check_devices(config)
    else:
        check_cluster_reachable(address)
    verify_checkpoints(config)
    if address is not None:  # the cluster's ports and GPUs, not this machine's
        return warnings
    if check_only:
        check_addresses(config, metrics_port, node_ip, dashboard)
        warnings += [f"{line} (fine if it is the running instance's)"
                     for line in busy_ports(config, metrics_port, node_ip, dashboard)]
    else:
        check_ports_free(config, metrics_port, node_ip, dashboard)
    needed = gpus_needed(replica_gpus(config))
    if needed > local_gpu_count():
        warnings.append(f"the config's minimum replicas need {needed} GPU(s), this machine "
                        f"has {local_gpu_count()}; replicas that do not fit stay pending (see "
                        "the num_gpus note in deploy/serve_config.gpu.yaml)")
    return warnings


def replica_gpus(config: ServeDeploySchema, which: str = "min") -> list[float]:
    """The ``num_gpus`` of every replica the config asks for: ``which="min"`` counts
    ``num_replicas`` or ``autoscaling_config.min_replicas`` per deployment, ``"max"`` counts
    ``num_replicas`` or ``max_replicas``. Replicas that ask for no GPU are left out."""
    out = []
    for app in config.applications:
        for dep in app.deployments:
            d = dep.model_dump(exclude_unset=True)  # unset fields are Serve's sentinels
            gpus = float((d.get("ray_actor_options") or {}).get("num_gpus") or 0)
            auto = d.get("autoscaling_config")
            if auto:
                count = auto.get("min_replicas" if which == "min" else "max_replicas", 1)
            else:
                count = d.get("num_replicas") if isinstance(d.get("num_replicas"), int) else 1
            out += [gpus] * (count if gpus else 0)
    return out


def gpus_needed(replicas: list[float]) -> int:
    """How many GPUs Ray needs to place replicas asking for these GPU amounts: a fraction
    must fit inside one GPU's remainder, a whole number takes whole GPUs (first-fit
    decreasing, which is optimal for the few fractions a config holds)."""
    free: list[float] = []
    whole = 0
    for g in sorted(replicas, reverse=True):
        if g >= 1:
            whole += math.ceil(g)
            continue
        slot = next((i for i, f in enumerate(free) if f >= g - 1e-9), None)
        if slot is None:
            free.append(1.0 - g)
        else:
            free[slot] -= g
    return whole + len(free)


def local_gpu_count() -> int:
    """CUDA devices torch sees on this machine (0 without CUDA)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def verify_checkpoints(config: ServeDeploySchema) -> None:
    """Load every application's ``checkpoint`` argument on the CPU, as the replicas will:
    safetensors only, ``config.json``'s weights SHA-256 checked. Raises ValueError/OSError
    naming the problem (e.g. a hash mismatch, a ``mita_setting`` the model refuses:
    ``app.served_config``) so the service refuses to start."""
    from mita.model import load_checkpoint

    from .app import served_config
    from .engine import resolve_checkpoint

    for app in config.applications:
        a, _ = served_config(app.args or {})
        checkpoint = a.checkpoint
        model = load_checkpoint(resolve_checkpoint(str(checkpoint)), device="cpu")
        max_n = gateway_config(app).max_n
        if model.config.max_len < max_n:
            raise ValueError(f"checkpoint {checkpoint}: its max_len ({model.config.max_len}) "
                             f"is below the Gateway's max_n ({max_n}): requests between "
                             f"them would be accepted and then fail; lower max_n")


def check_devices(config: ServeDeploySchema) -> None:
    """Refuse (ValueError) an application ``device`` this machine's torch cannot use
    (``cuda`` without CUDA, ``cuda:N`` past the last GPU); replicas would otherwise fail one
    after another once Ray has started."""
    from .engine import pick_device

    count = local_gpu_count()
    for app in config.applications:
        args = app.args or {}
        device = str(args.get("device", "auto"))
        try:
            chosen = pick_device(device)
        except RuntimeError:
            raise ValueError(f"application {app.name!r} args: device {device!r} is not a "
                             "torch device (auto, cpu, cuda, cuda:N)") from None
        if chosen.type == "cuda" and (chosen.index or 0) >= count:
            raise ValueError(f"application {app.name!r} args: device {device!r}, but this "
                             f"machine's torch ({torch.__version__}) sees {count} CUDA "
                             f"device(s); use device: auto or cpu")
        if args.get("mita_backend") == "triton" and chosen.type != "cuda":
            raise ValueError(f"application {app.name!r} args: mita_backend 'triton' needs a "
                             "CUDA device; use auto (compiled CPU kernels here)")


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
    serve_api.serve_start().deploy_apps(config, _blocking=False)
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


def drain_time_s(config: ServeDeploySchema) -> float:
    """How long a shutdown lets in-flight requests finish: the Gateway deployment's
    ``graceful_shutdown_timeout_s`` (Serve's own graceful-shutdown setting; 20 s when unset)."""
    for app in config.applications:
        for dep in app.deployments:
            if dep.name == "Gateway":
                value = dep.model_dump(exclude_unset=True).get("graceful_shutdown_timeout_s")
                if isinstance(value, int | float):
                    return float(value)
    return 20.0


def drain(config: ServeDeploySchema, timeout_s: float | None = None) -> int:
    """Stop accepting (the gateway answers new requests 503 + Retry-After) and wait until the
    classify requests inside have finished, at most ``timeout_s`` (default
    ``drain_time_s(config)``). Returns how many were still in flight (0: none lost).
    The drain state lives in each gateway replica and a handle call reaches one of them: with
    several Gateway replicas only one would drain (the shipped configs run one)."""
    timeout_s = drain_time_s(config) if timeout_s is None else timeout_s
    deadline = time.monotonic() + timeout_s
    left = 0
    for app in config.applications:
        gateway = serve.get_deployment_handle("Gateway", app_name=app.name)
        left = gateway.drain.remote().result(timeout_s=10)
        while left > 0 and time.monotonic() < deadline:
            time.sleep(0.2)
            left = gateway.inflight.remote().result(timeout_s=10)
    return left


def stop() -> None:
    """Shut Serve and Ray down and remove this instance's Prometheus file-SD list. On a
    cluster joined with ``start(address=...)``: delete this config's applications only and
    disconnect, leaving the cluster and its Serve instance running."""
    global _joined
    if _joined:
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
    while _written_sd_files:
        _written_sd_files.pop().unlink(missing_ok=True)
