"""Every Triton kernel compiles ahead of time for NVIDIA sm_80 and sm_90 on this CPU machine.

The interpreter tests (``test_kernels.py``) check numerics; they do not compile. A kernel that
reads a plain module global passed every interpreter test and failed on the first GPU call
(``NameError: Cannot access global variable _NEG_INIT``). ``mita.kernels.aot`` compiles the
kernel through Triton's launch-time specialisation with the launcher's own arguments, for every
specialisation the launcher can choose, to a cubin, and checks its shared memory fits the
target; ptxas (``-v``) and cuobjdump give its registers, spills, stack and blocks per SM, and
no specialisation may spill.

All 440 compiles take 15-40 min on 2 cores, so their records are committed
(``mita/kernels/compiled.json``, ``make kernels-table``) under a key of what they are compiled
from (``mita.kernels.aot_table``). Here: the key must be today's (else one line: run ``make
kernels-table``), a seeded sample of 16 rows is compiled again and must equal its committed
rows (the rows of ``aot_table.SLOW_COMPILES``, minutes of ptxas each, are left to ``make
kernels-table``: one drawn would take a third of the suite's time), and every committed row
is checked as a fresh compile was.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from mita.kernels import aot, aot_table

# The compiles run in spawned processes without TRITON_INTERPRET: this process runs Triton
# interpreted (tests/conftest.py), for the numerics tests in test_kernels.py.
# heavy(0): the commit's seed draws its 16 rows; a draw with the largest kernels took 362 s
# of a clean-clone run, and started last it ended the run
pytestmark = [pytest.mark.slow, pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                                    reason="Triton is not installed"),
              pytest.mark.heavy(0)]
ROOT = Path(__file__).resolve().parents[2]
# Jobs compiled per run: each commit draws other rows (sample_seed), so the table is covered
# over commits; 8 keep this test near a minute on 2 cores.
SAMPLE = 8


@pytest.fixture(scope="module")
def results():
    """The committed records of every specialisation × sm_80 / sm_90 (``aot.check`` records),
    once their key is checked: a kernel change without ``make kernels-table`` fails here, in
    one line."""
    try:
        return aot_table.read()["records"]
    except RuntimeError as e:
        pytest.fail(str(e), pytrace=False)


def sample_seed() -> int:
    """The sample's seed: ``MITA_KERNEL_SAMPLE_SEED`` if set, else the checkout's commit (so
    each commit draws other rows), else the table's key."""
    if "MITA_KERNEL_SAMPLE_SEED" in os.environ:
        return int(os.environ["MITA_KERNEL_SAMPLE_SEED"])
    done = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                          text=True)
    return int(done.stdout.strip() if done.returncode == 0 else aot_table.compile_key(), 16)


def test_a_seeded_sample_compiles_to_its_committed_rows(results):
    """``SAMPLE`` of the (case, target) jobs, drawn by the commit's seed, compiled now as
    ``make kernels-table`` compiled them: each record equals its committed row in every field
    (registers, spills, stack, shared memory, blocks, limiter, meta) but the cubin's size,
    which carries the checkout's path."""
    seed = sample_seed()
    jobs = aot_table.sample(seed, SAMPLE, skip=aot_table.SLOW_COMPILES)
    assert len({(str(c), cap) for c, cap in jobs}) == SAMPLE
    committed = {(r["case"], r["sm"]): r for r in results}
    fresh = aot.check_all(only=jobs)
    assert len(fresh) == SAMPLE
    differ = [f"sm_{r['sm']} {r['case']}: now {aot_table.comparable(r)}, committed "
              f"{aot_table.comparable(committed[r['case'], r['sm']])}"
              for r in fresh
              if aot_table.comparable(r) != aot_table.comparable(committed[r["case"], r["sm"]])]
    assert not differ, f"seed {seed} (MITA_KERNEL_SAMPLE_SEED):\n" + "\n".join(differ)
    assert all(r["cubin_bytes"] > 1000 for r in fresh)


