"""``service.engine.ClassifierEngine``: the serving code path on CPU, without Ray.

The Serve deployment wraps this class (``test_service.py`` checks that an HTTP answer equals
the engine's answer for the same ids), so what holds here holds for the service.

Tolerances, and why:
- padded batch vs one forward per sequence, float32: 1e-5 absolute on probabilities (a
  padded batch changes BLAS blocking and summation order; measured 3e-7 on these inputs).
- bfloat16 / float16 vs float32 on the shipped checkpoint: 0.03 / 0.004 absolute on
  probabilities. Every weight and activation is rounded to 8 (11) significant bits, unit
  roundoff 2^-9 (2^-12), through two blocks; measured worst on these 40 sequences 6.5e-3 /
  8.1e-4 — the bounds leave ~4-5×. Labels must agree wherever float32's top-two margin exceeds
  twice the bound.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mita.data.listops import ListOpsConfig, encode, generate
from mita.model import load_checkpoint, set_mita_backend
from service.engine import (
    ClassifierEngine,
    length_groups,
    pick_device,
    resolve_checkpoint,
    resolve_dtype,
)

from ..helpers import CHECKPOINT, run_smoke


@pytest.fixture(scope="module")
def batch():
    data = generate(40, seed=5, cfg=ListOpsConfig(min_length=100, max_length=600))
    return [np.array(encode(text), dtype=np.uint8) for text, _ in data]


@pytest.fixture(scope="module")
def engines():
    return {(a, dt): ClassifierEngine(CHECKPOINT, a, "cpu", "torch", dt)
            for a in ("mita", "dense") for dt in ("float32", "bfloat16", "float16")}


def probs(results):
    return np.array([r["probabilities"] for r in results])


@pytest.mark.parametrize("attention", ["mita", "dense"])
def test_engine_equals_plain_model_forward(engines, batch, attention):
    """One forward per sequence (deterministic) is exactly the model's own forward."""
    engine = engines[(attention, "float32")]
    model = load_checkpoint(resolve_checkpoint(CHECKPOINT), attention=attention)
    set_mita_backend(model, "torch")  # as the engines here
    results = engine.run(batch[:5])
    for ids, r in zip(batch[:5], results, strict=True):
        with torch.no_grad():
            logits = model(torch.as_tensor(ids, dtype=torch.long)[None])
        want = torch.softmax(logits.double(), -1)[0]
        assert r["probabilities"] == want.tolist()
        assert r["label"] == int(want.argmax()) and r["n"] == len(ids)
        assert r["variant"] == attention and r["model_id"].startswith("listops-default@")
        assert r["profile"].batch_size == 1 and r["profile"].padded_n == len(ids)
        assert r["profile"].dtype == "float32"


@pytest.mark.parametrize("attention", ["mita", "dense"])
def test_padded_batching_equals_solo(engines, batch, attention):
    engine = engines[(attention, "float32")]
    solo, padded = engine.run(batch), engine.run(batch, deterministic=False)
    assert np.abs(probs(solo) - probs(padded)).max() < 1e-5
    sizes = [r["profile"].batch_size for r in padded]
    groups = length_groups([len(x) for x in batch])
    assert sorted(set(sizes)) == sorted({len(g) for g in groups}) and max(sizes) > 1
    for g in groups:  # every member of a group reports the group's padded length
        assert {padded[i]["profile"].padded_n for i in g} == {max(len(batch[i]) for i in g)}


