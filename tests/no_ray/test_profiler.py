"""Stage timer, analytic cost and the offline sweep (CPU; the CUDA branch shares the code)."""

from __future__ import annotations

import csv
import json
import threading

import matplotlib.image
import pytest
import torch

from mita.cost import model_stage_flops
from mita.hooks import MITA_STAGES
from mita.kernels import cpu
from mita.model import EncoderClassifier, ModelConfig, set_mita_backend
from mita.timer import StageTimer, profile_forward
from profiler.sweep import SweepConfig, landmarks_for, run_sweep, write_outputs
from service.engine import pick_device

from ..helpers import CPU_KERNEL_STAGES

CFG = ModelConfig(dim=32, depth=3, num_heads=2, ffn_dim=64, num_landmarks=8, topk=16)




def expected_records(attention: str, depth: int,
                     backend: str = "torch") -> list[tuple[str, int | None]]:
    attn = ["attention"] if attention == "dense" else (
        list(MITA_STAGES) if backend == "torch" else list(CPU_KERNEL_STAGES))
    per_layer = ["qkv_proj", *attn, "out_proj", "ffn"]
    return ([("embed", None)] + [(s, i) for i in range(depth) for s in per_layer]
            + [("head", None)])


@pytest.mark.parametrize("attention,backend", [("mita", "torch"), ("mita", "cpu"),
                                               ("dense", "torch")])
def test_records_complete_ordered_and_sum_below_end_to_end(attention, backend):
    torch.manual_seed(0)
    model = EncoderClassifier(CFG.replace(attention=attention)).eval()
    set_mita_backend(model, backend)
    if backend == "cpu":
        assert cpu.load() is not None  # loading the built extension is not part of a forward
    ids = torch.randint(1, 16, (2, 2048))
    _, prof = profile_forward(model, ids)
    assert [(r.name, r.layer) for r in prof.records] == expected_records(attention, 3, backend)
    assert len(prof.layers_ms) == 3
    # Stages never overlap, so their sum cannot exceed the forward; the untimed rest (layer
    # norms before attention, residual adds, Python glue) stays well under half of it. On a
    # loaded machine one forward can lose the CPU inside untimed glue: the best of three
    # forwards must cover half (a single preemption cannot fail the test).
    shares = []
    for _ in range(3):
        _, p = profile_forward(model, ids)
        assert sum(p.stages_ms.values()) <= p.total_ms
        shares.append(sum(p.stages_ms.values()) / p.total_ms)
    assert max(shares) >= 0.5, shares
    assert all(r.ms >= 0 for r in prof.records)
    assert prof.flops == model_stage_flops(model.config, 2, 2048)
    assert prof.peak_memory_kind == "analytic_activation_estimate"
    assert prof.peak_memory_bytes > 2 * 2048 * 32 * 4


def test_timer_off_gives_identical_outputs():
    torch.manual_seed(1)
    model = EncoderClassifier(CFG).eval()
    ids = torch.randint(1, 16, (2, 300))
    mask = torch.zeros(2, 300, dtype=torch.bool)
    mask[1, 200:] = True
    with torch.no_grad():
        plain = model(ids, mask)
    profiled, _ = profile_forward(model, ids, mask)
    assert torch.equal(plain, profiled)


def test_concurrent_forwards_keep_separate_records():
    torch.manual_seed(2)
    models = {"mita": EncoderClassifier(CFG).eval(),
              "dense": EncoderClassifier(CFG.replace(attention="dense", depth=2)).eval()}
    set_mita_backend(models["mita"], "torch")
    results: dict[str, list] = {"mita": [], "dense": []}
    barrier = threading.Barrier(2)

    def work(name):
        barrier.wait()
        for _ in range(5):
            results[name].append(profile_forward(models[name], torch.randint(1, 16, (1, 512)))[1])

    threads = [threading.Thread(target=work, args=(n,)) for n in models]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for prof in results["mita"]:
        assert [(r.name, r.layer) for r in prof.records] == expected_records("mita", 3)
    for prof in results["dense"]:
        assert [(r.name, r.layer) for r in prof.records] == expected_records("dense", 2)


def test_layer_context_nests_and_result_needs_forward():
    timer = StageTimer("cpu")
    with pytest.raises(RuntimeError, match="no forward recorded"):
        timer.result()
    with timer.forward():
        with timer.layer(4):
            with timer.stage("ffn"):
                pass
        with timer.stage("head"):
            pass
    prof = timer.result()
    assert [(r.name, r.layer) for r in prof.records] == [("ffn", 4), ("head", None)]
    assert prof.layers_ms == [{"ffn": prof.records[0].ms}]


