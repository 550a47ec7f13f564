"""The checks ``python -m service`` makes before Ray starts (``preflight`` makes them all, for
a start and for ``--check``): the config's own schemas (``check_service_config``), the devices,
the checkpoints, the listening addresses and ports, the GPUs the replicas ask for and a
cluster's address; the checks a start makes once it has joined a cluster
(``check_not_running``, ``missing_resources``); and Ray's token authentication
(``use_token_auth``). Each refuses at once, naming what is wrong, what would otherwise fail
inside a replica or after Ray's start-up timeout. Starting and stopping: ``service.launch``.
"""

from __future__ import annotations

import errno
import math
import os
import socket
import subprocess
import sys
from pathlib import Path

import ray
import torch
from ray import serve
from ray.serve.schema import ServeDeploySchema

from .engine import HEAP_TRIM_ENV, heap_trim_mib
from .settings import DEPLOYMENTS, VARIANTS, AppArgs, ClassifierConfig, GatewayConfig, validated

# The ports a start listens on unless told otherwise (``launch.start``, ``python -m service``).
DEFAULT_METRICS_PORT = 9100
DEFAULT_DASHBOARD_PORT = 8265  # Ray's; the `serve` CLI's default address
# The project's own schema for each deployment's user_config.
USER_CONFIGS = {DEPLOYMENTS["gateway"]: GatewayConfig,
                **{DEPLOYMENTS[v]: ClassifierConfig for v in VARIANTS}}


def check_service_config(config: ServeDeploySchema) -> None:
    """Parse this service's application args and every deployment's ``user_config`` with the
    strict schemas (``settings.AppArgs``, ``ClassifierConfig``, ``GatewayConfig``) before
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
                f"application {app.name!r} deployment {DEPLOYMENTS['gateway']!r} user_config: "
                f"request_timeout_s ({gateway.request_timeout_s:g} s) exceeds "
                f"http_options.request_timeout_s ({http_timeout:g} s): the proxy would time "
                "requests out first, without the gateway's JSON 504")


def gateway_config(app) -> GatewayConfig:
    """The Gateway's ``user_config`` of application ``app`` (a ``ServeApplicationSchema``),
    with the schema's defaults where it sets nothing. Raises ValueError as ``validated``."""
    gateway = next((d for d in app.deployments if d.name == DEPLOYMENTS["gateway"]), None)
    values = gateway.user_config if gateway and isinstance(gateway.user_config, dict) else None
    return validated(GatewayConfig, values,
                     f"application {app.name!r} deployment {DEPLOYMENTS['gateway']!r} "
                     "user_config")


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
        # the replicas of the Ray started here inherit this environment
        heap_trim_mib(os.environ.get(HEAP_TRIM_ENV))
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
    from mita.config import setting_name

    from . import resolve_checkpoint
    from .app import served_config
    from .engine import load_served
    from .routing import check_warm_start

    for app in config.applications:
        a, cfg, task = served_config(app.args or {})
        try:
            check_warm_start(gateway_config(app), setting_name(
                cfg.num_landmarks, cfg.topk, cfg.route_topk, cfg.shared_scale))
        except ValueError as e:
            raise ValueError(f"application {app.name!r} deployment {DEPLOYMENTS['gateway']!r} "
                             f"user_config: {e}") from None
        checkpoint = a.checkpoint
        model = load_served(resolve_checkpoint(str(checkpoint)), "cpu", "mita",
                            a.mita_setting.overrides())
        max_n = gateway_config(app).max_n
        # a pretrained model's positions refuse longer requests with a 422 of their own
        if task.positions is None and model.config.max_len < max_n:
            raise ValueError(f"checkpoint {checkpoint}: its max_len ({model.config.max_len}) "
                             f"is below the Gateway's max_n ({max_n}): requests between "
                             f"them would be accepted and then fail; lower max_n")


def check_devices(config: ServeDeploySchema) -> None:
    """Refuse (ValueError) an application ``device`` this machine's torch cannot use
    (``cuda`` without CUDA, ``cuda:N`` past the last GPU); replicas would otherwise fail one
    after another once Ray has started."""
    from .engine import pick_device

    for app in config.applications:
        args = app.args or {}
        device = str(args.get("device", "auto"))
        try:
            chosen = pick_device(device)
        except ValueError as e:
            raise ValueError(f"application {app.name!r} args: {e}; use device: auto or cpu"
                             ) from None
        if args.get("mita_backend") == "triton" and chosen.type != "cuda":
            raise ValueError(f"application {app.name!r} args: mita_backend 'triton' needs a "
                             "CUDA device; use auto (compiled CPU kernels here)")
