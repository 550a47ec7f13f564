"""Safe starts and stops of the service: loopback-only ports and no Ray dashboard, a tampered
checkpoint refused before Ray starts, a signal during start-up, Ctrl-C's drain and a second
signal (``python -m service`` in a subprocess, with its own Ray). SIGTERM's drain in Ray Serve's
throughput mode, with a replica killed under load first, is the README walkthrough's
(``tests/no_ray/test_readme.py``: ``make serve`` runs that mode)."""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from functools import partial
from pathlib import Path

import httpx
import psutil
import pytest
import yaml

from ..helpers import inherit_priority, wait_for
from ..processes import at_once, is_ready, listening, send_long_dense, stop_under_load

ROOT = Path(__file__).resolve().parents[2]


# ---------------------------------------------------------------------------------------------
# Safe defaults.





# ---------------------------------------------------------------------------------------------
# Stopping: Ctrl-C during start-up and SIGTERM, each to its own python -m service.

def own_instance(tmp_path, *args: str, route_prefix: str = "/", env: dict | None = None,
                 terminal: bool = False, gateway: dict | None = None
                 ) -> tuple[subprocess.Popen, int, int]:
    """``python -m service`` on the shipped CPU config with the tests' fixed replicas, on free
    loopback ports, as a subprocess with its own Ray; ``args``: more flags (default: no Ray
    dashboard); ``route_prefix``: the application's; ``env``: added to this process's
    environment; ``terminal``: in a process group of its own, as a terminal's foreground job
    (Ctrl-C there signals every process of the group, Ray's included); ``gateway``: fields of
    the Gateway deployment set in the config. Returns (process, HTTP port, metrics port); the
    config is ``tmp_path / "serve.yaml"``."""
    from ..helpers import TEST_OVERRIDES, free_port

    http_port, metrics_port = free_port(), free_port()
    config = yaml.safe_load((ROOT / "deploy" / "serve_config.yaml").read_text())
    config["http_options"]["port"] = http_port
    config["applications"][0]["route_prefix"] = route_prefix
    for dep in config["applications"][0]["deployments"]:
        for key, value in TEST_OVERRIDES["deployments"][dep["name"]].items():
            if key != "user_config":
                dep[key] = value
        if dep["name"] == "Gateway":
            dep.update(gateway or {})
    (tmp_path / "serve.yaml").write_text(yaml.safe_dump(config))
    proc = subprocess.Popen([sys.executable, "-m", "service", "--config",
                             str(tmp_path / "serve.yaml"), "--metrics-port", str(metrics_port),
                             *(args or ("--dashboard-host", "off"))],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=os.environ | (env or {}), start_new_session=terminal,
                            preexec_fn=inherit_priority() if terminal else None)
    proc.args_env = env or {}
    # Read all along: a pipe nobody reads blocks the service's next print once it is full.
    proc.lines = []
    proc.reader = threading.Thread(target=lambda: proc.lines.extend(proc.stdout), daemon=True)
    proc.reader.start()
    return proc, http_port, metrics_port


def output(proc: subprocess.Popen, timeout_s: float) -> str:
    """Everything ``proc`` (from ``own_instance``) printed, once it has exited (waits up to
    ``timeout_s``; subprocess.TimeoutExpired if it has not)."""
    proc.wait(timeout=timeout_s)
    proc.reader.join(timeout=10)
    return "".join(proc.lines)


def reap(proc: subprocess.Popen) -> None:
    """Kill ``proc`` if a test left it running, and collect it."""
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def alive(p: psutil.Process) -> bool:
    """``p`` runs (not ended, not a zombie)."""
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def sigterm_under_load(proc: subprocess.Popen, url: str, inflight: int,
                       signals: int) -> tuple[float, list]:
    """``inflight`` long dense requests to ``url`` (``send_long_dense``), and 1 s later
    SIGTERM to ``proc``, ``signals`` times 0.5 s apart. Returns (monotonic time of the last
    signal, each request's response or the exception it raised)."""
    import signal

    async def scenario():
        async with httpx.AsyncClient(base_url=url, timeout=120) as c:
            sent, _ = await send_long_dense(c, inflight)
            for n in range(signals):
                if n:
                    await asyncio.sleep(0.5)
                proc.send_signal(signal.SIGTERM)
            last = time.monotonic()
            return last, await asyncio.gather(*sent, return_exceptions=True)
    return asyncio.run(scenario())


