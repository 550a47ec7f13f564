"""Shared fixtures and hooks: the real service (Ray Serve on loopback, in this process), the
reset after a test that redeploys it, and the ``service`` marker for every test that takes it.
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
    yield svc
    svc.client.close()
    launch.stop()


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