@pytest.mark.parametrize("attention", ["mita", "dense"])
@pytest.mark.parametrize("dtype,tol", [("bfloat16", 0.03), ("float16", 0.004)])
def test_16bit_serving_close_to_float32(engines, batch, attention, dtype, tol):
    engine = engines[(attention, dtype)]
    assert engine.info["dtype"] == dtype
    assert {p.dtype for p in engine.model.parameters()} == {getattr(torch, dtype)}
    full, half = engines[(attention, "float32")].run(batch), engine.run(batch)
    assert all(r["profile"].dtype == dtype for r in half)
    p, q = probs(full), probs(half)
    err = np.abs(p - q).max()
    assert 0 < err < tol  # > 0: the weights really are 16-bit
    top2 = np.sort(p, 1)[:, -2:]
    clear = (top2[:, 1] - top2[:, 0]) > 2 * tol
    assert clear.sum() >= 10
    assert (p.argmax(1)[clear] == q.argmax(1)[clear]).all()


def test_numpy_and_list_inputs_agree(engines, batch):
    engine = engines[("mita", "float32")]
    as_list = engine.run([x.tolist() for x in batch[:3]])
    as_int32 = engine.run([x.astype(np.int32) for x in batch[:3]])
    assert probs(as_list).tolist() == probs(engine.run(batch[:3])).tolist()
    assert probs(as_int32).tolist() == probs(as_list).tolist()


def test_one_profile_per_forward_shared_by_its_requests(engines, batch):
    """The gateway's recorder counts a forward's FLOPs as flops_total / batch_size per
    request: the requests of one forward carry the same profile with batch_size = their
    number, so the shares add up to each forward's FLOPs exactly once."""
    engine = engines[("dense", "float32")]
    results = engine.run(batch[:6], deterministic=False)
    groups = length_groups([len(x) for x in batch[:6]])
    assert len(groups) < 6  # some forward serves several requests
    for g in groups:
        profile = results[g[0]]["profile"]
        assert all(results[i]["profile"] is profile for i in g)
        assert profile.batch_size == len(g)
        assert profile.padded_n == max(len(batch[i]) for i in g)
        assert profile.total_ms > 0 and profile.stages_ms["attention"] > 0
        assert profile.started_at > 1.7e9  # Unix seconds
    shares = sum(r["profile"].flops_total / r["profile"].batch_size for r in results)
    forwards = sum(results[g[0]]["profile"].flops_total for g in groups)
    assert shares == pytest.approx(forwards, rel=1e-12)
    solo = engine.run(batch[:6])
    assert [r["profile"].batch_size for r in solo] == [1] * 6
    assert len({id(r["profile"]) for r in solo}) == 6


def test_resolve_dtype_and_device():
    assert resolve_dtype("auto", torch.device("cuda")) == torch.bfloat16
    assert resolve_dtype("auto", torch.device("cpu")) == torch.float32
    assert resolve_dtype("float16", torch.device("cpu")) == torch.float16
    with pytest.raises(ValueError, match="dtype must be one of"):
        resolve_dtype("fp8", torch.device("cpu"))
    with pytest.raises(ValueError, match="dtype must be one of"):
        ClassifierEngine(CHECKPOINT, "mita", "cpu", "torch", "half")
    assert pick_device("cpu") == torch.device("cpu")
    assert pick_device("auto") == torch.device("cuda" if torch.cuda.is_available() else "cpu")


def test_engine_info(engines):
    info = engines[("mita", "bfloat16")].info
    assert info["device"] == "cpu" and info["dtype"] == "bfloat16"
    assert info["mita_backend"] == "torch" and info["config"]["attention"] == "mita"
    assert engines[("dense", "float32")].info["mita_backend"] is None