def test_sample_is_drawn_by_its_seed():
    first, again = aot_table.sample(7), aot_table.sample(7)
    assert [(str(c), cap) for c, cap in first] == [(str(c), cap) for c, cap in again]
    assert len({(str(c), cap) for c, cap in first}) == 16
    seen = {(str(c), cap) for seed in range(400) for c, cap in aot_table.sample(seed)}
    assert len(seen) == 440  # every row is drawn over 400 seeds
    skip = aot_table.SLOW_COMPILES
    seen = {(str(c), cap) for seed in range(400)
            for c, cap in aot_table.sample(seed, skip=skip)}
    assert len(seen) == 440 - 2 * len(skip) and not {c for c, _ in seen} & set(skip)


def test_the_key_follows_the_code_not_its_comments(tmp_path):
    """The table's key changes with a kernel's code and not with a comment or docstring."""
    src = Path(aot.__file__).parent
    for name in aot_table.COMPILE_SOURCES:
        shutil.copy(src / name, tmp_path / name)
    key = aot_table.compile_key(tmp_path)
    assert key == aot_table.compile_key(src) and len(key) == 16
    routing = tmp_path / "routing.py"
    text = routing.read_text()
    routing.write_text(text.replace('"""', '"""Reworded. ', 1) + "\n# a comment\n")
    assert aot_table.compile_key(tmp_path) == key
    # the bitonic top-k's 16-landmark tiles → 32: a change of what compiles
    assert "\nBLOCK_L = 16 " in text
    routing.write_text(text.replace("\nBLOCK_L = 16 ", "\nBLOCK_L = 32 "))
    assert aot_table.compile_key(tmp_path) != key


