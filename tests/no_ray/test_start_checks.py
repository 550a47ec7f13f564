"""Start-up refusals and the scenario runner that need no Ray: a tampered checkpoint is refused
before Ray starts, and the at-once runner names the failing scenario."""

from __future__ import annotations

import shutil
import subprocess
import sys
import threading
import time
from functools import partial
from pathlib import Path

import pytest

from ..helpers import CHECKPOINT
from ..processes import at_once

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.service  # python -m service in a subprocess
def test_tampered_checkpoint_refuses_to_start(tmp_path):
    bad = tmp_path / "ckpt"
    shutil.copytree(ROOT / CHECKPOINT, bad)
    weights = bytearray((bad / "model.safetensors").read_bytes())
    weights[-1] ^= 1  # one flipped bit in the last tensor
    (bad / "model.safetensors").write_bytes(bytes(weights))
    config = (ROOT / "deploy" / "serve_config.yaml").read_text().replace(
        "checkpoint: checkpoints/listops-default", f"checkpoint: {bad}")
    (tmp_path / "serve.yaml").write_text(config)
    t0 = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "service", "--config",
                           str(tmp_path / "serve.yaml")], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 1
    assert "refusing to start" in done.stderr and "does not match" in done.stderr
    assert "SHA-256" in done.stderr
    assert time.monotonic() - t0 < 60  # before Ray starts




def test_at_once_runs_scenarios_together_and_names_the_failing_one(tmp_path):
    """``at_once``: both scenarios run at the same time, each with a folder and a disjoint
    share of the direct-ingress ports, and a failure says which scenario failed."""
    seen: dict = {}
    both = threading.Barrier(2, timeout=30)  # each waits for the other: they run together

    def scenario(folder: Path, env: dict, fail: bool) -> None:
        both.wait()
        seen[folder.name] = env
        assert not fail, "planted"

    with pytest.raises(AssertionError, match="planted") as failed:
        at_once(tmp_path, {"ray stop": partial(scenario, fail=False),
                           "serve shutdown": partial(scenario, fail=True)})
    assert failed.value.__notes__ == ["scenario: serve shutdown"]
    assert sorted(seen) == ["ray-stop", "serve-shutdown"]
    for protocol in ("HTTP", "GRPC"):
        a, b = ((int(env[f"RAY_SERVE_DIRECT_INGRESS_MIN_{protocol}_PORT"]),
                 int(env[f"RAY_SERVE_DIRECT_INGRESS_MAX_{protocol}_PORT"]))
                for env in seen.values())
        assert a[0] <= a[1] < b[0] <= b[1] or b[0] <= b[1] < a[0] <= a[1], (a, b)
