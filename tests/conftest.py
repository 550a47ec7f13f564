"""Shared fixtures and hooks: the real service (Ray Serve on loopback, in this process), the
reset after a test that redeploys it, the ``service`` marker for every test that takes it, and
how ``make test``'s parallel workers (pytest-xdist, ``--dist loadgroup``) share the machine.
Plain helpers are in ``helpers.py``."""

from __future__ import annotations

import os

import httpx
import pytest

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


# Parallel workers (make test TEST_WORKERS=2: pytest -n 2 --dist loadgroup). Each worker is a
# process of its own; what they start on this machine is kept apart:
# - every test that runs Ray — the session's service, and the tests that start a Ray instance of
#   their own — runs in one worker, one after another (xdist group "ray"), as in a serial run:
#   their timing checks (load shedding, p99 ratios, drains, exit times) hold as they do there;
#   two Ray instances side by side on 2 cores failed them now and then;
# - the other worker runs the rest (no Ray: kernels, the interpreter, compiles, CLIs) at nice
#   19 (``cpu_priority``), on what the Ray tests leave of the 2 cores;
# - per worker, a share of the loopback ports ``helpers.free_port`` draws from, and of Serve's
#   direct-ingress ports (throughput mode: each Ray instance hands them out from the same
#   first port, 30,000, without asking whether another instance holds it). Set here, in the
#   environment, so every ``python -m service`` a test starts inherits its worker's share.
WORKER = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw"))
WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if WORKERS > 1:
    for protocol, first in (("HTTP", 30000), ("GRPC", 40000)):
        low = first + WORKER * (1000 // WORKERS)
        os.environ.setdefault(f"RAY_SERVE_DIRECT_INGRESS_MIN_{protocol}_PORT", str(low))
        os.environ.setdefault(f"RAY_SERVE_DIRECT_INGRESS_MAX_{protocol}_PORT",
                              str(low + 1000 // WORKERS - 1))
# Node ids (file::name; parameters left out) of the tests that run in the group "ray" but take
# no session service: those that start a Ray instance of their own, and those whose timing
# checks a process at nice 19 could miss (Poisson arrivals' gaps, a refusal within 30 s).
SERIAL = ("tests/test_cluster.py::", "tests/test_gpu_placement.py::",
          "tests/test_readme.py::test_readme_walkthrough",
          "tests/test_start_and_stop.py::test_signal_during_start_up_stops_ray_cleanly",
          "tests/test_start_and_stop.py::test_ctrl_c_drains_in_flight_requests",
          "tests/test_start_and_stop.py::test_second_sigterm_stops_at_once_and_leaves_no_ray_behind",
          "tests/test_loadtest_numbers.py::",
          "tests/test_launch.py::test_busy_port_and_bad_config_refused_before_ray_starts")


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


# The tests that take the session's service, left to run in this process: once none is left,
# its Ray is stopped (``pytest_runtest_teardown``) instead of idling (~0.2 of a core) until the
# session ends. Counted in ``pytest_collection_finish``; under xdist every worker collects all
# of them, and the one worker that runs the group "ray" runs all of them.
_service_tests_left = [0]
_running_service: list = []


def _stop_service() -> None:
    from service import launch

    while _running_service:
        _running_service.pop().client.close()
        launch.stop()


def pytest_collection_finish(session):
    _service_tests_left[0] = sum("service" in getattr(item, "fixturenames", ())
                                 for item in session.items)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    yield  # the test's own fixtures first (serve_reset redeploys through the service)
    if "service" in getattr(item, "fixturenames", ()):
        _service_tests_left[0] -= 1
        if _service_tests_left[0] <= 0:
            _stop_service()


@pytest.fixture(autouse=True)
def cpu_priority(request):
    """Under xdist, a test of no group (no Ray) runs at nice 19: the 2 cores go first to the
    Ray tests and the timings they are checked against, and such a test takes what is left. A
    worker turns back to nice 0 for a grouped test where it may (as root, CI)."""
    if WORKERS > 1:
        grouped = request.node.get_closest_marker("xdist_group") is not None
        try:
            os.setpriority(os.PRIO_PROCESS, 0, 0 if grouped else 19)
        except PermissionError:  # only root may lower it again
            pass
    yield


@pytest.fixture(scope="session")
def service():
    from service import launch

    # here, not at the top: helpers imports torch, which must come after Triton's import above
    from .helpers import CHECKPOINT, TEST_OVERRIDES, Service, free_port

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
    _running_service.append(svc)
    yield svc
    _stop_service()  # if the last test that took it did not run (-x, an interrupt)


@pytest.fixture
def serve_reset(service):
    """For a test that redeploys with ``set_gateway`` / ``set_classifier``: afterwards, pass or
    fail, the changed deployment's user_config is the session's again (and reported so), so
    the next test sees the defaults. Nothing is redeployed when the test left none changed."""
    yield
    from .helpers import set_classifier, set_gateway

    for name, undo in list(service.changed.items()):
        if name == "Gateway":
            set_gateway(service)
        else:
            set_classifier(service, name, **undo)


@pytest.hookimpl(tryfirst=True)  # before -m deselects by marker
def pytest_collection_modifyitems(items):
    """A test that takes the session's Ray Serve app (``service``, directly or through another
    fixture) is a ``service`` test: no hand-written mark to forget, so ``make test-fast``
    (``-m "not service and not slow"``) never starts Ray. Tests that start Ray another way
    (a subprocess, their own cluster) mark themselves."""
    for item in items:
        if "service" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.service)
            item.add_marker(pytest.mark.xdist_group("ray"))
        elif item.nodeid.startswith(SERIAL):
            item.add_marker(pytest.mark.xdist_group("ray"))
    # The group first, its session-service tests before the rest (the service stops after
    # its last test, not idling beside the Ray instances started after it); then the slow
    # tests (the interpreter, compiles), so that the workers taking one test at a time end
    # together. Stable: the tests keep their order otherwise.
    def rank(item) -> int:
        if item.get_closest_marker("xdist_group"):
            return 0 if "service" in getattr(item, "fixturenames", ()) else 1
        return 2 if item.get_closest_marker("service") or item.get_closest_marker("slow") else 3
    items.sort(key=rank)