def test_every_kernel_compiles_for_sm80_and_sm90(results):
    """All 220 specialisations × 2 targets compiled to a cubin whose shared memory fits. The cases
    reach every constexpr set the launchers can pick: for the attention kernel each (dtype,
    SINGLE_SLOT, HAS_MASK, BLOCK_D), 3 × 2 × 2 × 4, with float32 tiles of 16 entries × 32 keys
    (16 keys at BLOCK_D 16 and 128), 4 warps (8 at BLOCK_D 128), 2 stages, and 16-bit tiles 128
    × 64 (s = 1; 128 × 32 at BLOCK_D 128) or 64 × 64 (s > 1), 8 warps, 3 stages; for
    landmark_topk each (dtype, BLOCK_D ∈ {64, 128}, K_PAD ∈ {64 … 512}), 3 × 2 × 4; for
    route_shared each (dtype, BLOCK_D), 3 × 4, float32 16 × 32 with 2 stages, 16-bit 64 × 64
    with 3; for the pool each (dtype, BLOCK_D ∈ {64, 128}, HAS_MASK), 3 × 2 × 2; for the tile
    table's count and scatter each (s = 1 or not, HAS_MASK), 2 × 2, and its scan per attention
    tile (BLOCK_M 16, 64, 128); for the threshold select's group max, filter and bisection
    fallback each (dtype, BLOCK_D ∈ {64, 128}), 3 × 2 each (the fallback's tiles and warps by
    dtype and BLOCK_D), its θ kernel, and for its select each (CAP, ROWS) from (128, 8) to
    (4096, 1), with 8 warps at CAP 4096; for the backward (``triton_backward._blocks``) each
    (dtype, BLOCK_D) of the shared dq and dk/dv kernels, 3 × 4 each, of the routed dq (s = 1; s
    > 1 ordered or atomic), 3 × 4 × 3, of the routed dk/dv (ordered, atomic), 3 × 4 × 2, and the
    per-key sum per BLOCK_D, 4. (The committed records;
    ``test_a_seeded_sample_compiles_to_its_committed_rows`` compiles a sample again.)"""
    assert len(results) == 440
    failed = [f"sm_{r['sm']} {r['case']}: {r['error']}" for r in results if not r["ok"]]
    assert not failed, "\n".join(failed)
    assert all(r["cubin_bytes"] > 1000 for r in results)
    assert max(r["shared_bytes"] for r in results if r["sm"] == 80) <= 163 * 1024
    seen = {kernel: set() for kernel in aot.KERNELS}
    for r in results:
        meta, dtype = r["meta"], (r["case"].split("-") + ["int"])[1]  # theta: no dtype
        f32 = dtype == "float32"
        assert r["num_warps"] == meta.get("num_warps", 4)  # Triton's default: 4
        if r["kernel"] == "pool":
            seen["pool"].add((dtype, meta["BLOCK_D"], meta["HAS_MASK"]))
            continue
        if r["kernel"] in ("tile_count", "tile_scatter"):  # the name's second field: s1, s3
            seen[r["kernel"]].add((dtype == "s1", meta["HAS_MASK"], meta["BLOCK"]))
            continue
        if r["kernel"] == "tile_scan":  # BLOCK_M: the attention tile it is planned with
            seen["tile_scan"].add(meta["BLOCK_M"])
            continue
        if r["kernel"] == "select":  # no float inputs: the second field is k
            seen["select"].add((meta["CAP"], meta["ROWS"], meta["num_warps"]))
            continue
        if r["kernel"] == "theta":
            seen["theta"].add(meta["BLOCK_G"])
            continue
        if r["kernel"] == "key_sum":  # fp32 buffers: no input dtype
            seen["key_sum"].add(meta["BLOCK_D"])
            assert meta["BLOCK_K"] * meta["BLOCK_D"] == 2048, r["case"]
            continue
        if r["kernel"] in aot.BACKWARD_LAUNCH:
            assert meta["IEEE"] == f32 and meta["UPCAST"] is False
            seen[r["kernel"]].add((dtype, meta["BLOCK_D"], meta.get("SINGLE_SLOT"),
                                   meta.get("DETERMINISTIC")))
            kind = "dkv" if r["kernel"].endswith("dkv") else r["kernel"]
            want = {("dkv", True): (16, 16, 4, 1), ("shared_dq", True): (16, 32, 8, 1),
                    ("routed_dq", True): (16, 32, 8, 1), ("dkv", False): (64, 32, 4, 1),
                    ("shared_dq", False): (64, 64, 4, 2),
                    ("routed_dq", False): (16, 32, 4, 2)}[kind, f32]
            if meta["BLOCK_D"] > (32 if f32 and kind != "dkv" else 64) and kind != "dkv":
                want = (want[0], 16 if f32 else 32, *want[2:])
            assert (meta["BLOCK_M"], meta["BLOCK_N"], meta["num_warps"],
                    meta["num_stages"]) == want, r["case"]
            continue
        assert meta["IEEE"] == f32 and meta["UPCAST"] is False
        if r["kernel"] in ("groupmax", "filter"):
            assert meta["PHASE"] == ("groupmax", "filter").index(r["kernel"])
        if r["kernel"] in ("groupmax", "filter", "bisect"):
            seen[r["kernel"]].add((dtype, meta["BLOCK_D"]))
            if r["kernel"] == "bisect":  # the tiles that do not spill (bisect.BISECT_TILES)
                block_n, warps = {(False, 64): (64, 8), (False, 128): (32, 4),
                                  (True, 64): (32, 4), (True, 128): (32, 4)}[
                    f32, meta["BLOCK_D"]]
                want = (16, block_n)
                assert r["num_warps"] == warps, r["case"]
            else:  # float32: 16 × 16 tiles, IEEE FMA dots in registers
                want = (16, 16) if f32 else (64, 32)
            assert (meta["BLOCK_L"], meta["BLOCK_N"]) == want, r["case"]
        elif r["kernel"] == "attention":
            seen["attention"].add((dtype, meta["SINGLE_SLOT"], meta["HAS_MASK"],
                                   meta["BLOCK_D"]))
            wide = meta["BLOCK_D"] > 64
            want = ((16, 32 if 16 < meta["BLOCK_D"] <= 64 else 16, 8 if wide else 4, 2) if f32
                    else (128 if meta["SINGLE_SLOT"] else 64,
                          32 if meta["SINGLE_SLOT"] and wide else 64, 8, 3))
            assert (meta["BLOCK_M"], meta["BLOCK_N"], meta["num_warps"],
                    meta["num_stages"]) == want, r["case"]
        elif r["kernel"] == "landmark_topk":
            seen["landmark_topk"].add((dtype, meta["BLOCK_D"], meta["K_PAD"]))
            assert meta["K_PAD"] % meta["BLOCK_N"] == 0 and meta["BLOCK_L"] == 16
        else:
            seen["route_shared"].add((dtype, meta["BLOCK_D"]))
            assert (meta["BLOCK_M"], meta["BLOCK_N"], meta["num_stages"]) == (
                (16, 32, 2) if f32 else (64, 64, 3)), r["case"]
    assert {k: len(v) for k, v in seen.items()} == {"attention": 48, "landmark_topk": 24,
                                                     "route_shared": 12, "pool": 12,
                                                     "tile_count": 4, "tile_scan": 3,
                                                     "tile_scatter": 4, "groupmax": 6,
                                                     "theta": 1, "filter": 6,
                                                     "select": 6, "bisect": 6,
                                                     "shared_dq": 12, "shared_dkv": 12,
                                                     "routed_dq": 36, "routed_dkv": 24,
                                                     "key_sum": 4}
    assert seen["select"] == {(128, 8, 4), (256, 4, 4), (512, 2, 4), (1024, 1, 4),
                              (2048, 1, 4), (4096, 1, 8)}
    assert {k[3] for k in seen["attention"]} == {16, 32, 64, 128}
    assert seen["tile_scan"] == {16, 64, 128}
    assert {k[2] for k in seen["landmark_topk"]} == {64, 128, 256, 512}


