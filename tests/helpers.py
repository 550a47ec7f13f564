"""Inputs, constants and helpers several test modules share (test modules never import each
other): tensors and the Triton interpreter for the kernels, the running service's client and
its redeploys (``set_gateway``, ``set_classifier``), metric counts, fixed /v1/stats data for
the dashboard, a fake clock, the smoke runs of the GPU scripts. Fixtures and hooks are in
``conftest.py``."""

from __future__ import annotations

import copy
import importlib
import os
import random
import socket
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import httpx
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from loadtest.engine import LoadConfig, summarize
from mita.data.listops import ListOpsConfig, generate

CHECKPOINT = "checkpoints/listops-default"

# float64 against the float64 loop reference: only summation order differs.
F64_TOL = 1e-10
# Stages the compiled CPU kernels report for s = 1: topk + shared_compress run inside
# landmark_scores, gather inside attention.
CPU_KERNEL_STAGES = ("pool", "landmark_scores", "route", "attention")
# Real ListOps sequences for the service tests (lengths 100-500, as the LRA-style data).
EXAMPLES = generate(12, seed=777_001, cfg=ListOpsConfig(100, 500))
# The dense classifier's stages, in forward order (its stage metrics, the dashboard's bars).
DENSE_STAGES = ["embed", "qkv_proj", "attention", "out_proj", "ffn", "head"]


def rand_qkv(B, H, N, d, seed, dv=None, dtype=torch.float64):
    """Fresh standard-normal q, k (B, H, N, d) and v (B, H, N, dv or d) from ``seed``."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, N, d, generator=g, dtype=dtype)
    k = torch.randn(B, H, N, d, generator=g, dtype=dtype)
    v = torch.randn(B, H, N, dv or d, generator=g, dtype=dtype)
    return q, k, v


def random_mask(B, N, seed, suffix=True):
    """Bool (B, N), True = padding; every row keeps at least one valid token."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros(B, N, dtype=torch.bool)
    for b in range(B):
        if suffix:
            length = int(torch.randint(1, N + 1, (1,), generator=g))
            mask[b, length:] = True
        else:
            mask[b] = torch.rand(N, generator=g) < 0.4
            mask[b, int(torch.randint(0, N, (1,), generator=g))] = False
    return mask


# The Triton kernel modules in import order (each after the modules it imports jit helpers
# from) and one jit function of each: Triton decides at decoration whether a kernel is
# interpreted, so a module first imported without TRITON_INTERPRET is reloaded, and with it
# every module after it (they hold references to its functions).
KERNEL_MODULES = (("mita.kernels.triton_common", "dot"),
                  ("mita.kernels.bisect", "_bisect_topk_kernel"),
                  ("mita.kernels.tile_table", "_tile_count_kernel"),
                  ("mita.kernels.triton_fused", "_mita_fused_kernel"),
                  ("mita.kernels.triton_backward", "_shared_dq_kernel"),
                  ("mita.kernels.routing", "_landmark_topk_kernel"),
                  ("mita.kernels.topk", "_select_kernel"),
                  ("mita.kernels.pooling", "_pool_kernel"))


