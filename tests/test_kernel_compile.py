"""Every Triton kernel compiles ahead of time for NVIDIA sm_80 and sm_90 on this CPU machine.

The interpreter tests (``test_kernels.py``) check numerics; they do not compile. A kernel that
reads a plain module global passed every interpreter test and failed on the first GPU call
(``NameError: Cannot access global variable _NEG_INIT``). ``mita.kernels.aot`` compiles the
kernel through Triton's launch-time specialisation with the launcher's own arguments, for every
specialisation the launcher can choose, to a cubin, and checks its shared memory fits the
target. The first run takes ~5 min on 2 cores; Triton's cache (``~/.triton/cache``, keyed by
source, options and compiler) makes later runs of unchanged kernels fast.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest

from mita.kernels import aot

# The compiles run in spawned processes without TRITON_INTERPRET: this process runs Triton
# interpreted (tests/conftest.py), for the numerics tests in test_kernels.py.
pytestmark = [pytest.mark.slow, pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                                    reason="Triton is not installed")]


def test_every_kernel_compiles_for_sm80_and_sm90():
    """All 124 specialisations × 2 targets compile to a cubin whose shared memory fits. The
    cases reach every constexpr set the launchers can pick: for the attention kernel each
    (dtype, SINGLE_SLOT, HAS_MASK, BLOCK_D), 3 × 2 × 2 × 4, num_stages 2 exactly for float32
    with BLOCK_D = 128 (also for route_shared); for landmark_topk each (dtype, BLOCK_D ∈ {64,
    128}, K_PAD ∈ {64 … 512}), 3 × 2 × 4; for route_shared each (dtype, BLOCK_D), 3 × 4; for
    the pool each (dtype, BLOCK_D ∈ {64, 128}, HAS_MASK), 3 × 2 × 2; for the tile table each
    (s = 1 or not, HAS_MASK), 2 × 2; for the threshold select's group max, filter and bisection
    fallback each (dtype, BLOCK_D ∈ {64, 128}), 3 × 2 each, and for its select each (CAP,
    ROWS) from (128, 16) to (4096, 1), with 8 warps from CAP 2048. (Compiled in spawned
    processes: this pytest process may hold the interpreter's version of the kernels.)"""
    results = aot.check_all()
    assert len(results) == 248
    failed = [f"sm_{r['sm']} {r['case']}: {r['error']}" for r in results if not r["ok"]]
    assert not failed, "\n".join(failed)
    assert all(r["cubin_bytes"] > 1000 for r in results)
    assert max(r["shared_bytes"] for r in results if r["sm"] == 80) <= 163 * 1024
    seen = {kernel: set() for kernel in aot.KERNELS}
    for r in results:
        meta, dtype = r["meta"], r["case"].split("-")[1]
        if r["kernel"] == "pool":
            seen["pool"].add((dtype, meta["BLOCK_D"], meta["HAS_MASK"]))
            continue
        if r["kernel"] == "tile_table":  # the case name's second field: s1 or s3
            seen["tile_table"].add((dtype == "s1", meta["HAS_MASK"]))
            continue
        if r["kernel"] == "select":  # no float inputs: the second field is k
            seen["select"].add((meta["CAP"], meta["ROWS"], meta["num_warps"]))
            continue
        if r["kernel"] in ("groupmax", "filter", "bisect"):
            seen[r["kernel"]].add((dtype, meta["BLOCK_D"]))
        assert meta["IEEE"] == (dtype == "float32") and meta["UPCAST"] is False
        if r["kernel"] == "attention":
            seen["attention"].add((dtype, meta["SINGLE_SLOT"], meta["HAS_MASK"],
                                   meta["BLOCK_D"]))
            assert meta["num_stages"] == (2 if (dtype, meta["BLOCK_D"]) == ("float32", 128)
                                          else 3)
        elif r["kernel"] in ("groupmax", "filter", "bisect"):
            pass
        elif r["kernel"] == "landmark_topk":
            seen["landmark_topk"].add((dtype, meta["BLOCK_D"], meta["K_PAD"]))
            assert meta["num_warps"] == (8 if meta["K_PAD"] >= 256 else 4)
        else:
            seen["route_shared"].add((dtype, meta["BLOCK_D"]))
            assert meta["num_stages"] == (2 if (dtype, meta["BLOCK_D"]) == ("float32", 128)
                                          else 3)
    assert {k: len(v) for k, v in seen.items()} == {"attention": 48, "landmark_topk": 24,
                                                     "route_shared": 12, "pool": 12,
                                                     "tile_table": 4, "groupmax": 6,
                                                     "filter": 6, "select": 6, "bisect": 6}
    assert seen["select"] == {(128, 16, 4), (256, 8, 4), (512, 4, 4), (1024, 2, 4),
                              (2048, 1, 8), (4096, 1, 8)}
    assert {k[3] for k in seen["attention"]} == {16, 32, 64, 128}
    assert {k[2] for k in seen["landmark_topk"]} == {64, 128, 256, 512}


BAD_KERNEL = textwrap.dedent('''
    import torch, triton, triton.language as tl
    from mita.kernels.aot import compile_launch

    START = -1.0e30  # a plain global: the interpreter reads it, the GPU compiler refuses it

    @triton.jit
    def bad(X, n, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        tl.store(X + offs, tl.full([BLOCK], START, tl.float32), mask=offs < n)

    x = torch.zeros(16)
    try:
        compile_launch(bad, (x, 16), {"BLOCK": 16}, 90)
    except Exception as e:
        print("REFUSED", type(e).__name__, "START" in str(e))
    else:
        print("COMPILED")
''')


def test_compile_check_catches_a_plain_global(tmp_path):
    """The class of bug this file exists for: the same check fails on a kernel that reads a
    plain module global (as the fused kernel's _NEG_INIT did), which the interpreter runs."""
    script = tmp_path / "bad_kernel.py"
    script.write_text(BAD_KERNEL)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(sys.path)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          env=env, timeout=120)
    assert "REFUSED CompilationError True" in done.stdout, done.stdout + done.stderr[-2000:]
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          env=env | {"TRITON_INTERPRET": "1"}, timeout=120)
    # Under the interpreter the kernel is not compilable at all: compile_launch says so.
    assert "REFUSED RuntimeError False" in done.stdout, done.stdout + done.stderr[-2000:]
