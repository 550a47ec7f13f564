"""MiTA as a transformers attention implementation (``mita.pretrained``): the dense variant is
transformers' own SDPA, the MiTA variant's attention inside the model is ``mita_attention`` on
the same q, k, v, padding is honoured (a padded batch answers as its rows one by one), the
ViT / DeiT class token is pooled as the authors' code does, and what cannot be MiTA is refused.

Models are small random-initialised ones written by ``save_pretrained``
(``tests/pretrained_folders.py``) and loaded offline, run in float64 so that equalities are
tight: 1e-5 is the issue's bound for the dense logits; 1e-10 for MiTA against itself
(the same float64 operations in another order of rows)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("transformers")
os.environ["HF_HUB_OFFLINE"] = "1"

from mita import mita_attention  # noqa: E402
from mita.pretrained import (  # noqa: E402
    PretrainedSetting,
    hf_attention,  # noqa: E402
    register,
    use_attention,
)
from mita.pretrained.folder import load_classifier  # noqa: E402
from mita.stages import pool  # noqa: E402

from .. import pretrained_folders as folders  # noqa: E402

SETTING = PretrainedSetting(num_landmarks=4, topk=6)


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    root = tmp_path_factory.mktemp("pretrained")
    return {"bert": folders.bert(root / "bert"), "vit": folders.vit(root / "vit"),
            "deit": folders.vit(root / "deit", deit=True),
            "modernbert": folders.modernbert(root / "modernbert"),
            "deberta": folders.deberta(root / "deberta"), "root": root}


def _text_batch(seed: int, vocab: int, lengths: list[int]):
    g = torch.Generator().manual_seed(seed)
    n = max(lengths)
    ids = torch.randint(5, vocab, (len(lengths), n), generator=g)
    mask = torch.zeros(len(lengths), n, dtype=torch.long)
    for i, L in enumerate(lengths):
        mask[i, :L] = 1
        ids[i, L:] = 0
    return ids, mask


def test_dense_variant_is_transformers_sdpa_and_mita_is_mita_attention(made):
    from transformers import BertForSequenceClassification

    ids, mask = _text_batch(0, 60, [40, 31, 12])
    sdpa = BertForSequenceClassification.from_pretrained(made["bert"], attn_implementation="sdpa")
    sdpa = sdpa.double().eval()
    model, _ = load_classifier(made["bert"], "dense", setting=SETTING)
    model = model.double()
    with torch.no_grad():
        want = sdpa(input_ids=ids, attention_mask=mask).logits
        dense = model(input_ids=ids, attention_mask=mask).logits
        assert (dense - want).abs().max() < 1e-5
        use_attention(model, "mita")
        got = model(input_ids=ids, attention_mask=mask).logits
        capture = folders.capture(model)
        again = model(input_ids=ids, attention_mask=mask).logits
    assert torch.equal(got, again)  # the capture ran "mita"'s function, nothing else
    assert len(capture.calls) == 2  # one per layer
    for q, k, v, am, _, out in capture.calls:
        assert am.shape == (3, 40) and am.dtype == torch.bool  # the (B, N) padding mask
        ref = mita_attention(q, k, v, num_landmarks=4, topk=6, key_padding_mask=~am)
        assert torch.allclose(out, ref.transpose(1, 2), rtol=0, atol=1e-12)
        dense_out = F.scaled_dot_product_attention(q, k, v, attn_mask=am[:, None, None, :])
        # MiTA is not dense here (m = 4, k = 6 < N): its outputs differ well beyond rounding
        assert (out[0] - dense_out.transpose(1, 2)[0]).abs().max() > 1e-3 * out.abs().max()
        assert out[1, 31:].abs().max() == 0 and out[2, 12:].abs().max() == 0  # padded rows


@pytest.mark.parametrize("attention", ["mita", "dense"])
def test_a_padded_batch_answers_as_each_row_alone(made, attention):
    model, _ = load_classifier(made["bert"], attention, setting=SETTING)
    model = model.double()
    ids, mask = _text_batch(1, 60, [37, 9, 22, 37])
    with torch.no_grad():
        batch = model(input_ids=ids, attention_mask=mask).logits
        alone = torch.cat([model(input_ids=ids[i:i + 1, :int(mask[i].sum())]).logits
                           for i in range(4)])
    assert torch.allclose(batch, alone, rtol=0, atol=1e-10)


def test_the_setting_is_saved_with_the_model_and_read_back(made, tmp_path):
    from transformers import AutoModelForSequenceClassification

    model, _ = load_classifier(made["bert"], "mita",
                               setting=PretrainedSetting(num_landmarks=3, topk=5, route_topk=2))
    model.save_pretrained(tmp_path / "saved")
    register()
    again = AutoModelForSequenceClassification.from_pretrained(tmp_path / "saved",
                                                               attn_implementation="mita")
    assert again.config.mita == {"num_landmarks": 3, "topk": 5, "route_topk": 2,
                                 "shared_scale": "paper", "landmark_grid": None,
                                 "backend": "auto"}
    ids, mask = _text_batch(2, 60, [20, 14])
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids, attention_mask=mask).logits,
                           again.eval()(input_ids=ids, attention_mask=mask).logits)


def test_modernbert_at_4096_tokens_mita_in_global_layers_window_in_local(made):
    from transformers import ModernBertForSequenceClassification

    sdpa = ModernBertForSequenceClassification.from_pretrained(
        made["modernbert"], attn_implementation="sdpa").eval()
    model, _ = load_classifier(made["modernbert"], "dense", setting=PretrainedSetting(
        num_landmarks=32, topk=64))
    ids, mask = _text_batch(3, 60, [4096, 3000])
    with torch.no_grad():
        want = sdpa(input_ids=ids, attention_mask=mask).logits
        assert (model(input_ids=ids, attention_mask=mask).logits - want).abs().max() < 1e-5
        capture = folders.capture(model)
        batch = model(input_ids=ids, attention_mask=mask).logits
        alone = model(input_ids=ids[1:, :3000]).logits
    windows = [kw.get("sliding_window") for *_, kw, _ in capture.calls]
    # per forward: layer 0 global (MiTA), layers 1, 2 local (a half-window of 16 // 2, + 1)
    assert windows == [None, 9, 9] * 2
    assert torch.allclose(batch[1:], alone, rtol=0, atol=1e-4)  # float32, 4096 tokens


@pytest.mark.parametrize("kind,prefix", [("vit", 1), ("deit", 2)])
def test_vit_and_deit_pool_the_first_grid_cells_class_token_included(made, kind, prefix):
    model, _ = load_classifier(made[kind], "mita")
    assert model.config.mita["landmark_grid"] == [7, 7]  # 14 × 14 images, 2 × 2 patches
    model = model.double()
    capture = folders.capture(model)
    x = torch.rand(2, 3, 14, 14, generator=torch.Generator().manual_seed(4),
                   dtype=torch.float64)
    with torch.no_grad():
        model(pixel_values=x)
    q, k, v, am, _, out = capture.calls[0]
    assert q.shape[2] == 49 + prefix and am is None
    # The authors' DeiT code pools q[:, :-1] as a √N × √N grid: the class token in the first
    # cell, the last patch(es) in none. Here: adaptive 2-D pooling of the first 49 tokens.
    landmarks, _ = pool(q, 4, None, (7, 7))
    grid = q[:, :, :49].transpose(2, 3).reshape(2 * 4, 8, 7, 7)
    want = F.adaptive_avg_pool2d(grid, 2).reshape(2, 4, 8, 4).transpose(2, 3)
    assert torch.allclose(landmarks, want, rtol=0, atol=1e-12)
    ref = mita_attention(q, k, v, num_landmarks=4, topk=4, landmark_grid=(7, 7))
    assert torch.allclose(out, ref.transpose(1, 2), rtol=0, atol=1e-12)


def test_refusals_name_what_is_wrong(made, tmp_path):
    with pytest.raises(ValueError, match="DebertaV2ForSequenceClassification.*does not "
                                         "dispatch its attention"):
        load_classifier(made["deberta"], "mita")
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_text((made["bert"] / "config.json").read_text())
    with pytest.raises(ValueError, match="no weights"):
        load_classifier(bare, "mita")
    (bare / "model.safetensors").write_bytes((made["bert"] / "model.safetensors").read_bytes())
    with pytest.raises(ValueError, match="without its tokenizer"):
        load_classifier(bare, "mita")
    with pytest.raises(ValueError, match="not a folder"):
        load_classifier(tmp_path / "nowhere", "mita")
    trained = folders.bert(tmp_path / "trained", labels=["spam", "ham"])
    with pytest.raises(ValueError, match=r"trained on labels \['spam', 'ham'\], the data has "
                                         r"\['a', 'b', 'c'\]"):
        load_classifier(trained, "mita", labels=["a", "b", "c"])
    model, _ = load_classifier(trained, "mita", labels=["ham", "spam"])
    assert model.config.id2label == {0: "spam", 1: "ham"}  # the head's own order is kept
    with pytest.raises(ValueError, match="to be a perfect square"):
        PretrainedSetting(num_landmarks=5, landmark_grid=(7, 7))


def test_masks_that_are_not_padding_are_refused():
    causal = torch.ones(5, 5, dtype=torch.bool).tril()[None, None].expand(2, 1, 5, 5)
    with pytest.raises(ValueError, match="padding mask only"):
        hf_attention.key_padding_mask(causal, 2, 5)
    bias = torch.zeros(2, 1, 5, 5)
    bias[..., 0] = 0.5
    with pytest.raises(ValueError, match="not an additive attention bias"):
        hf_attention.key_padding_mask(bias, 2, 5)
    padding = torch.zeros(2, 1, 5, 5)
    padding[1, ..., 3:] = torch.finfo(torch.float32).min
    want = torch.tensor([[False] * 5, [False] * 3 + [True] * 2])
    assert torch.equal(hf_attention.key_padding_mask(padding, 2, 5), want)
    assert torch.equal(hf_attention.key_padding_mask(padding == 0, 2, 5), want)


def test_a_causal_layer_and_another_scaling_are_refused(made):
    model, _ = load_classifier(made["bert"], "mita", setting=SETTING)
    layer = model.bert.encoder.layer[0].attention.self
    q = torch.randn(1, 4, 6, 8)
    with pytest.raises(ValueError, match="scales logits by 0.5"):
        hf_attention.mita_attention_forward(layer, q, q, q, None, scaling=0.5)
    layer.is_causal = True
    with pytest.raises(ValueError, match="causal"):
        hf_attention.mita_attention_forward(layer, q, q, q, None)