def wait_started(proc: subprocess.Popen, url: str, timeout_s: float = 180) -> None:
    """Return once ``url``'s /readyz answers 200; else fail at once if ``proc`` exited, or
    after ``timeout_s``, with the end of its output and of its Ray session's Serve logs."""
    wait_for(lambda: proc.poll() is not None or is_ready(url), timeout_s=timeout_s)
    if proc.poll() is None and is_ready(url):
        return
    state = (f"exited with {proc.returncode}" if proc.poll() is not None
             else f"not ready after {timeout_s:g} s")
    reap(proc)
    logs = []
    ray_tmp = Path(proc.args_env.get("RAY_TMPDIR", "/tmp")) / "ray"
    for session in ray_tmp.glob(f"session_*_{proc.pid}"):
        for log in sorted((session / "logs" / "serve").glob("*.log")):
            logs.append(f"--- {log.name}:\n" + log.read_text(errors="replace")[-1500:])
    pytest.fail(f"service did not start ({state}); its output ends:\n"
                f"{output(proc, 10)[-4000:]}\n" + "\n".join(logs)[-8000:])






@pytest.mark.service  # its own Ray, in a subprocess
def test_signal_during_start_up_stops_ray_cleanly(tmp_path):
    """SIGINT (Ctrl-C) while Ray starts (its metrics exporter is up, the deployments are not),
    or SIGTERM once Ray is up and the applications deploy (a pod stopped while it starts),
    each to a python -m service of its own, both at once: one line, exit status 1, and no Ray
    process left holding the metrics port. On main, a KeyboardInterrupt inside ray.init left
    Ray's agents running (the next start was refused: "port ... is in use"), and SIGTERM met
    the handler ray.init installs: the process died by SIGABRT (-6) with Ray's stack dump and
    nothing of ours."""
    at_once(tmp_path, {name: partial(signal_during_start_up, signame=name)
                       for name in ("SIGINT", "SIGTERM")})


def signal_during_start_up(tmp_path: Path, env: dict, signame: str) -> None:
    """``test_signal_during_start_up_stops_ray_cleanly``'s scenario for ``signame``."""
    import signal

    proc, http_port, metrics_port = own_instance(tmp_path, env=env)
    try:
        if signame == "SIGINT":
            assert wait_for(lambda: listening(metrics_port), timeout_s=120, interval_s=0.1)
        else:
            assert wait_for(lambda: any("Started Serve in namespace" in line
                                        for line in proc.lines), timeout_s=120, interval_s=0.1)
        assert not is_ready(f"http://127.0.0.1:{http_port}")  # still starting
        proc.send_signal(getattr(signal, signame))
        out = output(proc, 120)
    finally:
        reap(proc)
    assert proc.returncode == 1, out[-2000:]
    assert "mita-serve: stopping once start-up is done" in out, out[-2000:]
    assert out.rstrip().endswith("mita-serve: interrupted during start-up; stopped"), out[-2000:]
    assert "Traceback" not in out, out[-2000:]
    assert wait_for(lambda: not listening(metrics_port), timeout_s=20), "Ray left running"


