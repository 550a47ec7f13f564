"""Every number the profiler's sweep shows a user, pinned on hand-made inputs: its settings,
speed-ups, table and files.

Expected values are worked out by hand (in the comments) or by an independent formula. Inputs
are binary fractions wherever a value is printed or compared exactly, so float equality is
exact; the one tolerance is named where it is used.
"""

from __future__ import annotations

import csv
import json

import matplotlib.image
import pytest
import torch

from profiler import sweep

# Float sums whose order differs from the hand formula's: only the last bits may differ.
REL = 1e-12


# --- sweep: settings, speed-ups, table, files --------------------------------------------------


def test_landmarks_for_each_setting_form():
    # fig5: m = k = the power of two nearest √(N/4): N = 1 → √0.25 = 0.5 → at least 1;
    # 64 → 4; 255 → √63.75 = 7.98 → 8; 3000 → √750 = 27.4 → 32 (log2 4.78); 2^20 → 512.
    for n, side in ((1, 1), (64, 4), (255, 8), (3000, 32), (1 << 20, 512)):
        assert sweep.landmarks_for(n, "fig5") == (side, side)
    assert sweep.landmarks_for(10, "32x128") == (32, 128)  # fixed: whatever N
    assert sweep.landmarks_for(10, "16X4") == (16, 4)
    assert sweep.landmarks_for(10, "1x1") == (1, 1)
    for bad, why in (("0x4", "'num_landmarks' must be an int ≥ 1, got 0"),
                     ("4x0", "'topk' must be an int ≥ 1, got 0")):
        with pytest.raises(ValueError) as e:
            sweep.landmarks_for(10, bad)
        assert str(e.value) == f"setting {bad!r}: {why}"
    for bad in ("lots", "4x4x4", "4x", "Fig5", "-2x4"):  # s comes from --route-topk
        with pytest.raises(ValueError) as e:
            sweep.landmarks_for(10, bad)
        assert str(e.value) == f"setting {bad!r} is not 'fig5' or MxK (e.g. 32x128)"


MITA_STAGES_MS = {"embed": 0.5, "qkv_proj": 1.0, "pool": 0.25, "landmark_scores": 0.5,
                  "topk": 0.25, "shared_compress": 0.5, "route": 0.5, "gather": 0.25,
                  "attention": 1.75, "ffn": 2.0}  # attention proper: 4.0 ms


def sweep_row(n, variant, setting, m, k, s, status="ok", **ok):
    row = {"n": n, "variant": variant, "setting": setting, "m": m, "k": k, "s": s, "batch": 1,
           "depth": 1, "dim": 16, "heads": 2, "dtype": "float32", "device": "cpu",
           "flops": 1000 * n + m, "stage_flops": {}, "mita_backend": "-", "status": status}
    return row | ok


def sweep_rows():
    """N = 256: dense and two MiTA settings, all ok; N = 1024: dense skipped (so no ratio for
    MiTA there); N = 512: MiTA skipped."""
    skip = "skipped: predicted 99 s for warm-up + one forward exceeds the 60 s budget"
    return [
        sweep_row(256, "dense", "-", 0, 0, 0, e2e_ms=12.0, gflops_per_s=0.42,
                  stages_ms={"embed": 0.5, "attention": 8.0, "ffn": 3.5},
                  peak_memory_bytes=5 * 2**20 + 1, peak_memory_kind="cuda_max_allocated"),
        sweep_row(256, "mita", "fig5", 8, 8, 1, e2e_ms=8.0, gflops_per_s=1.375,
                  stages_ms=MITA_STAGES_MS, peak_memory_bytes=3 * 2**20,
                  peak_memory_kind="cuda_max_allocated"),
        # k = 512 > N: clamped to 256 in the pair count.
        sweep_row(256, "mita", "4x512", 4, 512, 2, e2e_ms=24.0, gflops_per_s=0.5,
                  stages_ms={"attention": 16.0, "ffn": 8.0}, peak_memory_bytes=2**21,
                  peak_memory_kind="analytic_activation_estimate"),
        sweep_row(512, "mita", "fig5", 8, 8, 1, status=skip),
        sweep_row(1024, "dense", "-", 0, 0, 0, status=skip),
        sweep_row(1024, "mita", "fig5", 16, 16, 1, e2e_ms=9.0, gflops_per_s=2.0,
                  stages_ms={"attention": 4.0}, peak_memory_bytes=2**20,
                  peak_memory_kind="cuda_max_allocated"),
    ]


def test_attention_ms_sums_only_the_attention_stages():
    assert sweep.attention_ms({"stages_ms": MITA_STAGES_MS}) == 4.0  # not embed, qkv, ffn
    assert sweep.attention_ms({"stages_ms": {"attention": 8.0, "ffn": 3.5}}) == 8.0
    assert sweep.attention_ms({"stages_ms": {"ffn": 3.5}}) == 0.0


def test_sweep_speedups_on_hand_made_rows():
    # fig5: 12/8 = 1.5 forward, 8/4 = 2 attention, 256/(2·8 + 1·8) = 32/3 pairs.
    # 4x512: 12/24 = 0.5, 8/16 = 0.5, 256/(2·4 + 2·256) = 256/520 = 32/65.
    got = sweep.speedups(sweep_rows())
    assert got == [
        {"n": 256, "setting": "fig5", "m": 8, "k": 8, "s": 1, "e2e_speedup": 1.5,
         "attention_speedup": 2.0, "flop_limit": pytest.approx(32 / 3, rel=REL)},
        {"n": 256, "setting": "4x512", "m": 4, "k": 512, "s": 2, "e2e_speedup": 0.5,
         "attention_speedup": 0.5, "flop_limit": pytest.approx(32 / 65, rel=REL)}]


