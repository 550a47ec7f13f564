"""The GPU command's compiles, counted on the CPU (``benchmarks/gpu_compiles.py``, the dry form
of ``benchmarks/gpu_check.sh``), and what its scripts import: the GPU host's own packages."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow  # fresh processes importing torch and Triton


def run(code: str, **env) -> subprocess.CompletedProcess:
    """``code`` in a fresh process without ``TRITON_INTERPRET``: the recorder needs compiled
    (not interpreted) kernels, and Triton decides at decoration."""
    clean = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, env=clean | {"PYTHONPATH": "."} | env)


def test_dry_form_lists_each_step_within_its_budget():
    """``gpu_check.sh --dry``: every specialisation per step, within ``BUDGET``. The whole
    run compiles 112 (the mita step's speed rows, one-layer rows and checks: 89; training: the
    backward's five kernels per dtype, s and ordered / atomic, and the fused forward's float32
    s > 1 cases: 17; topk: none its own; serving: 6) — 206 before the shape integers were left
    unspecialised (and without the training step). Every listed
    launch carries GPU meta (``UPCAST`` off: the interpreter's bfloat16 workaround), and the
    kernels of the model's path all appear."""
    done = subprocess.run(["bash", "benchmarks/gpu_check.sh", "--dry"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300,
                          env={k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
                          | {"PYTHON": sys.executable})
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    heads = [line for line in done.stdout.splitlines() if not line.startswith("  ")]
    counts = {line.split(":")[0]: int(line.split(": ")[1].split()[0]) for line in heads}
    assert counts == {"mita": 89, "training": 17, "topk": 0, "serving": 6}, heads
    listed = [line.split()[0] for line in done.stdout.splitlines() if line.startswith("  ")]
    assert len(listed) == 112
    assert {"_pool_kernel", "_select_pass_kernel", "_theta_kernel", "_select_kernel",
            "_bisect_topk_kernel", "_landmark_topk_kernel", "_route_shared_kernel",
            "_tile_count_kernel", "_tile_scan_kernel", "_tile_scatter_kernel",
            "_mita_fused_kernel", "_shared_dq_kernel", "_shared_dkv_kernel",
            "_routed_dq_kernel", "_routed_dkv_kernel", "_key_sum_kernel"} == set(listed)
    assert '"UPCAST": true' not in done.stdout


def test_a_step_over_its_budget_fails():
    """A change that adds compiles fails the dry form (exit 1, the step named): the budget
    lowered below the mita step's 89 stands for such a change."""
    done = run("import sys; sys.argv = ['x']\n"
               "from benchmarks import gpu_compiles as g\n"
               "g.BUDGET['mita'] = 88\n"
               "sys.exit(g.main([]))")
    assert done.returncode == 1, done.stdout + done.stderr[-3000:]
    assert "mita: 89 fresh compiles (budget 88) OVER BUDGET" in done.stdout


def test_new_sequence_lengths_compile_nothing():
    """Shape integers are not specialised: the whole model at N = 16K and at N = 16K + 3 (odd,
    neither divisible by 16 nor 1) launches the same specialisations."""
    done = run(
        "import torch\n"
        "from benchmarks import gpu_compiles as g\n"
        "from benchmarks.gpu_mita import build\n"
        "from mita.model import set_mita_backend\n"
        "seen = []\n"
        "for n in (16384, 16387):\n"
        "    with g.recording() as r, torch.no_grad():\n"
        "        model = build(16384, 'mita', g.META, torch.bfloat16)\n"
        "        set_mita_backend(model, 'triton')\n"
        "        g.forward(model, 1, n, False)\n"
        "    seen.append(sorted(r.seen))\n"
        "print(len(seen[0]), seen[0] == seen[1])")
    assert done.returncode == 0, done.stderr[-3000:]
    count, same = done.stdout.split()
    assert int(count) >= 11 and same == "True", done.stdout


@pytest.mark.parametrize("script", ["gpu_mita", "gpu_topk", "gpu_compiles", "gpu_mita_checks",
                                    "gpu_training"])
def test_gpu_scripts_import_only_the_gpu_images_packages(script):
    """The GPU host's image has torch, Triton, numpy and safetensors, no pydantic and no Ray:
    the scripts of the steps that must run there import with both made unimportable (the
    serving step needs pydantic and ``gpu_check.sh`` skips it without; the dry form then
    says so)."""
    done = run("import sys, runpy\n"
               "sys.modules['pydantic'] = None; sys.modules['ray'] = None\n"
               f"runpy.run_path('benchmarks/{script}.py', run_name='not_main')\n"
               "from benchmarks import gpu_compiles\n"
               "print(gpu_compiles.steps())")
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "['mita', 'training', 'topk']"


def preflight(tmp_path, fake_triton: str | None = None) -> subprocess.CompletedProcess:
    """``gpu_check.sh`` on this CPU machine, its Python wrapped so that Triton may claim
    ``fake_triton`` as its version (a ``sitecustomize`` on the wrapper's path)."""
    site = tmp_path / "site"
    site.mkdir()
    if fake_triton:
        (site / "sitecustomize.py").write_text(f"import triton\ntriton.__version__ = "
                                               f"{fake_triton!r}\n")
    wrapper = tmp_path / "python"
    wrapper.write_text(f'#!/bin/sh\nPYTHONPATH={site}:$PYTHONPATH exec {sys.executable} "$@"\n')
    wrapper.chmod(0o755)
    return subprocess.run(["bash", "benchmarks/gpu_check.sh", str(tmp_path / "out")], cwd=ROOT,
                          capture_output=True, text=True, timeout=300,
                          env={k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
                          | {"PYTHON": str(wrapper), "CUDA_VISIBLE_DEVICES": ""})


def test_preflight_fails_fast_in_one_line(tmp_path):
    """Without a GPU, or with a Triton below the kernels' floor (3.5: the filter's per-key
    atomic results), the GPU command stops at its preflight: exit 1, one line saying why,
    in the report too, and no step run (no step log). (The preflight's exit inside a brace
    group ended the script before it printed the report: nothing was said.)"""
    done = preflight(tmp_path)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "- preflight failed: no CUDA device" in done.stdout
    assert "- preflight failed: no CUDA device" in (tmp_path / "out" / "gpu_check.md").read_text()
    assert not list((tmp_path / "out").glob("*.log"))
    (tmp_path / "old").mkdir()
    old = preflight(tmp_path / "old", fake_triton="3.4.0")
    assert old.returncode == 1, old.stdout + old.stderr
    assert ("- preflight failed: Triton 3.4.0 is installed; the Triton MiTA kernels need "
            "triton>=3.5") in old.stdout
