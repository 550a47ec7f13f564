"""Shared fixtures: the real service (Ray Serve on loopback, in this process)."""

from __future__ import annotations

import copy
import os
import socket
import time
from dataclasses import dataclass

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

# The Triton kernels are tested under the interpreter in this process (test_kernels.py).
# Triton fixes interpreted vs compiled mode for its own helpers (tl.max …) when it is first
# imported, and torch imports it by itself (torch._dynamo, e.g. when a model is built on the
# meta device by mita.model.load_checkpoint): so it is imported here, interpreted, first. The
# flag is then removed again, so that the processes the tests start (Ray's replicas, python -m
# service) run Triton compiled on a GPU host; test_kernels.py sets it around its own tests.
# Compiled-mode checks run in subprocesses (test_kernel_compile.py).
_interpret = os.environ.get("TRITON_INTERPRET")
os.environ["TRITON_INTERPRET"] = "1"
try:
    import triton.language  # noqa: F401
except ImportError:
    pass
finally:
    if _interpret is None:
        del os.environ["TRITON_INTERPRET"]

CHECKPOINT = "checkpoints/listops-default"


def numpy_sort(x, dim=None, descending=False):
    """``tl.sort`` for the interpreter, by numpy. Triton's own runs its bitonic network one
    interpreted op at a time, ~4 ms per element here (a [16, 128] sort takes ~8 s), which
    made the top-k kernels' tests take most of the suite. Same contract: the last dimension,
    ascending unless ``descending``; ``test_topk_select.py`` checks it against Triton's."""
    import numpy as np
    import triton.language as tl
    from triton.runtime.interpreter import TensorHandle

    descending = getattr(descending, "value", descending)
    dim = getattr(dim, "value", dim)
    if dim not in (None, len(x.shape) - 1, -1):
        raise ValueError("tl.sort sorts the last dimension only")
    out = np.sort(x.handle.data, axis=-1, kind="stable")
    if descending:
        out = np.ascontiguousarray(np.flip(out, -1))
    return tl.tensor(TensorHandle(out, x.handle.dtype), x.type)


@pytest.fixture(autouse=True, scope="session")
def fast_interpreter_sort():
    """Every interpreted kernel in this process sorts with ``numpy_sort``; compiled kernels
    (``test_kernel_compile.py``'s spawned processes, a GPU) keep Triton's."""
    try:
        import triton.language as tl
    except ImportError:
        yield None
        return
    original = tl.sort
    tl.sort = numpy_sort
    yield original
    tl.sort = original


def run_smoke(script: str, out) -> dict:
    """Run ``benchmarks/<script>.py --smoke --out <out>`` in a fresh interpreter (the GPU
    scripts' own code path on the CPU) and return the JSON it wrote; fails the test with the
    script's output tail when it exits non-zero."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / f"{script}.py"
    done = subprocess.run([sys.executable, str(path), "--smoke", "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return json.loads((Path(out) / f"{script}.json").read_text())


def run_smoke_here(script: str, out, monkeypatch) -> object:
    """``run_smoke`` in this process: for the GPU scripts whose smoke run is mostly the
    interpreted Triton kernels, which here sort with ``numpy_sort`` (a fresh process would
    run Triton's interpreted sort: minutes). Returns the JSON the script wrote."""
    import importlib.util
    import json
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / f"{script}.py"
    spec = importlib.util.spec_from_file_location(f"benchmarks_{script}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(sys, "argv", [path.name, "--smoke", "--out", str(out)])
    assert module.main() == 0
    return json.loads((Path(out) / f"{script}.json").read_text())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Service:
    url: str
    metrics_url: str
    client: httpx.Client

    def post(self, path: str, **kw) -> httpx.Response:
        return self.client.post(path, **kw)

    def metrics_text(self) -> str:
        return httpx.get(self.metrics_url, timeout=10).text


# Fixed replicas and short metric export so tests see exact counts quickly. Every MiTA forward
# staged (all seven stages timed apart, as the dashboards' tests expect); the fused path with
# sampling is tested on its own (test_service.py, set_classifier).
TEST_OVERRIDES = {
    "deployments": {
        name: {"num_replicas": 1, "autoscaling_config": None,
               "ray_actor_options": {"num_cpus": 0}}
        for name in ("MiTAClassifier", "DenseClassifier")
    } | {"Gateway": {"ray_actor_options": {"num_cpus": 0}}},
}
TEST_OVERRIDES["deployments"]["MiTAClassifier"]["user_config"] = {"staged_profile_every": 1}


@pytest.fixture(scope="session")
def service():
    from service import launch

    http_port, metrics_port = free_port(), free_port()
    overrides = dict(TEST_OVERRIDES, http_options={"port": http_port},
                     args={"checkpoint": CHECKPOINT, "device": "cpu"})
    config = launch.load_config(launch.CPU_CONFIG, overrides)
    launch.prebuild_cpu_kernels(config)  # as python -m service does, not inside a replica
    url = launch.start(config, metrics_port=metrics_port, metrics_interval_ms=500)
    svc = Service(url=url, metrics_url=f"http://127.0.0.1:{metrics_port}/metrics",
                  client=httpx.Client(base_url=url, timeout=120))
    svc.config = config
    svc.overrides = overrides
    yield svc
    svc.client.close()
    launch.stop()


def set_gateway(service, **user_config) -> None:
    """Redeploy with the Gateway's user_config changed (applied by reconfigure, no restart)
    and wait until the gateway reports it."""
    from service import launch
    from service.schemas import GatewayConfig

    overrides = copy.deepcopy(service.overrides)
    base = launch.load_config(launch.CPU_CONFIG).applications[0]
    gw = next(d for d in base.deployments if d.name == "Gateway").user_config
    overrides["deployments"]["Gateway"]["user_config"] = {**gw, **user_config}
    launch.deploy(launch.load_config(launch.CPU_CONFIG, overrides))
    want = GatewayConfig.model_validate({**gw, **user_config}).model_dump(mode="json")
    assert wait_for(lambda: service.client.get("/v1/models").json()["ab_policy"] == want)


def set_classifier(service, name: str = "MiTAClassifier", **user_config) -> None:
    """Redeploy with one classifier's user_config changed (``reconfigure``, no restart); the
    session's other overrides stay."""
    from service import launch

    overrides = copy.deepcopy(service.overrides)
    base = launch.load_config(launch.CPU_CONFIG).applications[0]
    uc = next(d for d in base.deployments if d.name == name).user_config
    merged = {**uc, **overrides["deployments"][name].get("user_config", {}), **user_config}
    overrides["deployments"][name]["user_config"] = merged
    launch.deploy(launch.load_config(launch.CPU_CONFIG, overrides))
    variant = "mita" if name == "MiTAClassifier" else "dense"

    def applied():
        info = service.client.get("/v1/models").json()["variants"][variant]
        return all(info.get(k) == v for k, v in user_config.items())
    assert wait_for(applied)


def counter(text: str, name: str, **labels) -> float:
    """Sum of a metric's samples whose labels include ``labels``."""
    total = 0.0
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
    return total


def wait_for(predicate, timeout_s: float = 30.0, interval_s: float = 0.5):
    """Poll ``predicate`` until it returns a truthy value; return it (or the last value)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(interval_s)