@pytest.mark.service  # its own Ray, in a subprocess
def test_ctrl_c_drains_in_flight_requests(tmp_path):
    """Ctrl-C in the terminal running ``python -m service`` (SIGINT to its whole process
    group, Ray's processes included) while 6 dense requests are in flight: every one is
    answered 200 (on main all failed after 0.2 s with "Server disconnected"), a request sent
    during the drain gets 503 with Retry-After, /healthz stays 200 and /readyz says not ready,
    and the process exits 0 once they are done — well before the 30 s drain time. Its own Ray
    instance, loopback ports, Ray Serve's default mode and the application under a route
    prefix (the drain counted 0 requests in flight there and cut them). A cluster address that
    ``ray start`` left on the machine is not joined: it starts its own Ray. (SIGTERM's drain, in
    throughput mode: the README walkthrough's.)"""
    import signal

    # A cluster address left by `ray start` (here a dead one) in its Ray temp dir: ray.init()
    # joined that cluster and refused the service's _system_config there (ValueError, exit 1).
    ray_tmp = Path(tempfile.mkdtemp(prefix="mita-ray-", dir="/tmp"))  # short: Ray's sockets
    (ray_tmp / "ray").mkdir()
    (ray_tmp / "ray" / "ray_current_cluster").write_text("127.0.0.1:1")
    proc, http_port, _ = own_instance(tmp_path, "--dashboard-host", "off",
                                      "--ray-serve-default-mode", route_prefix="/m2",
                                      env={"RAY_TMPDIR": str(ray_tmp)}, terminal=True)
    url = f"http://127.0.0.1:{http_port}/m2"
    try:
        wait_started(proc, url)
        try:
            answers, late, health, ready = stop_under_load(
                url, 6, lambda: os.killpg(proc.pid, signal.SIGINT))
        except httpx.HTTPError as e:  # a cut connection: say what the service did meanwhile
            raise AssertionError(f"{type(e).__name__}: {e}; the service's output:\n"
                                 f"{output(proc, 60)[-6000:]}") from e
        out = output(proc, 60)
    finally:
        reap(proc)
    assert [r.status_code for r in answers] == [200] * 6
    assert late.status_code == 503 and late.headers["retry-after"] == "1", late.text
    assert late.json()["error"] == "the service is shutting down; retry on another instance"
    assert health.status_code == 200 and ready.status_code == 503
    assert proc.returncode == 0, out[-2000:]
    assert "drained (0 request(s) still in flight)" in out, out[-2000:]
    assert "stopping once start-up is done" not in out  # said on every stop, once
    assert "Ray Serve mode: default" in out, out[-2000:]
    # one line of what the start did; not Ray's "Connecting to existing Serve app … New
    # http_options/controller_options will not be applied", which a second serve_start() in
    # deploy() logged at every fresh start
    assert re.search(r"mita-serve: started a Ray of its own \(node 127\.0\.0\.1\) and "
                     r"Serve's HTTP proxy; deployed mita-serve \(3 deployments\) in \d+ s",
                     out), out[-3000:]
    assert "Connecting to existing Serve app" not in out, out[-3000:]
    assert list((ray_tmp / "ray").glob("session_*")), "its own Ray, in RAY_TMPDIR"
    shutil.rmtree(ray_tmp, ignore_errors=True)


@pytest.mark.service  # its own Ray, in a subprocess
def test_second_sigterm_stops_at_once_and_leaves_no_ray_behind(tmp_path):
    """A second SIGTERM during the drain (4 long dense requests in flight): exit status 1 within
    seconds, no process of that Ray instance left and the metrics port free. On main the
    second signal killed ``python -m service`` outright: Ray's dashboard and runtime-env agents
    stayed (the first holding the metrics port) and the next start was refused."""
    proc, http_port, metrics_port = own_instance(tmp_path, "--dashboard-host", "off")
    url = f"http://127.0.0.1:{http_port}"
    try:
        wait_started(proc, url)
        assert wait_for(lambda: any("Ctrl-C stops." in line for line in proc.lines), 60)
        ray = psutil.Process(proc.pid).children(recursive=True)
        assert any("raylet" in " ".join(p.cmdline()) for p in ray)
        second, _ = sigterm_under_load(proc, url, inflight=4, signals=2)
        out = output(proc, 60)
        exit_s = time.monotonic() - second
    finally:
        reap(proc)

    assert proc.returncode == 1, out[-2000:]
    assert "mita-serve: a second signal: stopping at once" in out, out[-2000:]
    assert "drained (" not in out, out[-2000:]  # the drain was cut short
    assert exit_s < 20, (exit_s, out[-2000:])
    assert wait_for(lambda: not any(alive(p) for p in ray), timeout_s=20), \
        [" ".join(p.cmdline())[:80] for p in ray if alive(p)]
    assert wait_for(lambda: not listening(metrics_port), timeout_s=20), "metrics port held"


@pytest.mark.service  # its own Ray, in a subprocess
def test_stopped_from_outside_exits_1_with_a_message_and_no_ray_left(tmp_path):
    """Ray or Serve stopped under a running service: ``ray stop`` (here its first act on this
    instance alone: SIGTERM to the GCS server) or Ray's ``serve shutdown`` CLI (through the Ray
    dashboard), each to a python -m service of its own, both at once. A line saying what
    happened, said again as the last line once stopped, exit status 1, no process of that Ray
    left, the HTTP and metrics ports free. On main, after serve shutdown ``python -m service``
    kept running with nothing to serve until a signal; after ray stop Ray's core worker
    aborted it 60 s later with its own 'Failed to connect to GCS within 60 seconds'."""
    at_once(tmp_path, {how: partial(stopped_from_outside, how=how)
                       for how in ("ray stop", "serve shutdown")})