@contextmanager
def triton_interpreter():
    """``TRITON_INTERPRET=1`` with the Triton kernel modules (re)imported under it, for a
    module-scoped fixture; yields ``mita.kernels.triton_fused``."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "1")
        stale = False
        for name, fn in KERNEL_MODULES:
            module = importlib.import_module(name)
            stale = stale or type(getattr(module, fn)).__name__ != "InterpretedFunction"
            if stale:
                importlib.reload(module)
        yield importlib.import_module("mita.kernels.triton_fused")


JSON = {"content-type": "application/json"}
OCTETS = {"content-type": "application/octet-stream"}
# One request per kind of refusal before routing, as (status, method, path, body, headers,
# query): the middleware's, the JSON parser's, schema validation's, the router's and the
# endpoints' own checks. Each is counted once as variant "none", except the 404 (not a
# classify path). Sent under any route prefix, every one must give the same status.
REFUSALS = [
    (400, "POST", "/v1/classify", b'{"text": ', JSON, None),
    (422, "POST", "/v1/classify", b'{"foo": 1}', JSON, None),
    (422, "POST", "/v1/classify/batch", b'{"items": [{"ids": [99]}]}', JSON, None),
    (422, "POST", "/v1/classify", b'{"text": "[MAX X ]"}', JSON, None),
    (415, "POST", "/v1/classify", b"{}", {"content-type": "text/plain"}, None),
    (413, "POST", "/v1/classify", b'{"ids": [' + b"3," * 3_000_000 + b"3]}", JSON, None),
    (405, "GET", "/v1/classify", None, None, None),
    (404, "POST", "/nope", b"x", None, None),
    (400, "POST", "/v1/classify/binary", b"", OCTETS, None),
    (422, "POST", "/v1/classify/binary", b"\x00", OCTETS, None),
    (415, "POST", "/v1/classify/binary", b"\x03", JSON, None),
    (422, "POST", "/v1/classify", b'{"text": "[MAX 2 9 ]"}', JSON, {"variant": "dense"}),
    (415, "POST", "/v1/classify", b'{"text": "[MAX 2 9 ]"}',
     {**JSON, "content-encoding": "gzip"}, None),
    (400, "POST", "/v1/classify", b'{"text": "[MAX 2 9 ]"}',
     [("content-type", "application/json"), ("content-type", "application/json")], None),
]
# How many of REFUSALS each status counts in requests_total{variant="none"}.
REFUSALS_COUNTED = {400: 3, 422: 5, 415: 3, 413: 1, 405: 1, 404: 0}


def send_refusals(client, prefix: str = "") -> list[int]:
    """Send every request of ``REFUSALS`` with ``client`` (an httpx.Client) under the route
    ``prefix``; returns the statuses, in order."""
    return [client.request(method, prefix + path, content=body, headers=headers,
                           params=query).status_code
            for _, method, path, body, headers, query in REFUSALS]


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


def set_priority(nice: int) -> None:
    """This process, and what it starts from now on, at ``nice``: its own nice value and, where
    the kernel groups scheduling by session (``/proc/self/autogroup``), its session's. Lowering
    either again needs root (CI is); without it the value stays where it is."""
    try:
        os.setpriority(os.PRIO_PROCESS, 0, nice)
    except PermissionError:
        pass
    try:
        with open("/proc/self/autogroup", "w") as f:
            f.write(str(nice))
    except OSError:  # no autogroups here, or not root
        pass


def inherit_priority():
    """A ``preexec_fn`` for a subprocess that starts a session of its own
    (``start_new_session=True``): the new session gets this one's autogroup nice value, which a
    new session would otherwise reset to 0 (a background test's subprocess then took half the
    cores from the Ray tests)."""
    try:
        with open("/proc/self/autogroup") as f:
            nice = int(f.read().split()[-1])
    except (OSError, ValueError):
        return None
    return lambda: set_priority(nice)


_ports_given: set[int] = set()
_ports_lock = threading.Lock()


def free_port() -> int:
    """A loopback TCP port free now, in 20,000–29,999, never the same twice in one process;
    under pytest-xdist, in this worker's share of that range (a tenth of it each with 10
    workers), so two workers never hand out the same port. Not bind(0)'s pick: that comes
    from the ephemeral range (32,768+), where Ray's own components (GCS, raylet, agents) and
    every client socket take theirs, so the port could be taken between this check and the
    service's bind. Ray's workers use 10,002–19,999 and Serve's direct ingress 30,000+ (its
    throughput mode)."""
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw"))
    share = 10000 // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    with _ports_lock:  # scenarios run at once in threads (test_start_and_stop.at_once)
        while True:
            port = random.randrange(20000 + worker * share, 20000 + (worker + 1) * share)
            if port in _ports_given:
                continue
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:  # in use
                    continue
            _ports_given.add(port)
            return port


@dataclass
class Service:
    url: str
    metrics_url: str
    client: httpx.Client
    # What ``serve_reset`` undoes after a test: the deployment the last ``set_gateway`` /
    # ``set_classifier`` left off the session's config → the user_config values that restore it.
    changed: dict[str, dict] = field(default_factory=dict)

    def post(self, path: str, **kw) -> httpx.Response:
        return self.client.post(path, **kw)

    # metrics_text's pacing: the last read's monotonic time, and a lock for CounterHighs's
    # thread and the test's reads
    _last_read: float = field(default=0.0, repr=False)
    _read_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def metrics_text(self) -> str:
        """The exporter's /metrics page, at most one read a second (waiting for the rest):
        each read costs Ray's agent ~0.16 CPU s (a ~1.3 MB page), and the tests' polls of it
        at 2-4 a second took that from the suite's two cores."""
        with self._read_lock:
            wait = self._last_read + METRICS_READ_INTERVAL_S - time.monotonic()
            if wait > 0:
                time.sleep(wait)
            self._last_read = time.monotonic()
            return httpx.get(self.metrics_url, timeout=10).text


