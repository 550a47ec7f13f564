"""What a start-up imports where: Serve's controller imports ``service.app`` to build the
application, and the gateway replica imports ``service.gateway``; neither needs torch (it took
~1.2 s of the app build and a CPU-second of the gateway's start on a 2-core machine). Only the
classifier replicas and the launcher's pre-start checks load it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("module", ["service.app", "service.gateway", "service.classifier"])
def test_building_the_app_imports_no_torch(module):
    code = (f"import sys; import {module}; "
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]", done.stdout[:500]