@pytest.mark.slow
def test_gpu_serving_script_smoke(tmp_path):
    """``benchmarks/gpu_serving.py --smoke``: the GPU serving benchmark's own code path (checks,
    request cells, stage table, profiler overhead) on the CPU, so the GPU run is not its first
    run. Its timings mean nothing; its structure and checks must hold."""
    result = run_smoke("gpu_serving", tmp_path)
    assert len(result["checks"]) == 10 and all(c["ok"] for c in result["checks"])
    assert sum("graph replay" in c["check"] for c in result["checks"]) == 2
    cells = [(r["variant"], r["N"], r["batch"], r["mode"]) for r in result["requests"]]
    assert cells == [(v, n, b, mode) for n in (256, 1024) for v in ("mita", "dense")
                     for b, mode in ((1, "per-sequence"), (8, "per-sequence"), (8, "padded"))]
    for r in result["requests"]:
        assert 0 < r["p50_ms"] <= r["p99_ms"] and r["repeats"] >= 1
        assert r["dtype"] == "float32" and r["device"] == "cpu"
        assert (r["m"], r["k"], r["s"]) == ((16, 16, 1) if r["variant"] == "mita"
                                            else (None, None, None))
    mita_stages = next(r["stages_p50_ms"] for r in result["requests"]
                       if r["variant"] == "mita" and r["batch"] == 1)
    assert set(mita_stages) >= {"pool", "landmark_scores", "topk", "route", "attention"}
    assert [(r["variant"], r["N"]) for r in result["profiler_overhead"]] == [("mita", 256),
                                                                           ("dense", 256)]
    table = (tmp_path / "gpu_serving.md").read_text()
    assert "| mita | 1024 | 16 | 16 | 1 | 8 | padded | float32 |" in table


def test_engine_and_gpu_benchmark_import_without_ray():
    """A GPU machine may have no Ray: the engine (and the GPU serving benchmark that drives it)
    must not import it. ``sys.modules["ray"] = None`` makes any ``import ray`` fail."""
    import subprocess
    import sys
    from pathlib import Path

    code = ("import sys; sys.modules['ray'] = None\n"
            "import service.engine, runpy\n"
            "runpy.run_path('benchmarks/gpu_serving.py', run_name='not_main')\n"
            "print('no ray needed')")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, cwd=Path(__file__).resolve().parents[2])
    assert done.stdout.strip() == "no ray needed", done.stderr[-2000:]


def test_staged_profile_on_request_and_sampled(batch):
    """MiTA on the compiled CPU kernels reports fused stages; a forward asked for (staged) or
    sampled (every staged_every-th) runs the PyTorch stages, all seven timed apart, with the
    same answer (the two backends agree to 1e-5, as tests/kernels/test_cpu_kernels.py holds)."""
    from mita.hooks import MITA_STAGES
    from mita.layers import MiTAAttention

    engine = ClassifierEngine(CHECKPOINT, "mita", "cpu", "auto", "float32")
    assert engine.fused()
    fused = engine.run(batch[:4])
    assert [r["profile"].staged for r in fused] == [False] * 4
    assert "topk" not in fused[0]["profile"].stages_ms  # inside landmark_scores there
    asked = engine.run(batch[:4], staged=[False, True, False, False])
    assert [r["profile"].staged for r in asked] == [False, True, False, False]
    assert set(MITA_STAGES) <= set(asked[1]["profile"].stages_ms)
    assert np.abs(probs(asked) - probs(fused)).max() < 1e-5
    assert [r["label"] for r in asked] == [r["label"] for r in fused]
    assert {m.backend for m in engine.model.modules() if isinstance(m, MiTAAttention)} == {
        "auto"}  # restored after the staged forward
    engine.staged_every = 3
    engine._forwards = 0
    sampled = engine.run(batch[:7])
    assert [r["profile"].staged for r in sampled] == [False, False, True, False, False,
                                                          True, False]
    dense = ClassifierEngine(CHECKPOINT, "dense", "cpu", "auto", "float32")
    assert not dense.fused() and all(r["profile"].staged for r in dense.run(batch[:2]))
    torch_stages = ClassifierEngine(CHECKPOINT, "mita", "cpu", "torch", "float32")
    assert all(r["profile"].staged for r in torch_stages.run(batch[:2]))


