"""The README's walkthrough, run as a user would: make serve's python -m service with a Ray of its
own, every documented request against it, then a drain and stop (the other README checks:
tests/no_ray/test_readme.py)."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest
import yaml

from .. import pages
from ..helpers import inherit_priority, wait_for
from ..pages import listops_value, readme_env, sh, shrink
from ..processes import kill_under_load, stop_under_load

ROOT = Path(__file__).resolve().parents[2]


README = pages.text()  # README.md and docs/*.md, in reading order


README_COMMANDS, TINY_TRAIN = pages.README_COMMANDS, pages.TINY_TRAIN


readme_commands, offline = pages.readme_commands, pages.offline








def port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def stop(proc: subprocess.Popen, timeout_s: float = 90) -> str:
    """SIGINT to the process group (Ctrl-C in a terminal) if it still runs; its output (read
    all along by a thread where ``proc.lines`` is set, else now)."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGINT)
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    if hasattr(proc, "lines"):
        proc.reader.join(timeout=10)
        return "".join(proc.lines)
    return proc.stdout.read() if proc.stdout else ""


@pytest.mark.service
def test_readme_walkthrough(tmp_path):
    """The README from top to bottom on this checkout: ``make serve`` (set-up included), both
    curl examples (the answer the README states), the live update with Ray's serve CLI (A/B
    weights and shadow change, same replica ids), ``serve config``, Prometheus scraping the
    service with the shipped config, a shrunk load test; then, in Ray Serve's throughput mode
    (``make serve``'s: between replicas it calls over gRPC), a MiTA replica killed (SIGKILL)
    under 4 closed-loop clients loses no request, and SIGTERM to the service (a pod's stop)
    with 4 long requests in flight drains them (a request during the drain: 503) and ``make
    serve`` exits 0 within 15 s of the last answer (Serve held a stopping ingress replica 30 s
    for its direct-ingress port); then the request overhead benchmark, shrunk (a service of
    its own). On main ``python -m service`` died in throughput mode at start-up ("No event
    loop running"). Ctrl-C's drain: ``test_start_and_stop.py``."""
    busy = [p for p in (8000, 9100, 8265, 9090) if not port_free(p)]
    assert not busy, f"the README's default ports {busy} are in use: stop what holds them"
    cmds = [c for c in readme_commands() if README_COMMANDS[c][0] == "run" and not offline(c)]
    env = readme_env()
    ran: set[str] = set()

    def run(command: str, timeout_s: float = 300) -> subprocess.CompletedProcess:
        ran.add(command)
        return sh(shrink(command, tmp_path), env, timeout_s)

    serve = subprocess.Popen(["make", "serve"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, start_new_session=True,
                             preexec_fn=inherit_priority())
    # Read all along: a pipe nobody reads blocks the service's next print once it is full.
    serve.lines = []
    serve.reader = threading.Thread(target=lambda: serve.lines.extend(serve.stdout),
                                    daemon=True)
    serve.reader.start()
    ran |= {"make serve", "python -m service"}
    url = "http://127.0.0.1:8000"
    prometheus = None
    try:
        def models():
            try:
                r = httpx.get(f"{url}/v1/models", timeout=5)
                return r.json() if r.status_code == 200 else None
            except httpx.HTTPError:
                return None
        before = wait_for(models, timeout_s=400, interval_s=2)
        assert before, stop(serve)[-4000:]
        # The service made Ray's token with `ray get-auth-token --generate` (or found one).
        assert (Path.home() / ".ray" / "auth_token").is_file()
        ran.add("ray get-auth-token --generate")

        # The first curl: the README states the value and the shipped model's answer.
        curl = next(c for c in cmds if c.startswith("curl"))
        body = json.loads(run(curl).stdout)
        text = re.search(r'"text": "([^"]+)"', curl).group(1)
        stated = re.search(r"The value of `(.+?)` is (\d)\. The shipped model answers "
                           r"\*\*(\d)\*\*", README)
        assert stated and stated.group(1) == text
        assert (int(stated.group(2)), int(stated.group(3))) == (listops_value(text),
                                                                body["label"]), body
        assert body["profile"]["stages_ms"] and body["variant"] in ("mita", "dense")
        binary = json.loads(run(next(c for c in cmds if c.startswith("python3 -c"))).stdout)
        # ids 12 3 11 5 8 15 1 15 are "[MAX 2 [MIN 4 7 ] 0 ]" again: the same answer
        assert binary["n"] == 8 and binary["label"] == body["label"]

        # Live update: copy, edit the Gateway's user_config, check, deploy, status.
        run("cp deploy/serve_config.yaml my.yaml")
        try:
            config = yaml.safe_load((ROOT / "my.yaml").read_text())
            gateway = next(d for d in config["applications"][0]["deployments"]
                           if d["name"] == "Gateway")
            gateway["user_config"].update(weights={"mita": 0.0, "dense": 1.0}, shadow=True)
            (ROOT / "my.yaml").write_text(yaml.safe_dump(config))
            assert ": OK" in run(".venv/bin/python -m service --check --config my.yaml").stdout
            ran.add("export RAY_AUTH_MODE=token")
            env["RAY_AUTH_MODE"] = "token"
            run(".venv/bin/serve deploy my.yaml")
            ran.add("serve deploy")
            after = wait_for(lambda: (lambda m: m if m and m["ab_policy"]["shadow"] else None)(
                models()), timeout_s=60)
            assert after, models()
            status = run(".venv/bin/serve status").stdout
            shown = sh(".venv/bin/serve config", env).stdout
            ran.add("serve config")
            # A bad update through the same CLI (which skips --check): the replicas refuse
            # it, say so, and keep serving the policy above.
            gateway["user_config"]["weights"] = {"mita": -0.5, "dense": 1.0}
            (ROOT / "my.yaml").write_text(yaml.safe_dump(config))
            sh(".venv/bin/serve deploy my.yaml", env)
            refused = wait_for(lambda: (lambda m: m if m and m["config_update"]["state"]
                                        == "refused" else None)(models()), timeout_s=60)
            still = httpx.post(f"{url}/v1/classify", json={"text": "[MAX 2 9 ]"})
        finally:
            (ROOT / "my.yaml").unlink(missing_ok=True)
        assert after["ab_policy"]["weights"] == {"mita": 0.0, "dense": 1.0}
        assert {v: i["replica"] for v, i in after["variants"].items()} == {
            v: i["replica"] for v, i in before["variants"].items()}  # no restart
        assert "RUNNING" in status and "shadow: true" in shown, (status, shown)
        assert refused and "weights" in refused["config_update"]["error"], models()
        assert refused["ab_policy"]["weights"] == {"mita": 0.0, "dense": 1.0}
        assert still.status_code == 200 and still.json()["variant"] == "dense", still.text
        assert httpx.post(f"{url}/v1/classify", json={"text": "[MAX 2 9 ]"}).json()[
            "variant"] == "dense"  # the new weights route everything to dense

        # Prometheus with the shipped config scrapes this service.
        prom = next(c for c in cmds if c.startswith("prometheus"))
        ran.add(prom)
        prometheus = subprocess.Popen(shlex.split(shrink(prom, tmp_path)), cwd=ROOT,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                      start_new_session=True, preexec_fn=inherit_priority())

        def scraped():
            try:
                targets = httpx.get("http://127.0.0.1:9090/api/v1/targets", timeout=5).json()
            except (httpx.HTTPError, ValueError):
                return None
            up = [t for t in targets["data"]["activeTargets"] if t["health"] == "up"]
            return up or None
        assert wait_for(scraped, timeout_s=60, interval_s=2), "Prometheus never scraped it"

        load, shot = [c for c in cmds if "-m loadtest" in c]
        run(load, timeout_s=300)
        report = json.loads((tmp_path / "runs" / "loadtest" / "loadtest.json").read_text())
        assert {(r["n"], r["variant"], r["ok"]) for r in report["rows"]} == {
            (n, v, 2) for n in (1024, 4096) for v in ("mita", "dense")}
        run(shot, timeout_s=300)  # the screenshot's traffic, one request per phase
        report = json.loads((tmp_path / "runs" / "loadtest-shot" / "loadtest.json").read_text())
        assert {(r["n"], r["variant"], r["ok"]) for r in report["rows"]} == {
            (2048, v, 1) for v in ("mita", "dense", "ab")}

        # Throughput mode under faults: a replica killed, then SIGTERM with requests in flight.
        service = next(p for p in psutil.Process(serve.pid).children(recursive=True)
                       if p.cmdline()[1:3] == ["-m", "service"])
        faults_from = len(serve.lines)  # its output from here on: no Traceback
        killed = kill_under_load(service.pid, url, "MiTAClassifier")
        assert killed["statuses"] and set(killed["statuses"]) == {200}, killed
        answers, late, _, _ = stop_under_load(url, 4, lambda: service.send_signal(signal.SIGTERM))
        answered = time.monotonic()
        serve.wait(timeout=60)
        exit_s = time.monotonic() - answered
    finally:
        if prometheus is not None:
            stop(prometheus, 30)
        out = stop(serve)
    assert [r.status_code for r in answers] == [200] * 4
    assert late.status_code == 503, late.text
    assert serve.returncode == 0, out[-3000:]  # make exits with the service's status
    assert exit_s < 15, (exit_s, out[-2000:])
    assert "mita-serve: drained (0 request(s) still in flight)" in out, out[-3000:]
    assert "mita-serve: draining" in out, out[-3000:]
    faults = "".join(serve.lines[faults_from:])
    assert "Traceback" not in faults, faults[-3000:]
    # the live update and the faults above: in Ray Serve's throughput mode
    assert "Ray Serve mode: throughput (RAY_SERVE_THROUGHPUT_OPTIMIZED=1" in out, out[-3000:]

    out = run(next(c for c in cmds if "request_overhead" in c), 300).stdout
    assert "binary" in out, out
    assert ran >= set(cmds), set(cmds) - ran


