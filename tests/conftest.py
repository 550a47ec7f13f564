"""Shared fixtures and hooks: the real service (Ray Serve on loopback, in this process), the
reset after a test that redeploys it, the ``service`` marker for every test that takes it, and
how ``make test``'s parallel workers (pytest-xdist, ``--dist loadgroup``) share the machine.
Plain helpers are in ``helpers.py``."""

from __future__ import annotations

import os

import httpx
import pytest

from . import lanes

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


# Parallel workers (make test: pytest -n 3 --dist loadgroup). Each worker is a process of its
# own; which tests go where is their folder's lane (``lanes.py``); what they start on this
# machine is kept apart:
# - the tests that take the session's service run in one worker, in order (xdist group "ray");
#   the tests that start a Ray instance of their own (a subprocess, a cluster) in another
#   (group "ray-own"). A test of either group holds the cores lock (``pytest_runtest_protocol``)
#   while it runs, so that its timing checks (load shedding, p99 ratios, drains, exit times)
#   meet no other Ray test's load, as in a serial run; only the session's tests marked
#   ``sharing``, which mostly wait (for Prometheus' scrapes, a deadline) and check nothing a
#   busier machine moves, run beside one of them without it, first in their worker;
# - every other test (no Ray: kernels, the interpreter, compiles, CLIs) runs in the background
#   (``cpu_priority``): in a worker that is a session of its own (a scheduling autogroup of its
#   own, where the kernel has them: Linux's default) at nice 19, it takes only what the Ray
#   tests leave of the cores. A plain nice 19 in pytest's session does not do that with
#   autogroups: the kernel shares the CPU between sessions first, and Ray's workers run at nice
#   15 anyway;
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
def pytest_configure(config):
    """An xdist worker starts a session of its own before anything (the session's service, a
    module's cluster) starts processes: ``cpu_priority`` sets the session's priority per test,
    and the processes a test starts share it."""
    if WORKERS > 1 and os.getsid(0) != os.getpid():
        os.setsid()


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


@pytest.fixture(autouse=True, scope="session")
def interpreter_patches_once_per_launch():
    """Triton's interpreter patches ``triton.language`` (every builtin of ``tl``, ``tl.core``,
    ``tl.math``, ``tl.tensor``, found by ``inspect.getmembers``) at each launch, and again at
    each call of a ``@triton.jit`` helper inside the launch, where the launch's patches are
    already in place: a fifth of the top-k tests' time (69,545 patchings in
    ``test_noisy_repeats_overflow_to_the_exact_fallback``). Here a helper's call inside a
    launch patches only when it sees a language module the launch did not patch; a launch
    patches and restores as before. Yields whether the shortcut is in place."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        yield False
        return
    import inspect

    real = getattr(interpreter, "_patch_lang", None)
    scope_type = getattr(interpreter, "_LangPatchScope", None)
    if real is None or scope_type is None or not hasattr(scope_type, "restore"):
        yield False  # another Triton: its interpreter as it is
        return
    tl, core = interpreter.tl, interpreter.tl.core
    patched: list[set] = []  # the language modules of the launch running, if any

    def langs(fn) -> set:
        return {id(v) for v in fn.__globals__.values()
                if inspect.ismodule(v) and (v is tl or v is core)}

    def patch_lang(fn):
        if patched and langs(fn) <= patched[-1]:
            return scope_type()  # nothing changed, nothing to restore
        scope = real(fn)
        if not patched:  # a launch: its restore() ends it
            patched.append(langs(fn))
            restore = scope.restore

            def restore_and_end():
                patched.clear()
                restore()
            scope.restore = restore_and_end
        return scope
    interpreter._patch_lang = patch_lang
    yield True
    interpreter._patch_lang = real


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
    """Under xdist, the worker's session (``pytest_configure``) at nice 0 for a test of
    ``RAY_LANES``, else in the background at ``BACKGROUND_NICE``, so that the cores go first to
    the Ray tests and the timings they are checked against."""
    if WORKERS > 1:
        from .helpers import set_priority

        background = lanes.lane(request.node) not in lanes.RAY_LANES
        set_priority(BACKGROUND_NICE if background else 0)
        background_threads(background)
    yield


_THREADS = {}  # the worker's own torch threads and OMP_NUM_THREADS, before background_threads


def background_threads(background: bool) -> None:
    """A background test's torch (and the processes it starts: ``OMP_NUM_THREADS``) on one
    thread; a Ray test's as the worker started. Three workers, the Ray instances and their
    replicas share two cores: a torch on two threads there spends its time waiting for its
    other thread (OpenMP spins): the replica-memory test took 121 CPU-s beside the other
    background worker, 30 alone on one thread. Tests of thread counts set theirs."""
    import torch

    if not _THREADS:
        _THREADS.update(torch=torch.get_num_threads(), omp=os.environ.get("OMP_NUM_THREADS"))
    torch.set_num_threads(1 if background else _THREADS["torch"])
    if background:
        os.environ["OMP_NUM_THREADS"] = "1"
    elif _THREADS["omp"] is None:
        os.environ.pop("OMP_NUM_THREADS", None)
    else:
        os.environ["OMP_NUM_THREADS"] = _THREADS["omp"]


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


# The background tests' priority (``cpu_priority``); the Ray tests run at 0.
BACKGROUND_NICE = 19


def _locked(item, name: str, mode: int):
    """The run's lock file ``name`` (one per run, shared by its workers), flock'ed in ``mode``;
    closing it releases the lock."""
    import fcntl
    import tempfile

    uid = item.config.workerinput["testrunuid"]
    f = open(os.path.join(tempfile.gettempdir(), f"mita-serve-tests-{uid}-{name}.lock"), "a")
    fcntl.flock(f, mode)
    return f


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Under xdist, from a test's fixtures' set-up (a module's cluster is started there) to
    their teardown: a Ray test (not marked ``sharing``) holds the cores lock; a ``quiet`` test
    also holds the quiet lock, which waits for the background tests running and keeps new ones
    from starting (each takes it shared, after a turnstile the quiet test holds while it
    waits, so that back-to-back background tests cannot keep it out)."""
    import fcntl

    held = []
    if WORKERS > 1:
        if lanes.lane(item) not in lanes.RAY_LANES:
            _locked(item, "turnstile", fcntl.LOCK_SH).close()
            held.append(_locked(item, "quiet", fcntl.LOCK_SH))
        elif not item.get_closest_marker("sharing"):
            held.append(_locked(item, "cores", fcntl.LOCK_EX))
            if item.get_closest_marker("quiet"):
                turnstile = _locked(item, "turnstile", fcntl.LOCK_EX)
                held.append(_locked(item, "quiet", fcntl.LOCK_EX))
                turnstile.close()
    try:
        yield
    finally:
        for f in reversed(held):
            f.close()