def stopped_from_outside(tmp_path: Path, env: dict, how: str) -> None:
    """``test_stopped_from_outside_exits_1_with_a_message_and_no_ray_left``'s scenario for
    ``how``."""
    from ..helpers import free_port

    dashboard_port = free_port()
    args = (("--dashboard-host", "off") if how == "ray stop" else
            ("--dashboard-host", "127.0.0.1", "--dashboard-port", str(dashboard_port)))
    proc, http_port, metrics_port = own_instance(tmp_path, *args, env=env)
    url = f"http://127.0.0.1:{http_port}"
    try:
        wait_started(proc, url)
        assert wait_for(lambda: any("Ctrl-C stops." in line for line in proc.lines), 60)
        ray = psutil.Process(proc.pid).children(recursive=True)
        address = next(a.split("=", 1)[1] for p in ray if "raylet" in p.name()
                       for a in p.cmdline() if a.startswith("--gcs-address="))
        t0 = time.monotonic()
        if how == "ray stop":
            next(p for p in ray if "gcs_server" in p.name()).terminate()
        else:
            done = subprocess.run(
                [str(Path(sys.executable).parent / "serve"), "shutdown", "-y",
                 "-a", f"http://127.0.0.1:{dashboard_port}"], cwd=ROOT, capture_output=True,
                text=True, timeout=120, env=os.environ | {"RAY_AUTH_MODE": "token"})
            assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
        out = output(proc, 60)
        exit_s = time.monotonic() - t0
    finally:
        reap(proc)

    assert proc.returncode == 1, out[-2000:]
    said = {"ray stop": f"mita-serve: Ray's GCS at {address} is gone",
            "serve shutdown": "mita-serve: Serve was shut down from outside (serve shutdown?)"}
    lines = out.rstrip().splitlines()
    # said at once, and again as the last line once stopped: Ray's shutdown may print between
    # (gRPC's "skipping fork() handlers", seen in a CI run)
    assert any(line.startswith(said[how]) and line.endswith("; stopping")
               for line in lines), out[-2000:]
    assert lines[-1].startswith(said[how]), out[-2000:]
    assert lines[-1].endswith("; stopped, exiting with status 1"), out[-2000:]
    assert "Traceback" not in out and "Failed to connect to GCS" not in out, out[-2000:]
    assert exit_s < 45, (exit_s, out[-2000:])
    assert not [p for p in ray if alive(p)], [" ".join(p.cmdline())[:80] for p in ray if alive(p)]
    assert not listening(metrics_port) and not listening(http_port)


@pytest.mark.service  # its own Ray, in a subprocess
def test_requests_beyond_the_drain_time_are_cut_when_it_ends(tmp_path):
    """SIGTERM with 24 dense N = 16,384 requests in flight (~1-2 s each, one replica) and a
    5 s drain time (the Gateway's graceful_shutdown_timeout_s): the drain ends with requests
    left, which are cut then, and the process exits 0 within the drain time plus a few
    seconds. On main Serve's graceful shutdown waited for them once more, up to the same 5 s
    (exit 16.1 s after SIGTERM; with the shipped 30 s past Serve's own 30 s limit:
    "Controller failed to shut down within 30.0s")."""
    proc, http_port, _ = own_instance(tmp_path, "--dashboard-host", "off",
                                      gateway={"graceful_shutdown_timeout_s": 5})
    url = f"http://127.0.0.1:{http_port}"
    try:
        wait_started(proc, url)
        signalled, answers = sigterm_under_load(proc, url, inflight=24, signals=1)
        out = output(proc, 60)
        exit_s = time.monotonic() - signalled
    finally:
        reap(proc)
    assert proc.returncode == 0, out[-2000:]
    assert exit_s < 5 + 6, (exit_s, out[-2000:])
    left = re.search(r"drained \((\d+) request\(s\) still in flight\); stopping: those are cut",
                     out)
    assert left and int(left[1]) > 0, out[-2000:]
    answered = sum(getattr(a, "status_code", None) == 200 for a in answers)
    assert 0 < answered < 24, answers