METRICS_READ_INTERVAL_S = 1.0  # the exporter exports every 0.5 s in tests


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


def set_gateway(service, **user_config) -> None:
    """Redeploy with the Gateway's user_config changed (applied by reconfigure, no restart)
    and wait until the gateway reports it; the ``serve_reset`` fixture undoes it after the
    test."""
    from service import launch
    from service.settings import GatewayConfig

    overrides = copy.deepcopy(service.overrides)
    base = launch.load_config(launch.CPU_CONFIG).applications[0]
    gw = next(d for d in base.deployments if d.name == "Gateway").user_config
    overrides["deployments"]["Gateway"]["user_config"] = {**gw, **user_config}
    launch.deploy(launch.load_config(launch.CPU_CONFIG, overrides))
    want = GatewayConfig.model_validate({**gw, **user_config}).model_dump(mode="json")
    # Every redeploy starts from the session's config, so this call's change is the only one.
    default = GatewayConfig.model_validate(gw).model_dump(mode="json")
    service.changed = {"Gateway": {}} if want != default else {}
    assert wait_for(lambda: service.client.get("/v1/models").json()["ab_policy"] == want)


def set_classifier(service, name: str = "MiTAClassifier", **user_config) -> None:
    """Redeploy with one classifier's user_config changed (``reconfigure``, no restart); the
    session's other overrides stay; the ``serve_reset`` fixture undoes it after the test."""
    from service import launch
    from service.settings import ClassifierConfig

    overrides = copy.deepcopy(service.overrides)
    base = launch.load_config(launch.CPU_CONFIG).applications[0]
    uc = next(d for d in base.deployments if d.name == name).user_config
    session = {**uc, **overrides["deployments"][name].get("user_config", {})}
    overrides["deployments"][name]["user_config"] = {**session, **user_config}
    launch.deploy(launch.load_config(launch.CPU_CONFIG, overrides))
    default = ClassifierConfig.model_validate(session).model_dump(mode="json")
    undo = {k: default[k] for k, v in user_config.items() if default[k] != v}
    service.changed = {name: undo} if undo else {}  # as in set_gateway: the only change
    variant = "mita" if name == "MiTAClassifier" else "dense"

    def applied():
        info = service.client.get("/v1/models").json()["variants"][variant]
        return all(info.get(k) == v for k, v in user_config.items())
    assert wait_for(applied)


def metric_families(text: str, name: str):
    """prometheus_client's families of the lines of exposition ``text`` that mention ``name``
    (its samples, its HELP and TYPE lines). Ray's endpoint serves ~1.5 MB (~4,000 series, long
    label sets): parsing all of it took ~0.3 s of CPU per read, and the tests poll it."""
    return text_string_to_metric_families(
        "".join(line + "\n" for line in text.splitlines() if name in line))


def counter_series(text: str, name: str, **labels) -> dict[tuple, float]:
    """Each sample of a metric whose labels include ``labels``, keyed by all its labels."""
    return {tuple(sorted(s.labels.items())): s.value
            for fam in metric_families(text, name) for s in fam.samples
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())}


def counter(text: str, name: str, **labels) -> float:
    """Sum of a metric's samples whose labels include ``labels``."""
    return sum(counter_series(text, name, **labels).values())