SWEEP_MARKDOWN = (
    "| N | variant | m | k | s | forward ms | attention ms | GFLOP/s | peak bytes (kind) | status "
    "|\n"
    "|---|---|---|---|---|---|---|---|---|---|\n"
    "| 256 | dense | 0 | 0 | 0 | 12.0 | 8.0 | 0.4 | 5 MiB (cuda_max_allocated) | ok |\n"
    "| 256 | mita | 8 | 8 | 1 | 8.0 | 4.0 | 1.4 | 3 MiB (cuda_max_allocated) | ok |\n"
    "| 256 | mita | 4 | 512 | 2 | 24.0 | 16.0 | 0.5 | 2 MiB (analytic_activation_estimate) | ok "
    "|\n"
    "| 512 | mita | 8 | 8 | 1 | - | - | - | - | skipped: predicted 99 s for warm-up + one forward "
    "exceeds the 60 s budget |\n"
    "| 1024 | dense | 0 | 0 | 0 | - | - | - | - | skipped: predicted 99 s for warm-up + one "
    "forward exceeds the 60 s budget |\n"
    "| 1024 | mita | 16 | 16 | 1 | 9.0 | 4.0 | 2.0 | 1 MiB (cuda_max_allocated) | ok |\n"
    "\n"
    "| N | setting | m | k | s | MiTA/dense forward speed-up | attention speed-up | FLOP limit "
    "N/(2m+sk) |\n"
    "|---|---|---|---|---|---|---|---|\n"
    "| 256 | fig5 | 8 | 8 | 1 | 1.50× | 2.00× | 10.7× |\n"
    "| 256 | 4x512 | 4 | 512 | 2 | 0.50× | 0.50× | 0.5× |\n")


def test_sweep_markdown_whole_text():
    assert sweep.markdown(sweep_rows()) == SWEEP_MARKDOWN
    only_dense = sweep_rows()[:1]  # no MiTA row: no speed-up table at all
    assert sweep.markdown(only_dense) == "".join(SWEEP_MARKDOWN.splitlines(True)[:3])


def test_sweep_files_hold_the_rows_numbers(tmp_path):
    cfg = sweep.SweepConfig(ns=[256], variants=["mita", "dense"], settings=["fig5"], depth=1,
                            dim=16, num_heads=2, ffn_dim=32)
    rows = sweep_rows()
    files = sweep.write_outputs(rows, cfg, tmp_path / "new" / "sweep")  # parents made too
    out = tmp_path / "new" / "sweep"
    assert files == {"json": out / "sweep.json", "csv": out / "sweep.csv",
                     "md": out / "sweep.md", "png0": out / "stages.png",
                     "png1": out / "speedup.png", "png2": out / "time_vs_flops.png"}
    assert files["json"].read_text().startswith('{\n  "config": {\n    "ns": [\n      256\n')
    assert files["json"].read_text().endswith("\n}\n")
    assert files["md"].read_text() == (
        f"Sweep: depth 1, dim 16, heads 2, batch 1, s 1, float32, cpu, warm-up 1, median of 3, "
        f"torch {torch.__version__}\n\n" + SWEEP_MARKDOWN)
    data = json.loads(files["json"].read_text())
    assert data["config"] == {"ns": [256], "variants": ["mita", "dense"], "settings": ["fig5"],
                              "depth": 1, "dim": 16, "num_heads": 2, "ffn_dim": 32,
                              "route_topk": 1, "batch": 1, "device": "cpu", "dtype": "float32",
                              "warmup": 1, "repeats": 3, "budget_s": 60.0, "seed": 0,
                              "mita_backend": "auto"}
    assert data["rows"] == rows
    assert [(x["setting"], x["e2e_speedup"], x["attention_speedup"]) for x in data["speedups"]
            ] == [("fig5", 1.5, 2.0), ("4x512", 0.5, 0.5)]
    with open(files["csv"], newline="") as f:
        table = list(csv.reader(f))
    stages = ["embed", "qkv_proj", "pool", "landmark_scores", "topk", "shared_compress",
              "route", "gather", "attention", "ffn"]  # the forward's order
    assert table[0] == ["n", "variant", "setting", "m", "k", "s", "batch", "depth", "dim",
                        "heads", "dtype", "device", "status", "e2e_ms", "flops",
                        "gflops_per_s", "peak_memory_bytes", "peak_memory_kind",
                        *(f"{s}_ms" for s in stages)]
    fixed = ["1", "1", "16", "2", "float32", "cpu"]
    assert table[1] == ["256", "dense", "-", "0", "0", "0", *fixed, "ok", "12.0", "256000",
                        "0.42", str(5 * 2**20 + 1), "cuda_max_allocated",
                        "0.5", "", "", "", "", "", "", "", "8.0", "3.5"]
    assert table[2][13:18] == ["8.0", "256008", "1.375", str(3 * 2**20), "cuda_max_allocated"]
    assert table[2][18:] == [str(MITA_STAGES_MS[s]) for s in stages]
    assert table[4] == ["512", "mita", "fig5", "8", "8", "1", *fixed,
                        "skipped: predicted 99 s for warm-up + one forward exceeds the 60 s "
                        "budget", "", "512008", "", "", "", *[""] * len(stages)]
    assert len(table) == 1 + len(rows)
    for key in ("png0", "png1", "png2"):
        img = matplotlib.image.imread(files[key])
        assert img.shape[0] > 100 and img.shape[1] > 100
