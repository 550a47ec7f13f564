"""The CPU MiTA kernels (``cpu_mita.cpp``), compiled on first use with
``torch.utils.cpp_extension`` (needs a C++ compiler and ninja; ~30 s on 2 cores once per machine
and environment, then imported from the cache ``build_dir()``).

``load()`` returns the extension module or None when it cannot be had here (no compiler, or
another process's build holds the lock past ``MITA_CPU_BUILD_TIMEOUT_S``): MiTA then runs its
PyTorch stages and the reason is logged once. ``mita_cpu`` is the launcher: MiTA's stages on
the loaded extension (``mita.attention`` calls it for ``backend="cpu"``/``"auto"`` on CPU).

The cache: ``$MITA_CPU_BUILD_DIR`` (default ``~/.cache/mita-serve/cpu-kernels``) holds one
folder per ``cache_key()`` — a hash of what the build depends on, never of the checkout's path —
with the finished library in it. A build runs under an OS file lock (``fcntl.flock``: the
kernel drops it when its holder dies, ``kill -9`` included) in a folder of its own, and its
library is moved into place only when complete, so a build killed at any point leaves nothing
that blocks or breaks the next one.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import importlib.util
import logging
import os
import platform
import shutil
import socket
import subprocess
import sys
import sysconfig
import threading
import time
from pathlib import Path

import torch
from torch import Tensor

from .. import stages as S
from ..hooks import StageHook

log = logging.getLogger(__name__)
_SOURCE = Path(__file__).with_name("cpu_mita.cpp")
_NAME = "mita_cpu_kernels"
_LDFLAGS = ("-fopenmp",)  # a tuple: cpp_extension extends the lists it is given
_lock = threading.Lock()
_state: dict[str, object] = {}


def cache_root() -> Path:
    """The kernel cache: ``$MITA_CPU_BUILD_DIR`` or ``~/.cache/mita-serve/cpu-kernels``."""
    default = Path.home() / ".cache" / "mita-serve" / "cpu-kernels"
    return Path(os.environ.get("MITA_CPU_BUILD_DIR", default))


def cache_key(source: Path = _SOURCE) -> str:
    """16 hex digits of a SHA-256 over what the compiled kernels depend on: the source's bytes
    (not its path), torch's version (headers, ABI), the compiler, its version and flags, the CPU
    capability torch dispatches to, the Python ABI and the machine. Two checkouts or
    environments share a build exactly when all of these agree."""
    digest = hashlib.sha256(source.read_bytes())
    for part in (torch.__version__, _compiler(), *_flags(), "ld", *_LDFLAGS,
                 torch.backends.cpu.get_cpu_capability(), sysconfig.get_config_var("EXT_SUFFIX"),
                 platform.machine()):
        digest.update(b"\0" + str(part).encode())
    return digest.hexdigest()[:16]


@functools.cache
def _compiler() -> str:
    """The C++ compiler torch's build uses (``$CXX``, else ``c++``) and the first line of its
    ``--version`` ("" when it does not run: the build then fails and says so)."""
    cxx = os.environ.get("CXX", "c++")
    try:
        done = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30)
        return f"{cxx} {(done.stdout.splitlines() or [''])[0]}"
    except (OSError, subprocess.SubprocessError):
        return cxx


def build_dir() -> Path:
    """Where this build of the kernels is cached: ``cache_root() / cache_key()``."""
    return cache_root() / cache_key()


def _flags() -> list[str]:
    # ATen's Vectorized<float> picks its instruction set from CPU_CAPABILITY; match the
    # capability torch itself dispatches to on this machine (AVX-512 machines run AVX2 here).
    # -fopenmp: at::parallel_for is inline OpenMP; without it the kernels run on one thread
    # and BLAS, seeing no parallel region, threads every small product.
    cflags = ["-O3", "-fopenmp"]
    if torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512"):
        cflags += ["-mavx2", "-mfma", "-DCPU_CAPABILITY_AVX2", "-DCPU_CAPABILITY=AVX2"]
    return cflags


def load():
    """The compiled extension (functions ``landmark_pass``, ``route_shared``,
    ``routed_attention``), or None when it cannot be had here. Thread-safe; builds at most
    once per process; another process's build is waited for at most
    ``MITA_CPU_BUILD_TIMEOUT_S`` seconds (default 300)."""
    with _lock:
        if "module" not in _state:
            _state["module"] = _build()
        return _state["module"]


def _build():
    path = None
    try:
        path = build_dir()
        library = _built(path)
        if library is None:
            path.mkdir(parents=True, exist_ok=True)
            fd = _acquire(path / "build.lock")
            if fd is None:  # a live process holds the build past the wait: logged
                return None
            try:
                library = _built(path) or _compile(path)  # it may have been built meanwhile
            finally:
                os.close(fd)  # releases the lock
        return _import(library)
    except Exception as exc:  # no compiler, no ninja, unwritable cache: fall back, say why
        log.warning("MiTA CPU kernels unavailable (%s: %s); using the PyTorch stages%s",
                    type(exc).__name__, exc,
                    f" (deleting {path} makes the next load rebuild them)" if path else "")
        return None


def _built(path: Path) -> Path | None:
    """The finished library in ``path``, if a build has published one."""
    return next(iter(sorted(path.glob(f"{_NAME}*.so"))), None)


def _acquire(lock: Path) -> int | None:
    """Take the build lock ``lock`` (``fcntl.flock``, which the kernel releases when the
    holder exits, however it exits: a stale lock cannot exist). Waits at most
    ``MITA_CPU_BUILD_TIMEOUT_S`` seconds (default 300) for a live holder; after that logs one
    line naming the lock and its holder and returns None. Returns the locked descriptor."""
    wait_s = float(os.environ.get("MITA_CPU_BUILD_TIMEOUT_S", "300"))
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    deadline = time.monotonic() + wait_s
    told = False
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            holder = lock.read_text().strip() or "a process that has not said who it is"
            if time.monotonic() >= deadline:
                os.close(fd)
                log.warning("MiTA CPU kernels: gave up after %.0f s waiting for the build lock "
                            "%s, held by %s (a build still running, or stuck); using the "
                            "PyTorch stages. If that process is not building, stop it; "
                            "MITA_CPU_BUILD_TIMEOUT_S sets the wait", wait_s, lock, holder)
                return None
            if not told:
                print(f"mita: waiting up to {wait_s:.0f} s for the MiTA CPU kernels that {holder} "
                      f"is building (lock {lock})", file=sys.stderr, flush=True)
                told = True
            time.sleep(0.2)
    # Who holds it, for the message of those who wait (the lock itself is the flock).
    os.ftruncate(fd, 0)
    os.write(fd, f"pid {os.getpid()} on {socket.gethostname()} since "
                 f"{time.strftime('%Y-%m-%d %H:%M:%S')}\n".encode())
    return fd


def _compile(path: Path) -> Path:
    """Build the library in a folder of this process's own under ``path`` and move it into
    ``path`` when complete (an atomic rename). Call with the build lock held: every other
    build folder there is a killed build's (its compiler may even still be running) and is
    removed. Returns the library's path."""
    from torch.utils import cpp_extension

    for stale in path.glob("build-*"):
        shutil.rmtree(stale, ignore_errors=True)
    work = path / f"build-{socket.gethostname()}-{os.getpid()}"
    work.mkdir()
    print(f"mita: building the MiTA CPU kernels once for this machine (~30 s) in {path}",
          file=sys.stderr, flush=True)
    # is_python_module=False: torch only dlopens the library (no module init); it is imported
    # once, from its final place (_import).
    built = Path(cpp_extension.load(_NAME, [str(_SOURCE)], extra_cflags=_flags(),
                                    extra_ldflags=list(_LDFLAGS), build_directory=str(work),
                                    is_python_module=False, verbose=False))
    library = path / built.name
    os.replace(built, library)
    shutil.rmtree(work, ignore_errors=True)
    return library