def test_graph_replays_equal_plain_forwards(batch):
    """``service.graphs.GraphCache`` bookkeeping through the engine, with the CPU stand-in for
    the CUDA capture (``eager_capture``; the real capture runs in benchmarks/gpu_serving.py on
    a GPU): a shape is captured the 2nd time it is seen, replays give the plain forward's
    probabilities exactly, sampled/asked staged forwards are never replayed, and the least
    recently used graph is dropped past max_graphs."""
    from service.graphs import GraphCache, eager_capture

    plain = ClassifierEngine(CHECKPOINT, "mita", "cpu", "auto", "float32")
    engine = ClassifierEngine(CHECKPOINT, "mita", "cpu", "auto", "float32")
    assert engine.graphs is None  # CPU: no CUDA graphs unless set up as here
    engine.graphs = GraphCache(engine.model, capture=eager_capture, max_graphs=2)
    seqs = [batch[0], batch[0], batch[1], batch[0], batch[1], batch[2], batch[0]]
    want = plain.run(seqs)
    got = engine.run(seqs)
    assert probs(got).tolist() == probs(want).tolist()
    assert [r["profile"].cuda_graph for r in got] == [False, True, False, True, True,
                                                          False, True]
    assert all(r["profile"].stages_ms == {} for r in got if r["profile"].cuda_graph)
    assert all(r["profile"].total_ms > 0 for r in got)
    assert [key[1] for key in engine.graphs.graphs] == [len(batch[1]), len(batch[0])]
    staged = engine.run(seqs[:2], staged=[True, True])
    assert [r["profile"].cuda_graph for r in staged] == [False, False]
    assert all(r["profile"].staged and "topk" in r["profile"].stages_ms for r in staged)
    # the PyTorch stages vs the CPU kernels: float32, other summation order (1e-5, as above)
    assert np.abs(probs(staged) - probs(want[:2])).max() < 1e-5
    # padded batches: one graph per (batch, N, masked)
    padded = engine.run(batch[:6], deterministic=False)
    again = engine.run(batch[:6], deterministic=False)
    assert np.abs(probs(padded) - probs(again)).max() == 0
    assert any(r["profile"].cuda_graph for r in again)


def test_non_finite_logits_give_an_error_not_a_label(batch):
    """A forward with a NaN logit (a NaN head bias stands for any numerical failure; the
    loader refuses non-finite weights, not the forward's arithmetic) gives ``error`` and no
    label or probabilities, per sequence and in a padded batch."""
    engine = ClassifierEngine(CHECKPOINT, "dense", "cpu", "auto", "float32")
    good = engine.run(batch[:2])
    assert all("error" not in r and np.isfinite(r["probabilities"]).all() for r in good)
    with torch.no_grad():
        engine.model.head.bias[3] = float("nan")
    for deterministic in (True, False):
        bad = engine.run(batch[:2], deterministic=deterministic)
        assert [sorted(r) for r in bad] == [["error", "model_id", "n", "profile", "variant"]] * 2
        assert bad[0]["error"] == "non-finite logits (NaN or infinity) from the model"


def test_a_failed_graph_capture_falls_back_to_plain_forwards(batch):
    """A forward that cannot be captured (one that reads the device from the host, as the
    PyTorch MiTA stages do) must not fail requests: the shape is served plain, logged once and
    never tried again."""
    from service.graphs import GraphCache

    calls = []

    def failing_capture(model, ids, mask):
        calls.append(ids.shape)
        raise RuntimeError("operation not permitted when stream is capturing")

    plain = ClassifierEngine(CHECKPOINT, "dense", "cpu", "auto", "float32")
    engine = ClassifierEngine(CHECKPOINT, "dense", "cpu", "auto", "float32")
    engine.graphs = GraphCache(engine.model, capture=failing_capture)
    seqs = [batch[0]] * 4
    got = engine.run(seqs)
    assert probs(got).tolist() == probs(plain.run(seqs)).tolist()
    assert not any(r["profile"].cuda_graph for r in got)
    assert calls == [(1, len(batch[0]))]  # tried once, at the 2nd sighting
    assert engine.graphs.uncapturable == {(1, len(batch[0]), False)}