class CounterHighs:
    """Polls ``metrics_text()`` in a thread: per series of a counter, the highest value seen,
    and when each predicate ``track``ed first held. A killed replica's series keep its last
    export only until they leave /metrics (``metrics.DEAD_SERIES_S`` later), so a sum read
    once after a slow recovery misses them, and a wait for them to leave that starts late
    reads the leaving late; the highest seen keeps them (counters only grow), the poll times
    the leaving. Use as a context manager."""

    def __init__(self, metrics_text, name: str, interval_s: float = 0.5, **labels):
        self._read, self._name, self._labels = metrics_text, name, labels
        self._interval_s, self._stop = interval_s, threading.Event()
        self._lock = threading.Lock()  # the thread's polls and grown()'s own, one at a time
        self._predicates: dict[str, object] = {}
        self.highs: dict[tuple, float] = {}
        self.first: dict[str, float] = {}  # predicate → monotonic time of the first poll it held
        self._poll()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def track(self, key: str, predicate) -> None:
        """From the next poll on, note in ``first[key]`` when ``predicate(text)`` first holds."""
        self._predicates[key] = predicate

    def _poll(self) -> None:
        text, now = self._read(), time.monotonic()
        with self._lock:
            for key, value in counter_series(text, self._name, **self._labels).items():
                self.highs[key] = max(value, self.highs.get(key, value))
            for key, predicate in list(self._predicates.items()):
                if key not in self.first and predicate(text):
                    self.first[key] = now

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            try:
                self._poll()
            except httpx.HTTPError:  # the endpoint's node restarting: the next poll reads it
                pass

    def grown(self, text0: str) -> float:
        """How much the series seen grew from exposition ``text0`` to their highest (read now
        once more); a series of ``text0`` never seen since (an earlier replica's, leaving)
        counts nothing."""
        self._poll()
        base = counter_series(text0, self._name, **self._labels)
        with self._lock:
            return sum(high - base.get(key, 0.0) for key, high in self.highs.items())

    def __enter__(self) -> CounterHighs:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def delta(text: str, text0: str, name: str, **labels) -> float:
    """How much ``counter``'s series in ``text`` grew from exposition ``text0`` (a series new
    since then from 0). A series of ``text0`` gone since (a replaced replica's: they leave
    /metrics ``metrics.DEAD_SERIES_S`` after its last export) counts nothing: subtracted, as
    the difference of two sums did, it made a count short when it left during a test."""
    before = counter_series(text0, name, **labels)
    return sum(value - before.get(key, 0.0)
               for key, value in counter_series(text, name, **labels).items())


def wait_for(predicate, timeout_s: float = 30.0, interval_s: float = 0.5):
    """Poll ``predicate`` until it returns a truthy value; return it (or the last value)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(interval_s)


REQUEST_SERIES = ({(v, s) for v in ("mita", "dense") for s in ("200", "500", "503", "504")}
                  | {("none", s) for s in ("400", "405", "411", "413", "415", "422", "503")})


REJECTION_SERIES = {(v, r) for v in ("mita", "dense") for r in ("primary", "shadow")}


NO_PROXY_VARIABLES = ("NO_PROXY", "no_proxy")


# The dashboard's browser tests fail instead of skipping without Chromium (.ci/run sets it).
CHROMIUM_REQUIRED = os.environ.get("MITA_SERVE_REQUIRE_CHROMIUM") == "1"


CHROMIUM_FLAGS = ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic",
                  "--no-first-run", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--disable-dev-shm-usage",
                  "--window-size=1400,1200")


def texts(browser, *selectors: str) -> list[str | None]:
    """The rendered text of each selector's element, read in one script call: the page
    redraws its panels every refresh, and an element found by one WebDriver call could be
    replaced before the next call reads it (CI failed once on a StaleElementReferenceException
    between ``find_element`` and ``.text``)."""
    return browser.execute_script(
        "return arguments[0].map(s => { const e = document.querySelector(s); "
        "return e === null ? null : e.innerText.replaceAll('\\u00a0', ' '); })",
        list(selectors))


# The load tester's config of the hand-worked summaries: one N, one variant.
LOAD_CFG = LoadConfig(url="http://127.0.0.1:8000", ns=[256], variants=["mita"])


def only_row(samples, cfg=LOAD_CFG):
    (row,) = summarize(samples, cfg)["rows"]
    return row


def with_documented_apps(session, checkpoints: dict[str, str]):
    """The session's config and, beside it, the second application of
    ``deploy/serve_config.own-data.yaml`` once per ``{route prefix: checkpoint}`` (its
    replicas asking for no CPU, as the session's: the suite shares two cores)."""
    from pathlib import Path

    from ray.serve.schema import ServeDeploySchema

    from service.config_file import read_yaml

    root = Path(__file__).resolve().parents[1]
    raw = session.model_dump(exclude_unset=True)
    for prefix, checkpoint in checkpoints.items():
        own = read_yaml(root / "deploy/serve_config.own-data.yaml")["applications"][1]
        own |= {"name": f"own{prefix.replace('/', '-')}", "route_prefix": prefix}
        own["args"]["checkpoint"] = str(checkpoint)
        for d in own["deployments"]:
            d["ray_actor_options"] = {**d.get("ray_actor_options", {}), "num_cpus": 0}
        raw["applications"].append(own)
    return ServeDeploySchema.model_validate(raw)