def test_model_flops_match_hand_count():
    cfg = ModelConfig(dim=64, depth=2, num_heads=2, ffn_dim=128, num_landmarks=4, topk=8,
                      num_classes=10)
    f = model_stage_flops(cfg, batch=3, n=100)
    d = 32
    assert f["qkv_proj"] == 3 * 2 * 2 * 100 * 64 * 192
    assert f["landmark_scores"] == 3 * 2 * 2 * (2 * 100 * 4 * d)
    assert f["attention"] == 3 * 2 * 2 * (2 * 100 * 8 * d + 2 * 100 * (4 + 8) * d)
    dense = model_stage_flops(cfg.replace(attention="dense"), batch=3, n=100)
    assert dense["attention"] == 3 * 2 * 2 * 4 * 100 * 100 * d
    assert "pool" not in dense


def test_landmarks_for_settings():
    assert landmarks_for(16384, "fig5") == (64, 64)  # m·k = N/4
    assert landmarks_for(1 << 20, "fig5") == (512, 512)
    assert landmarks_for(5000, "32x128") == (32, 128)
    with pytest.raises(ValueError, match="is not 'fig5' or MxK"):
        landmarks_for(10, "lots")
    # The one Fig. 5 rule (mita.cost), as the sweep and both benchmark scripts use it:
    # m = k = the power of two nearest √(N/4); at least 1.
    from mita.cost import fig5_setting

    assert [fig5_setting(n)[0] for n in (1, 4, 1024, 4096, 65536, 262144)] == [
        1, 1, 16, 32, 128, 256]
    assert fig5_setting(3000) == (32, 32)  # √750 = 27.4: 32 is nearer than 16 in log2
    with pytest.raises(ValueError, match="≥ 1"):
        fig5_setting(0)


def test_small_sweep_writes_parseable_files(tmp_path):
    cfg = SweepConfig(ns=[128, 512, 1 << 16], variants=["mita", "dense"],
                      settings=["fig5", "4x8"], depth=1, dim=16, num_heads=2, ffn_dim=32,
                      warmup=0, repeats=2, budget_s=5.0)
    rows = run_sweep(cfg)
    # dense at N = 64K is predicted from N = 512 to take far beyond 5 s: skipped, not run.
    dense_1m = next(r for r in rows if r["variant"] == "dense" and r["n"] == 1 << 16)
    assert dense_1m["status"].startswith("skipped: predicted")
    ok = [r for r in rows if r["status"] == "ok"]
    assert {(r["n"], r["variant"]) for r in ok} >= {(128, "mita"), (512, "dense")}
    files = write_outputs(rows, cfg, tmp_path)
    data = json.loads(files["json"].read_text())
    assert len(data["rows"]) == len(rows) == 3 * 3
    assert {x["n"] for x in data["speedups"]} >= {128, 512}
    with open(files["csv"]) as f:
        table = list(csv.DictReader(f))
    assert len(table) == 9 and float(table[0]["e2e_ms"]) > 0
    assert "| N | variant |" in files["md"].read_text()
    for key in ("png0", "png1", "png2"):
        img = matplotlib.image.imread(files[key])
        assert img.shape[0] > 100 and img.shape[1] > 100


def test_pick_device_is_one_check_for_the_service_the_sweep_and_the_advisor():
    assert pick_device("cpu", "the sweep") == torch.device("cpu")
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    with pytest.raises(ValueError, match=rf"device 'cuda:{count}': this machine's torch .* sees "
                                         rf"{count} CUDA device\(s\)"):
        pick_device(f"cuda:{count}", "the advisor")
    with pytest.raises(ValueError, match="device 'meta': the advisor runs on cpu or cuda"):
        pick_device("meta", "the advisor")
    with pytest.raises(ValueError, match=r"device 'gpu' is not a torch device \(auto, cpu, cuda"):
        pick_device("gpu")  # the service: auto is one of its choices
    # the sweep and the advisor record the device they ran on: auto is refused there, as before
    for device in ("gpu", "auto"):
        with pytest.raises(ValueError, match=rf"device '{device}' is not a torch device "
                                             r"\(cpu, cuda, cuda:N\)"):
            pick_device(device, "the sweep", auto=False)
    assert pick_device("auto") == torch.device("cuda" if torch.cuda.is_available() else "cpu")
