"""Building and caching the CPU kernels (``mita/kernels/cpu.py``): a killed build never blocks
the next, a live one is waited for a bounded time, the cache is keyed by what the build
depends on, and a classifier engine loads the kernels in its constructor."""

from __future__ import annotations

import fcntl
import logging
import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
import torch

from mita.kernels import cpu
from service.engine import ClassifierEngine

from ..helpers import inherit_priority

# heavy(3): ~48 CPU s in a serial run
pytestmark = pytest.mark.heavy(3)

ROOT = Path(__file__).resolve().parents[2]
CHECKPOINT = "checkpoints/listops-default"
LOAD = ("import logging\n"
        "logging.basicConfig(level=logging.WARNING, format='LOG %(message)s')\n"
        "from mita.kernels import cpu\n"
        "m = cpu.load()\n"
        "print('LOADED', m.__file__ if m is not None else None, flush=True)\n")


def test_cache_key_follows_the_build_inputs_not_the_checkout_path(tmp_path, monkeypatch):
    a, b = tmp_path / "one" / "cpu_mita.cpp", tmp_path / "two" / "cpu_mita.cpp"
    for copy in (a, b):
        copy.parent.mkdir()
        shutil.copy(cpu._SOURCE, copy)
    key = cpu.cache_key()
    assert len(key) == 16 and cpu.cache_key(a) == cpu.cache_key(b) == key
    b.write_text(b.read_text() + "\n// changed\n")
    assert cpu.cache_key(b) != key
    monkeypatch.setattr(torch, "__version__", "0.0.0")
    assert cpu.cache_key() != key
    monkeypatch.undo()
    monkeypatch.setattr(cpu, "_flags", lambda: ["-O2"])
    assert cpu.cache_key() != key
    monkeypatch.undo()
    monkeypatch.setenv("MITA_CPU_BUILD_DIR", str(tmp_path / "cache"))
    assert cpu.build_dir() == tmp_path / "cache" / key


def test_loaded_module_comes_from_the_keyed_dir():
    module = cpu.load()
    assert module is not None
    assert Path(module.__file__).parent == cpu.build_dir() == cpu.cache_root() / cpu.cache_key()