def _inputs(r) -> str:
    """A record's input dtype; ``"int"`` for the kernels with integer inputs only; float32 for
    the backward's per-key sum (it reads float32 buffers whatever the model's dtype)."""
    if r["kernel"] == "key_sum":
        return "float32"
    return ("int" if r["kernel"] in ("tile_count", "tile_scan", "tile_scatter", "select", "theta")
            else r["case"].split("-")[1])


@pytest.mark.parametrize("dtypes,records", [(("float16", "bfloat16"), 264), (("float32",), 140),
                                            (("int",), 36)])
def test_no_specialisation_spills_registers(results, dtypes, records):
    """No case of ``aot.cases()`` — every specialisation the service can pick — spills
    registers to local memory on sm_80 or sm_90 (ptxas's spill store and spill load bytes
    are 0): 66 cases per float dtype (attention 16, bitonic top-k 8, route 4, pool 4, the
    threshold select's group max, filter and fallback 2 each, the backward's shared dq and
    dk/dv 4 each, routed dq 12 and dk/dv 8), the backward's per-key sum 4 (float32 buffers),
    and 18 with integer inputs only (tile table 11, select 6, θ 1), × 2 targets. float32
    too: its IEEE products are FMA loops over registers, and the 64 × 64 tiles it had spilled
    13-88 KB per thread."""
    mine = [r for r in results if _inputs(r) in dtypes]
    assert len(mine) == records
    spilled = [f"sm_{r['sm']} {r['case']}: {r['registers']} registers, "
               f"{r['spill_store_bytes']} B spill stores, {r['spill_load_bytes']} B spill loads"
               for r in mine if r["spill_store_bytes"] or r["spill_load_bytes"]]
    assert not spilled, "\n".join(spilled)