def _import(library: Path):
    """Import the extension module from ``library`` (its name is the file's stem)."""
    spec = importlib.util.spec_from_file_location(library.stem, library)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def mita_cpu(ext, q: Tensor, k: Tensor, v: Tensor, m: int, topk: int, s: int,
             key_padding_mask: Tensor | None, landmark_grid: tuple[int, int] | None,
             shared_scale: str, hook: StageHook) -> Tensor:
    """``mita_attention`` on the compiled CPU kernels (``mita/kernels/cpu_mita.cpp``): the same
    eqs. 5-12, cache-blocked, float32/float64 q, k, v. Stage ``landmark_scores`` also does
    ``topk`` and ``shared_compress`` (one pass over the keys; the m × N scores are never
    stored). For s = 1, ``route`` also computes the shared half of the joint softmax from its
    q·q̃ products (the reuse the paper's cost model assumes) and ``attention`` gathers each
    expert's k raw pairs by index (no ``gather`` stage) and adds the routed half per tile of
    one expert's queries, merged by log-sum-exp. s > 1 runs ``route``, ``gather`` and
    ``attention`` as the PyTorch stages. Peak extra memory for s = 1, beyond q, k, v and the
    output: B·H·(m·(2·d + dv + k) + 3·N) elements (landmarks and their scaled copy, shared
    values, expert indices; per query its expert, shared-branch maximum and sum) plus per
    thread 256·(d + k + dv) + k·(d + dv) — linear in N, no N × m or N × k block."""
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    B, H, N, d = q.shape
    # True = a real token; it masks keys and, in self-attention, queries too.
    token_valid = None if key_padding_mask is None else ~key_padding_mask
    with hook.stage("pool"):
        landmarks, landmark_valid = S.pool(q, m, key_padding_mask, landmark_grid)
    with hook.stage("landmark_scores"):
        expert_index, shared_values = ext.landmark_pass(
            landmarks=landmarks * d ** -0.5, k=k, v=v, token_valid=token_valid, topk=topk)
    if s > 1:  # the PyTorch stages: per-slot partials merged by log-sum-exp
        with hook.stage("route"):
            experts = S.route(q, landmarks, s, landmark_valid)
        return S.gather_and_attend(q, k, v, landmarks, landmark_valid, shared_values,
                                   expert_index, experts, shared_scale, key_padding_mask, hook)
    with hook.stage("route"):
        experts, out, top, total = ext.route_shared(
            q=q, landmarks=landmarks, landmark_valid=landmark_valid, shared_values=shared_values,
            c_shared=S.shared_logit_scale(d, shared_scale), token_valid=token_valid)
    with hook.stage("attention"):  # gather is fused into this kernel
        ext.routed_attention(q=q, k=k, v=v, expert_index=expert_index,
                             landmark_valid=landmark_valid, token_valid=token_valid,
                             experts=experts, scale=d ** -0.5, acc=out, mx=top, sum=total)
    return out