def test_a_live_build_is_waited_for_a_bounded_time_then_one_line(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("MITA_CPU_BUILD_DIR", str(tmp_path))
    monkeypatch.setenv("MITA_CPU_BUILD_TIMEOUT_S", "1")
    path = cpu.build_dir()
    path.mkdir(parents=True, exist_ok=True)
    lock = path / "build.lock"
    with open(lock, "a+") as held:  # a live holder: this process, through another descriptor
        fcntl.flock(held, fcntl.LOCK_EX)
        held.write("pid 4242 on buildhost since now\n")
        held.flush()
        started = time.monotonic()
        with caplog.at_level(logging.WARNING):
            assert cpu._build() is None
        waited = time.monotonic() - started
    assert 1.0 <= waited < 10
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(lines) == 1, lines
    assert str(lock) in lines[0] and "pid 4242 on buildhost" in lines[0]
    assert "MITA_CPU_BUILD_TIMEOUT_S" in lines[0]


class _Load:
    """``cpu.load()`` in a process of its own session (its compiler processes share it),
    output read line by line."""

    def __init__(self, cache: Path):
        env = os.environ | {"MITA_CPU_BUILD_DIR": str(cache), "MITA_CPU_BUILD_TIMEOUT_S": "240"}
        self.proc = subprocess.Popen([sys.executable, "-c", LOAD], cwd=ROOT, env=env,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True, preexec_fn=inherit_priority())
        self.lines: queue.Queue[str] = queue.Queue()
        self.seen: list[str] = []
        self.killed = "not killed"
        threading.Thread(target=lambda: [self.lines.put(x) for x in self.proc.stdout],
                         daemon=True).start()

    def wait_for(self, text: str, timeout_s: float) -> str | None:
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            try:
                line = self.lines.get(timeout=left)
            except queue.Empty:
                break
            self.seen.append(line)
            if text in line:
                return line
        return None

    def compiling(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                names = {p.name() for p in psutil.Process(self.proc.pid).children(recursive=True)}
            except psutil.Error:
                names = set()
            if "cc1plus" in names:
                return True
            time.sleep(0.2)
        return False

    def kill_session(self) -> None:
        """End what is left of its session: compilers a killed build left running. Ninja
        starts each compile in a process group of its own, so a kill of the load's group
        missed them (a killed build's cc1plus compiled on to the end, 23 CPU s, in a
        clean-clone run)."""
        left = _in_session(self.proc.pid)
        for p in left:
            try:
                p.kill()
            except psutil.Error:
                pass
        psutil.wait_procs(left, timeout=10)


def _in_session(sid: int) -> list[psutil.Process]:
    """The live processes of session ``sid`` (a zombie is dead, waiting for its reaper)."""
    found = []
    for p in psutil.process_iter():
        try:
            if os.getsid(p.pid) == sid and p.status() != psutil.STATUS_ZOMBIE:
                found.append(p)
        except (OSError, psutil.Error):  # gone meanwhile
            pass
    return found


@pytest.mark.slow
def test_killed_builds_never_block_the_next(tmp_path, monkeypatch):
    """Builds killed with SIGKILL and SIGTERM, at their start (lock held, no compiler yet) and
    in the middle (compiler running; it outlives the killed process): each next load takes
    the build over at once, the last one finishes (one full build, ~30 s on 2 cores) and
    the library is where the cache key says."""
    cache = tmp_path / "cache"
    loads: list[_Load] = []
    try:
        # each signal once, each moment once (the other two pairs cost a minute more of
        # compiles under make test and take no other path through the build lock)
        for sig, when in [(signal.SIGKILL, "start"), (signal.SIGTERM, "middle")]:
            after = f"after {loads[-1].killed}" if loads else "first"
            load = _Load(cache)
            loads.append(load)
            assert load.wait_for("building the MiTA CPU kernels", 90), (
                f"the load {after} did not start building within 90 s:\n{''.join(load.seen)}")
            if len(loads) > 1:
                loads[-2].kill_session()  # its orphaned compiler was not waited for
                assert not _in_session(loads[-2].proc.pid), "a killed build's compiler runs on"
            if when == "middle":
                assert load.compiling(60), f"no compiler ran {after}:\n{''.join(load.seen)}"
                time.sleep(2)
            os.kill(load.proc.pid, sig)  # the Python process only, as `kill` does
            load.proc.wait(timeout=30)
            load.killed = f"{signal.Signals(sig).name} at the {when} of a build"
        last = _Load(cache)
        loads.append(last)
        started = last.wait_for("building the MiTA CPU kernels", 90)
        loads[-2].kill_session()
        assert not _in_session(loads[-2].proc.pid), "a killed build's compiler runs on"
        done = started and last.wait_for("LOADED", 400)
        assert done, f"no load after {loads[-2].killed}:\n{''.join(last.seen)}"
        monkeypatch.setenv("MITA_CPU_BUILD_DIR", str(cache))
        assert done.split()[1] == str(cpu.build_dir() / "mita_cpu_kernels.so")
        assert not list(cpu.build_dir().glob("build-*"))  # the killed builds' folders are gone
        again = _Load(cache)  # the cache is used: no build, no wait
        loads.append(again)
        assert again.wait_for("LOADED", 60) == done, "".join(again.seen)
        assert not any("building" in line or "waiting" in line for line in again.seen)
    finally:
        for load in loads:
            load.kill_session()


def test_engine_loads_the_kernels_in_its_constructor(monkeypatch):
    calls = []
    monkeypatch.setattr(cpu, "load", lambda: calls.append(1) or object())
    engine = ClassifierEngine(CHECKPOINT, "mita", device="cpu", mita_backend="auto")
    assert calls == [1] and engine.backend == "auto" and engine.fused()
    ClassifierEngine(CHECKPOINT, "dense", device="cpu")
    ClassifierEngine(CHECKPOINT, "mita", device="cpu", mita_backend="torch")
    assert calls == [1]


def test_engine_without_kernels_serves_pytorch_stages_or_refuses(monkeypatch):
    monkeypatch.setattr(cpu, "load", lambda: None)
    engine = ClassifierEngine(CHECKPOINT, "mita", device="cpu", mita_backend="auto")
    assert engine.backend == "torch" and not engine.fused()
    assert engine.info["mita_backend"] == "torch"
    assert engine.run([[3, 4, 5, 6]])[0]["profile"].staged is True
    with pytest.raises(RuntimeError, match="CPU kernels could not be loaded"):
        ClassifierEngine(CHECKPOINT, "mita", device="cpu", mita_backend="cpu")