def test_resources_within_the_sm_limits(results):
    """Each record's numbers against the hardware limits, checked from the record alone (not
    through ``resident_blocks``): blocks_per_sm resident blocks fit the SM's 64 warps, 65,536
    registers (32 threads × registers per warp, in units of 256) and shared memory (per block
    + 1 KiB reserved, in units of 128 B, of 164 / 228 KiB); one more block would not fit one
    of them (or 32)."""
    sm_shared = {80: 164 * 1024, 90: 228 * 1024}
    for r in results:
        regs_per_warp = -(-r["registers"] * 32 // 256) * 256
        assert 1 <= r["registers"] <= 255 and r["local_bytes"] == 0, r["case"]
        if r["spill_store_bytes"]:
            assert r["stack_bytes"] > 0, r["case"]  # spilled values live in the stack frame

        def fits(blocks, r=r, regs_per_warp=regs_per_warp):
            return (blocks * r["num_warps"] <= 64 and blocks <= 32
                    # registers go to 4 sub-partitions of 16,384, whole warps each
                    and blocks * r["num_warps"] <= 4 * (16384 // regs_per_warp)
                    and blocks * -(-(r["shared_bytes"] + 1024) // 128) * 128
                    <= sm_shared[r["sm"]])

        assert r["blocks_per_sm"] >= 1 and fits(r["blocks_per_sm"]), r
        assert not fits(r["blocks_per_sm"] + 1), r


@pytest.mark.parametrize("registers,shared,warps,sm,want", [
    # 32 regs: 1,024 per warp, 16 warps per sub-partition; 114,944 + 1,024 B of 164 KiB: 1
    (32, 114944, 4, 80, (1, "shared")),
    # 255 regs: 8,160 → 8,192 per warp, 2 warps per sub-partition, 8 warps: 2 blocks of 4
    (255, 0, 4, 80, (2, "registers")),
    # 168 regs: 5,376 per warp (a multiple of 256), 3 per sub-partition: 12 warps, 3 blocks
    (168, 20000, 4, 90, (3, "registers")),
    # 128 regs, 8 warps: 4 warps per sub-partition, 16 warps: 2 blocks
    (128, 40960, 8, 90, (2, "registers")),
    # 16 regs, 16 warps: registers allow 8 blocks, warps 64 / 16 = 4
    (16, 0, 16, 80, (4, "warps")),
    # 1 warp, 16 regs, 2 KiB: 32 blocks at most (shared would allow 164 KiB / 3 KiB = 54)
    (16, 2048, 1, 80, (32, "blocks")),
    # 200 KiB: over sm_80's 163 KiB per block, one block on sm_90 (201 KiB of 228)
    (64, 200 * 1024, 4, 80, (0, "shared")),
    (64, 200 * 1024, 4, 90, (1, "shared")),
])
def test_resident_blocks_by_the_occupancy_rules(registers, shared, warps, sm, want):
    assert aot.resident_blocks(registers, shared, warps, sm) == want


def test_table_has_one_row_per_result(results):
    lines = aot.table(results).splitlines()
    assert lines[0].startswith("| case | sm | tiles | num_warps |") and len(lines) == 2 + 440
    assert all(line.count("|") == len(aot.COLUMNS) + 1 and "FAILED" not in line
               for line in lines[2:])


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


def sm90_sass(case) -> str:
    """cuobjdump's SASS of ``case`` compiled for sm_90 from its example plan (in a process
    without the interpreter)."""
    from triton import knobs

    done = subprocess.run([sys.executable, "-c", textwrap.dedent(f"""
        import sys
        from mita.kernels import aot
        case = next(c for c in aot.cases() if str(c) == {str(case)!r})
        fn, args, meta = aot.example_plan(case)
        sys.stdout.buffer.write(aot.compile_launch(fn, args, meta, 90).asm["cubin"])
        """)], cwd=ROOT, capture_output=True, env={k: v for k, v in os.environ.items()
                                                    if k != "TRITON_INTERPRET"})
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    cubin = ROOT / f".pytest-{case}.cubin"
    try:
        cubin.write_bytes(done.stdout)
        return subprocess.run([knobs.nvidia.cuobjdump.path, "--dump-sass", str(cubin)],
                              capture_output=True, text=True, check=True).stdout
    finally:
        cubin.unlink(missing_ok=True)


def test_tile_table_spreads_over_n_with_relaxed_atomics():
    """The tile table is a counting sort split across N (issue: one program per (b, h) ran
    serially over N·s with fenced atomics): at N = 64K, s = 1, B·H = 2 the count and scatter
    grids have 512 programs (≥ 132, the SMs of an H100 / H200), the scan one per (b, h) over
    the m experts only; the count's sm_90 SASS has its atomic and no GPU-scope fence or L1
    invalidation around it."""
    from mita.kernels.tile_table import TILE_KERNELS, tile_table_plan

    experts = torch.zeros(1, 2, 65536, 1, dtype=torch.int64)
    launches, _ = tile_table_plan(experts, None, 128)
    assert [launch[0] for launch in launches] == list(TILE_KERNELS)
    grids = [launch[1] for launch in launches]
    assert grids == [(256, 2), (2,), (256, 2)]
    assert grids[0][0] * grids[0][1] >= 132
    sass = sm90_sass(next(c for c in aot.cases() if str(c) == "tile_count-s1-mask"))
    assert sass.count("ATOMG.E.ADD") >= 1
    assert "MEMBAR" not in sass and "CCTL.IVALL" not in sass


def test_layer_kernels_leave_room_on_an_sm(results):
    """The sm_90 rows of the kernels a long-N layer spends its time in, 16-bit (committed
    records, planned as they run at long N): the filter keeps ≥ 3 blocks (12 warps) per SM —
    at 64 × 64 score tiles it held 218-222 registers and 2 blocks — and the group max ≥ 4;
    the attention kernel runs 8 warps on 128-query tiles for s = 1 (two warpgroups on
    disjoint rows, not one 64-row tile computed twice)."""
    sm90 = {r["case"]: r for r in results if r["sm"] == 90}
    for dtype in ("bfloat16", "float16"):
        for d in (48, 128):
            assert sm90[f"filter-{dtype}-d{d}"]["blocks_per_sm"] >= 3
            assert sm90[f"groupmax-{dtype}-d{d}"]["blocks_per_sm"] >= 4
            for masked in ("mask", "nomask"):
                meta = sm90[f"attention-{dtype}-s1-{masked}-d{d}"]["meta"]
                assert (meta["BLOCK_M"], meta["num_warps"]) == (128, 8)


def test_filter_atomics_are_relaxed_and_the_filter_runs_its_tile_loop():
    """The filter appends with relaxed per-key atomics: its sm_90 SASS (cuobjdump of the cubin
    compiled from the plan that runs at long N, 32 tiles per chunk) has atomics but no
    GPU-scope fence (``MEMBAR.*.GPU``) and no L1 invalidation (``CCTL.IVALL``) — the default
    ``acq_rel`` atomic put both around every atomic of the old per-tile append. The plan keeps
    its tile loop (``TILES_PER_CHUNK`` a runtime value, not the 1 Triton folds away)."""
    case = next(c for c in aot.cases() if c.kernel == "filter" and c.dtype == "bfloat16")
    fn, args, meta = aot.example_plan(case)
    assert meta["PHASE"] == 1 and args[-4] == 32  # TILES_PER_CHUNK
    sass = sm90_sass(case)
    assert sass.count("ATOMG.E.ADD") >= 16  # one per key a thread holds of the 64 × 32 tile
    assert "MEMBAR.ALL.GPU" not in sass and "MEMBAR.SC.GPU" not in sass
    assert "CCTL.IVALL" not in sass


@pytest.mark.parametrize("argv,code,stream,line", [
    (["--help"], 0, "out", "usage: python -m mita.kernels.aot [-h] [--table]"),
    (["--tabel"], 2, "err", "--tabel: did you mean --table?"),
])
def test_the_command_reads_its_flags_before_it_compiles(monkeypatch, capsys, argv, code, stream,
                                                         line):
    """``python -m mita.kernels.aot --help`` once started all 440 compiles (~10 min on 2
    cores) before answering: its flags are parsed first now."""
    def no_compiles():
        raise AssertionError("compiled before reading the flags")
    monkeypatch.setattr(aot, "check_all", no_compiles)
    with pytest.raises(SystemExit) as exit_:
        aot.main(argv)
    assert exit_.value.code == code
    assert line in getattr(capsys.readouterr(), stream).splitlines()
