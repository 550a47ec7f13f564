"""The encoder classifier, its checkpoint format and the tied dense/MiTA variants."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from mita.attention import mita_attention
from mita.data.listops import ListOpsConfig, encode, generate
from mita.model import (
    EncoderClassifier,
    ModelConfig,
    load_checkpoint,
    save_checkpoint,
    sinusoidal_positions,
    tied_variant,
)
from mita.training.train import pad_batch

SMALL = ModelConfig(dim=32, depth=2, num_heads=2, ffn_dim=64, num_landmarks=4, topk=8)


def sample_batch(n=4, seed=0):
    data = generate(n, seed, ListOpsConfig(20, 120))
    return pad_batch([encode(t) for t, _ in data])


def test_config_round_trip_and_validation():
    cfg = SMALL.replace(attention="dense", route_topk=2)
    assert ModelConfig.from_dict(json.loads(json.dumps(cfg.__dict__))) == cfg
    with pytest.raises(ValueError, match=r"unknown config field\(s\) \['heads'\]"):
        ModelConfig.from_dict({"heads": 4})
    with pytest.raises(ValueError, match="'attention'"):
        SMALL.replace(attention="linear")
    with pytest.raises(ValueError, match="'dim'"):
        SMALL.replace(dim=30, num_heads=4)
    with pytest.raises(ValueError, match="'topk'"):
        SMALL.replace(topk=0)
    with pytest.raises(ValueError, match="'route_topk'"):
        SMALL.replace(route_topk=5)
    # Accepted before (a config.json is written by people too): upper bounds, and m, k at
    # most max_len.
    with pytest.raises(ValueError, match=r"'topk' must be an int in \[1, 16777216\], got "
                                         r"1000000000"):
        SMALL.replace(topk=1_000_000_000)
    with pytest.raises(ValueError, match=r"'topk' \(16\) exceeds 'max_len' \(1\)"):
        SMALL.replace(max_len=1, num_landmarks=1, topk=16)
    with pytest.raises(ValueError, match=r"'dim' must be an int in \[1, 16384\]"):
        SMALL.replace(dim=1 << 20)


def test_a_huge_config_is_refused_before_allocating(tmp_path):
    """config.json asking for dim 16384 and depth 256 (~2 TB of float32 parameters) next to
    small weights: refused from the file's header and a meta-device model, at once (the model
    was built, i.e. allocated, before the shapes were compared)."""
    import time

    save_checkpoint(EncoderClassifier(SMALL), tmp_path / "ck")
    meta = json.loads((tmp_path / "ck" / "config.json").read_text())
    meta["config"].update(dim=16384, depth=256, ffn_dim=1 << 17, num_heads=2)
    (tmp_path / "ck" / "config.json").write_text(json.dumps(meta))
    start = time.perf_counter()
    with pytest.raises(ValueError, match=r"does not fit the config: missing 3048 \['blocks.10."):
        load_checkpoint(tmp_path / "ck")
    assert time.perf_counter() - start < 30  # allocating ~2 TB cannot finish (or fit) at all


def test_checkpoint_round_trip_and_refusals(tmp_path):
    torch.manual_seed(0)
    model = EncoderClassifier(SMALL).eval()
    ids, mask = sample_batch()
    save_checkpoint(model, tmp_path / "ck")
    loaded = load_checkpoint(tmp_path / "ck")
    assert torch.equal(loaded(ids, mask), model(ids, mask))
    dense = load_checkpoint(tmp_path / "ck", attention="dense")
    assert dense.config.attention == "dense"

    weights = tmp_path / "ck" / "model.safetensors"
    blob = bytearray(weights.read_bytes())
    blob[-1] ^= 1
    weights.write_bytes(bytes(blob))
    with pytest.raises(ValueError, match="SHA-256 .* does not match"):
        load_checkpoint(tmp_path / "ck")

    save_checkpoint(EncoderClassifier(SMALL.replace(dim=16, ffn_dim=64)), tmp_path / "other")
    meta = json.loads((tmp_path / "other" / "config.json").read_text())
    meta["config"]["dim"] = 32  # config and tensors disagree
    (tmp_path / "other" / "config.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match=r"shape mismatch 26 \['blocks.0.attn.out_proj.bias: "
                                         r"checkpoint \(16,\) vs config \(32,\)'"):
        load_checkpoint(tmp_path / "other")
    meta["config"]["colour"] = "red"
    (tmp_path / "other" / "config.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="'colour'"):
        load_checkpoint(tmp_path / "other")
    with pytest.raises(FileNotFoundError):
        load_checkpoint(tmp_path / "missing")


def test_variants_differ_only_in_attention():
    torch.manual_seed(1)
    mita = EncoderClassifier(SMALL).eval()
    dense = tied_variant(mita, "dense").eval()
    assert all(a is b for a, b in zip(mita.parameters(), dense.parameters(), strict=True))
    ids, mask = sample_batch()
    captured = {}
    for name, model in (("mita", mita), ("dense", dense)):
        model.blocks[0].attn.register_forward_hook(
            lambda mod, args, out, name=name: captured.setdefault(name, args[0]))
    out_mita, out_dense = mita(ids, mask), dense(ids, mask)
    assert torch.equal(captured["mita"], captured["dense"])  # embeddings + norm identical
    x = torch.randn(2, 10, SMALL.dim)
    assert torch.equal(mita.blocks[1].ffn(x), dense.blocks[1].ffn(x))
    assert (out_mita - out_dense).abs().max() > 1e-4  # attention does differ
    # Swap MiTA's attention routine for dense's: the whole model then matches dense exactly.
    for block_m, block_d in zip(mita.blocks, dense.blocks, strict=True):
        block_m.attn.attend = block_d.attn.attend
    assert torch.equal(mita(ids, mask), out_dense)


def test_mita_with_one_landmark_and_k_equal_n_runs():
    ids, mask = sample_batch()
    model = EncoderClassifier(SMALL.replace(num_landmarks=1, topk=ids.shape[1])).eval()
    out = model(ids, mask)
    assert out.shape == (4, 10) and torch.isfinite(out).all()


@pytest.mark.parametrize("attention", ["dense", "mita"])
def test_padding_does_not_change_predictions(attention):
    torch.manual_seed(2)
    model = EncoderClassifier(SMALL.replace(attention=attention)).eval()
    ids, mask = sample_batch(6, seed=4)
    batched = model(ids, mask)
    for i in range(ids.shape[0]):
        n = int((~mask[i]).sum())
        alone = model(ids[i: i + 1, :n])
        # float32, different N changes BLAS blocking: agree to 1e-5, same argmax.
        torch.testing.assert_close(batched[i: i + 1], alone, rtol=0, atol=1e-5)
        assert batched[i].argmax() == alone[0].argmax()


@pytest.mark.parametrize("attention", ["dense", "mita"])
def test_the_mask_is_checked_once_per_forward_and_refused_when_bad(attention, monkeypatch):
    """The model checks its padding mask once (not once per layer, 2 layers here) and refuses
    a bad one itself, before any layer runs."""
    from mita import model as model_module
    from mita import stages

    calls, check = [], stages.check_padding_mask

    def counted(mask, B, N):
        calls.append((B, N))
        return check(mask, B, N)

    monkeypatch.setattr(model_module, "check_padding_mask", counted)
    monkeypatch.setattr(stages, "check_padding_mask", counted)  # what attention would call
    model = EncoderClassifier(SMALL.replace(attention=attention)).eval()
    ids, mask = sample_batch(4, seed=1)
    with torch.no_grad():
        model(ids, mask)
    assert calls == [(4, ids.shape[1])]
    empty = mask.clone()
    empty[2] = True
    with pytest.raises(ValueError, match=r"batch rows \[2\] are all padding"):
        model(ids, empty)
    with pytest.raises(ValueError, match="key_padding_mask must be bool, got torch.int64"):
        model(ids, mask.long())
    with pytest.raises(ValueError, match=r"key_padding_mask must have shape \(4, "):
        model(ids, mask[:, :-1])


def test_positions_work_up_to_one_million():
    pe = sinusoidal_positions(1_048_576, 8)
    assert pe.shape == (1_048_576, 8) and torch.isfinite(pe).all()
    assert pe[0].tolist() == [0.0, 1.0] * 4  # sin(0), cos(0)
    with pytest.raises(ValueError, match="exceeds max_len"):
        EncoderClassifier(SMALL.replace(max_len=8))(torch.ones(1, 9, dtype=torch.long))


def test_shipped_checkpoint_beats_majority_class_with_both_attentions():
    """The committed checkpoint, loaded from disk, on 500 fresh ListOps sequences (seed
    2_000_003: no training, validation or README-table run uses it; lengths 100-500).
    Measured on the README's 2,000-sequence test set: dense 0.395, MiTA 0.397, majority
    class 0.163. With 500 sequences the standard error is ≈ 0.022, so the bound 0.30 sits
    four standard errors below the measured accuracy and 0.13 above majority."""
    from collections import Counter

    from mita.training.train import encoded, evaluate

    test = encoded(generate(500, 2_000_003, ListOpsConfig(100, 500)))
    majority = Counter(label for _, label in test).most_common(1)[0][1] / len(test)
    assert majority < 0.2
    for attention in ("dense", "mita"):
        model = load_checkpoint("checkpoints/listops-default", attention=attention)
        acc = evaluate(model, test)
        assert acc > 0.30, (attention, acc, majority)


def test_position_table_is_cached_and_sliced():
    """The cached table gives the values a fresh computation gives, at every length, after a
    longer table was built (rows depend only on their position)."""
    from mita import model as M

    M._POSITION_TABLES.clear()
    short = M.sinusoidal_positions(100, 16)
    assert torch.equal(short, M._sinusoidal(100, 16))
    long = M.sinusoidal_positions(3000, 16)  # grows the table to 4096 rows
    assert M._POSITION_TABLES[(16, "cpu", torch.float32)].shape == (4096, 16)
    assert torch.equal(long, M._sinusoidal(3000, 16))
    assert torch.equal(M.sinusoidal_positions(100, 16), short)
    assert M.sinusoidal_positions(7, 16, dtype=torch.bfloat16).dtype == torch.bfloat16


def resave(src, dst, change):
    """Copy a checkpoint with ``change(state)`` applied to its tensors and a matching SHA-256
    (a re-save, not a corruption)."""
    from safetensors.torch import load_file, save_file

    import mita.model as M

    dst.mkdir()
    state = change(load_file(src / M.WEIGHTS_FILE))
    save_file(state, dst / M.WEIGHTS_FILE)
    meta = json.loads((src / M.CONFIG_FILE).read_text())
    meta["weights_sha256"] = M._sha256(dst / M.WEIGHTS_FILE)
    (dst / M.CONFIG_FILE).write_text(json.dumps(meta))
    return dst


def test_checkpoint_tensor_dtypes_and_values_are_checked(tmp_path, caplog):
    """Re-saved with a matching SHA-256: an int64 head (which truncated every weight and moved
    probabilities by up to 0.135 on main) or a bool tensor is refused, NaN/inf weights are
    refused, and a bfloat16 / float16 checkpoint loads converted, with a warning naming the
    tensors."""
    torch.manual_seed(0)
    save_checkpoint(EncoderClassifier(SMALL).eval(), tmp_path / "ck")
    src = tmp_path / "ck"

    def cast(name, dtype):
        return lambda st: st | {name: st[name].to(dtype)}

    for i, (change, message) in enumerate([
            (cast("head.weight", torch.int64),
             r"not float16/bfloat16/float32/float64: \['head.weight \(torch.int64"),
            (cast("norm.bias", torch.bool), r"norm.bias \(torch.bool\)"),
            # float8 had no isfinite: NotImplementedError
            (cast("norm.bias", torch.float8_e4m3fn), r"norm.bias \(torch.float8_e4m3fn\)"),
            (lambda st: st | {"embed.weight": st["embed.weight"].index_fill(0, torch.tensor([3]),
                                                                          float("nan"))},
             r"NaN or infinite values \(in torch.float32\): \['embed.weight'\]"),
            (lambda st: st | {"head.bias": st["head.bias"] + float("inf")},
             r"NaN or infinite values \(in torch.float32\): \['head.bias'\]"),
            # finite in float64, inf in float32: was loaded, and every forward gave NaN
            (lambda st: st | {"head.bias": st["head.bias"].double() * 1e300},
             r"NaN or infinite values \(in torch.float32\): \['head.bias'\]")]):
        with pytest.raises(ValueError, match=message):
            load_checkpoint(resave(src, tmp_path / f"bad{i}", change))
    with caplog.at_level("WARNING", logger="mita.model"):
        half = load_checkpoint(resave(src, tmp_path / "half", cast("head.weight",
                                                                    torch.bfloat16)))
    assert "converting 1 tensor(s) to torch.float32: head.weight (torch.bfloat16)" in caplog.text
    assert half.head.weight.dtype == torch.float32


def test_config_json_and_weights_file_are_checked(tmp_path):
    """Each was a traceback (SafetensorError, RecursionError, AttributeError) or loaded with
    defaults standing in for missing fields."""
    import hashlib

    save_checkpoint(EncoderClassifier(SMALL), tmp_path / "ck")
    meta = json.loads((tmp_path / "ck" / "config.json").read_text())

    def variant(name: str, config_text: str | None = None, weights: bytes | None = None):
        folder = tmp_path / name
        shutil.copytree(tmp_path / "ck", folder)
        if weights is not None:
            (folder / "model.safetensors").write_bytes(weights)
            fixed = {**meta, "weights_sha256": hashlib.sha256(weights).hexdigest()}
            config_text = json.dumps(fixed)
        if config_text is not None:
            (folder / "config.json").write_text(config_text)
        return folder

    no_topk = {**meta, "config": {k: v for k, v in meta["config"].items() if k != "topk"}}
    text = json.dumps(meta)
    for folder, message in [
            (variant("trunc", weights=(tmp_path / "ck" / "model.safetensors").read_bytes()[:50]),
             "not a readable safetensors file"),
            (variant("garbage", weights=b"\xff" * 64), "not a readable safetensors file"),
            (variant("deep", "[" * 100_000), "not valid JSON"),
            (variant("dup", text.replace('"topk": 8', '"topk": 8, "topk": 16')),
             r"duplicate key\(s\) \['topk'\]"),
            (variant("absent", json.dumps(no_topk)), r"config lacks field\(s\) \['topk'\]"),
            (variant("training", json.dumps({**meta, "training": "x"})),
             "'training' must be an object")]:
        with pytest.raises(ValueError, match=message):
            load_checkpoint(folder)


def test_mita_setting_is_checked_by_one_rule():
    """m, k, s are validated by ``mita.config.check_setting`` alone: ModelConfig and the
    functional ``mita_attention`` refuse the same setting with the same words."""
    with pytest.raises(ValueError) as from_config:
        SMALL.replace(num_landmarks=4, route_topk=5)
    q = torch.randn(1, 1, 8, 4)
    with pytest.raises(ValueError) as from_function:
        mita_attention(q, q, q, num_landmarks=4, topk=2, route_topk=5)
    assert str(from_config.value) == "config: " + str(from_function.value)
    assert str(from_function.value) == "'route_topk' s = 5 exceeds 'num_landmarks' m = 4"


def test_landmark_grid_through_model_config(tmp_path):
    """A 2-D landmark grid set in ModelConfig reaches every MiTA layer: the model's attention
    equals ``mita_attention`` with that grid on the layer's own projections (float64, 1e-12:
    the same operations in the same order), differs from 1-D pooling, survives a
    checkpoint round trip (JSON list → tuple), and a sequence that is not H·W tokens, or an m
    that is not a square, is refused."""
    cfg = SMALL.replace(num_landmarks=4, topk=5, landmark_grid=(4, 6))
    torch.manual_seed(3)
    model = EncoderClassifier(cfg).double().eval()
    attn = model.blocks[0].attn
    x = torch.randn(2, 24, cfg.dim, dtype=torch.float64)
    q, k, v = attn.qkv(x).view(2, 24, 3, cfg.num_heads, -1).permute(2, 0, 3, 1, 4)
    for grid, same in (((4, 6), True), (None, False)):
        o = mita_attention(q, k, v, num_landmarks=4, topk=5, landmark_grid=grid)
        want = attn.out_proj(o.transpose(1, 2).reshape(2, 24, cfg.dim))
        assert torch.allclose(attn(x), want, rtol=0, atol=1e-12) is same
    ids = torch.randint(1, cfg.vocab_size, (2, 24))
    logits = model(ids)
    save_checkpoint(model.float(), tmp_path / "grid")
    assert json.loads((tmp_path / "grid" / "config.json").read_text())["config"][
        "landmark_grid"] == [4, 6]
    loaded = load_checkpoint(tmp_path / "grid")
    assert loaded.config.landmark_grid == (4, 6)
    assert torch.allclose(loaded.double()(ids), logits, atol=1e-5)  # float32 weights
    with pytest.raises(ValueError, match=r"landmark_grid \(4, 6\) has 24 cells but N = 25"):
        model(torch.randint(1, cfg.vocab_size, (1, 25)))
    with pytest.raises(ValueError, match="perfect square"):
        SMALL.replace(num_landmarks=6, landmark_grid=(4, 6))
    with pytest.raises(ValueError, match="two ints"):
        SMALL.replace(landmark_grid=(4, 0))


def test_checkpoints_written_before_landmark_grid_load_with_1d_pooling(tmp_path):
    """The shipped checkpoint's config.json predates ``landmark_grid``: it loads with
    ``None`` (1-D pooling, what it was trained with); any other missing field is refused."""
    save_checkpoint(EncoderClassifier(SMALL), tmp_path / "ck")
    path = tmp_path / "ck" / "config.json"
    meta = json.loads(path.read_text())
    del meta["config"]["landmark_grid"]
    path.write_text(json.dumps(meta))
    assert load_checkpoint(tmp_path / "ck").config.landmark_grid is None
    del meta["config"]["topk"]
    path.write_text(json.dumps(meta))
    with pytest.raises(ValueError, match=r"config lacks field\(s\) \['topk'\]"):
        load_checkpoint(tmp_path / "ck")


@pytest.mark.slow  # a fresh interpreter
def test_loading_a_checkpoint_imports_no_torch_dynamo():
    """``load_checkpoint``'s shape check builds the model on the meta device without the
    embedding's random init: ``nn.init.normal_`` there ran torch's Python reference kernels,
    whose first call imported ``torch._dynamo`` — 2-3 s of CPU in every process that loads
    a checkpoint (each replica, ``python -m service --check``), 4.9 s instead of 8.9 s."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", (
        "import sys; from mita.model import load_checkpoint\n"
        "m = load_checkpoint('checkpoints/listops-default')\n"
        "print(m.config.vocab_size, 'torch._dynamo' in sys.modules)")],
        capture_output=True, text=True, timeout=120)
    assert done.stdout.split() == ["16", "False"], done.stdout + done.stderr[-2000:]