@pytest.hookimpl(tryfirst=True)  # before -m deselects by marker; after the folders' hooks
def pytest_collection_modifyitems(config, items):
    """A test that takes the session's Ray Serve app (``service``, directly or through another
    fixture) is a ``service`` test: no hand-written mark to forget, so ``make test-fast``
    (``-m "not service and not slow"``) never starts Ray. Tests that start Ray another way
    (a subprocess, their own cluster) live in ``tests/own_ray/``.

    Every test gets the xdist group of its lane (``lanes.group``: its folder says which), and
    the workers take the groups in ``lanes.rank``'s order (stable: the tests keep their order
    otherwise). A test outside its lane is marked ``misplaced`` and fails at once
    (``pytest_runtest_setup``; under xdist a collection error in a worker reads as a crash
    that names no cause)."""
    for item in items:
        wrong = lanes.problems(item)
        if wrong:
            item.add_marker(pytest.mark.misplaced("; ".join(wrong)))
            if item.get_closest_marker("lane") is None:  # a group and a rank of its own
                item.add_marker(pytest.mark.lane(lanes.BACKGROUND, ""))
        if "service" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.service)
        item.add_marker(pytest.mark.xdist_group(lanes.group(item)))
    items.sort(key=lanes.rank)


@pytest.hookimpl(tryfirst=True)  # before the test's fixtures start anything (the service)
def pytest_runtest_setup(item):
    """A test ``pytest_collection_modifyitems`` found outside its lane fails here, naming
    where it belongs (``lanes.problems``)."""
    misplaced = item.get_closest_marker("misplaced")
    if misplaced:
        pytest.fail(f"outside its lane (tests/lanes.py): {misplaced.args[0]}", pytrace=False)


@pytest.fixture
def browser():
    """Headless Chromium driven by its chromedriver (selenium), with a fresh profile: the
    dashboard's tests, on the running service and without it."""
    import shutil
    import tempfile

    from .helpers import CHROMIUM_FLAGS, CHROMIUM_REQUIRED

    chromium, driver = shutil.which("chromium"), shutil.which("chromedriver")
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        webdriver = None
    if not (chromium and driver and webdriver):
        if CHROMIUM_REQUIRED:
            pytest.fail("chromium, chromium-driver or selenium missing but "
                        "MITA_SERVE_REQUIRE_CHROMIUM=1")
        pytest.skip("chromium/chromium-driver not installed (.ci/run installs Debian's)")
    opts = webdriver.ChromeOptions()
    opts.binary_location = chromium
    with tempfile.TemporaryDirectory(prefix="chromium-") as profile:
        for flag in (*CHROMIUM_FLAGS, f"--user-data-dir={profile}"):
            opts.add_argument(flag)
        opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
        b = webdriver.Chrome(options=opts, service=Service(driver))
        try:
            yield b
        finally:
            b.quit()
