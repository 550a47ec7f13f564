"""A fine-tuned transformers model folder served over HTTP beside ListOps (``args.checkpoint:
DIR``): a BERT fine-tuned here with MiTA (``python -m mita.training --model``) at /bert, a DeiT
fine-tuned dense at /deit, each the second application of the documented own-data config.
Text is tokenized by the model's own tokenizer, ``label_name`` comes from its ``id2label``,
both variants are the same weights under two attention implementations and answer what the
plain engine answers in this process; a request past the model's positions is a 422 naming
them; A/B weights and the load tester work on it unchanged."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("transformers")
os.environ["HF_HUB_OFFLINE"] = "1"

from loadtest.__main__ import main as loadtest_main  # noqa: E402
from mita.training.train import main as train_main  # noqa: E402
from service.engine import ClassifierEngine  # noqa: E402
from service.settings import VARIANTS  # noqa: E402

from .. import pretrained_folders as folders  # noqa: E402
from ..helpers import with_documented_apps  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
LABELS = ["Persuasion", "other"]


# sharing: answers, counts and refusals, nothing timed: runs beside the tests/own_ray/
# tests instead of waiting for the cores lock (tests/lanes.py)
pytestmark = pytest.mark.sharing


@pytest.fixture(scope="module")
def pretrained_apps(service, tmp_path_factory):
    """/bert and /deit beside ListOps in one redeploy; the session's config afterwards."""
    from service import launch

    root = tmp_path_factory.mktemp("pretrained")
    bert, deit = root / "bert", root / "deit"
    train_main(["--model", str(folders.bert(root / "bert-base")), "--train",
                str(EXAMPLES / "austen-persuasion.tsv"), "--out", str(bert), "--mode", "mita",
                "--steps", "2", "--batch-size", "8"])
    train_main(["--model", str(folders.vit(root / "deit-base", deit=True)), "--train",
                str(EXAMPLES / "fashion-mnist-14x14.jsonl"), "--out", str(deit), "--mode",
                "dense", "--steps", "2", "--batch-size", "8"])
    session = launch.load_config(launch.CPU_CONFIG, service.overrides)
    launch.deploy(with_documented_apps(session, {"/bert": bert, "/deit": deit}))
    try:
        yield {"bert": bert, "deit": deit}
    finally:
        launch.deploy(session)


def _valid_text(shortest: bool) -> str:
    rows = [r.split("\t")[1] for r in (EXAMPLES / "austen-persuasion-valid.tsv")
            .read_text().splitlines()[1:]]
    return min(rows, key=len) if shortest else max(rows, key=len)


def test_text_is_classified_by_both_variants_with_label_names(service, pretrained_apps):
    """JSON text, JSON ids and binary int32 ids give one answer per variant, the plain
    engine's in this process on the same folder and backend (1e-6, as the own-data test:
    float32 forwards of the same code; the service's replicas may differ in BLAS threads)."""
    from transformers import AutoTokenizer

    c = service.client
    folder = pretrained_apps["bert"]
    text = _valid_text(shortest=True)
    ids = AutoTokenizer.from_pretrained(folder)(text)["input_ids"]
    for variant in VARIANTS:
        local = ClassifierEngine(str(folder), variant, "cpu", "auto", "auto").run(
            [np.array(ids)])[0]
        answers = [c.post("/bert/v1/classify", json={"text": text, "variant": variant}),
                   c.post("/bert/v1/classify", json={"ids": ids, "variant": variant}),
                   c.post("/bert/v1/classify/binary", params={"dtype": "int32",
                                                              "variant": variant},
                          content=np.array(ids, dtype="<i4").tobytes(),
                          headers={"content-type": "application/octet-stream"})]
        for r in answers:
            assert r.status_code == 200, r.text
            got = r.json()
            assert got["variant"] == variant and got["n"] == len(ids)
            assert got["label"] == local["label"]
            assert got["label_name"] == LABELS[got["label"]]
            assert got["probabilities"] == pytest.approx(local["probabilities"], abs=1e-6)
    # A/B at the documented 0.5 / 0.5: both variants answer 24 requests (each variant missing
    # from all of them: 2 × 0.5^24 ≈ 1e-7)
    seen = {c.post("/bert/v1/classify", json={"text": text}).json()["variant"]
            for _ in range(24)}
    assert seen == set(VARIANTS)


def test_past_the_positions_is_a_422_naming_them(service, pretrained_apps):
    c = service.client
    text = _valid_text(shortest=False)
    r = c.post("/bert/v1/classify", json={"text": text})
    assert r.status_code == 422
    n = len(text.replace(" ", "")) + 2  # the character tokenizer: one token per character
    assert r.json()["error"] == (f"sequence length N = {n} exceeds this model's 512 positions "
                                 "(BertForSequenceClassification's position embeddings)")
    r = c.post("/bert/v1/classify", json={"text": " "})  # only [CLS] [SEP]: nothing to classify
    assert r.status_code == 422 and r.json()["error"].startswith("empty sequence")
    r = c.post("/bert/v1/classify", json={"ids": [2, 101, 3]})
    assert r.status_code == 422 and "out of range [1, 100] (0 is padding)" in r.json()["error"]


def test_models_shows_the_architecture_task_and_setting(service, pretrained_apps):
    models = service.client.get("/bert/v1/models").json()
    task = models["task"]
    assert task["labels"] == LABELS and task["positions"] == 512
    assert task["architecture"] == "BertForSequenceClassification"
    assert task["tokenizer"] == {"kind": "transformers", "file": "tokenizer.json",
                                 "vocab_size": 101}
    mita = models["variants"]["mita"]
    assert mita["pretrained"]["architecture"] == "BertForSequenceClassification"
    assert mita["pretrained"]["saved_setting"]["num_landmarks"] == 16
    assert (mita["config"]["num_landmarks"], mita["config"]["topk"]) == (16, 16)
    assert mita["training"]["mode"] == "mita"
    assert models["variants"]["dense"]["config"]["attention"] == "dense"


def test_an_image_model_answers_pixel_rows(service, pretrained_apps):
    """DeiT at /deit: a 14 × 14 pixel row answered with its class name, as the engine here
    answers it; one pixel short is refused naming the image size."""
    c = service.client
    row = json.loads((EXAMPLES / "fashion-mnist-14x14.jsonl").read_text().splitlines()[3])
    labels = c.get("/deit/v1/models").json()["task"]["labels"]
    for variant in VARIANTS:
        r = c.post("/deit/v1/classify", json={"ids": row["ids"], "variant": variant})
        assert r.status_code == 200, r.text
        local = ClassifierEngine(str(pretrained_apps["deit"]), variant, "cpu", "auto",
                                 "auto").run([np.array(row["ids"])])[0]
        assert r.json()["label"] == local["label"]
        assert r.json()["label_name"] == labels[local["label"]]
    r = c.post("/deit/v1/classify", json={"ids": row["ids"][:-1]})
    assert r.status_code == 422 and r.json()["error"] == (
        "this model (DeiTForImageClassification) classifies 14×14 images: a sequence must "
        "have exactly 196 pixel ids (grey value + 1, row by row), got 195")


def test_the_load_tester_sends_text_rows_counted_in_characters(service, pretrained_apps,
                                                               tmp_path):
    summary = loadtest_main([
        "run", "--url", f"{service.url}/bert", "--data",
        str(EXAMPLES / "austen-persuasion-valid.tsv"), "--n", "200", "--variants", "mita",
        "dense", "--requests", "2", "--warmup", "0", "--out", str(tmp_path / "run")])
    assert [(r["variant"], r["ok"], r["errors"]) for r in summary["rows"]] == [
        ("dense", 2, {}), ("mita", 2, {})]
    assert summary["input"]["unit"] == "characters"


def test_modernbert_and_vit_are_served_after_a_live_redeploy(service, pretrained_apps,
                                                             tmp_path):
    """The other two architectures, over HTTP: a ModernBERT fine-tuned with MiTA replaces the
    BERT at /bert and a ViT (class token, no distillation token) fine-tuned dense replaces the
    DeiT at /deit, in one live redeploy (deploying all four folders at once did not become
    ready within 300 s on 2 cores). Each answers both variants with its label names, as the
    plain engine here answers (1e-6, as above); /v1/models names the new architectures.
    Last in this module: its fixture puts the session's config back afterwards."""
    from transformers import AutoTokenizer

    from service import launch

    modernbert, vit = tmp_path / "modernbert", tmp_path / "vit"
    train_main(["--model", str(folders.modernbert(tmp_path / "modernbert-base")), "--train",
                str(EXAMPLES / "austen-persuasion.tsv"), "--out", str(modernbert), "--mode",
                "mita", "--steps", "2", "--batch-size", "4"])
    train_main(["--model", str(folders.vit(tmp_path / "vit-base")), "--train",
                str(EXAMPLES / "fashion-mnist-14x14.jsonl"), "--out", str(vit), "--mode",
                "dense", "--steps", "2", "--batch-size", "8"])
    session = launch.load_config(launch.CPU_CONFIG, service.overrides)
    launch.deploy(with_documented_apps(session, {"/bert": modernbert, "/deit": vit}))
    c = service.client
    assert c.get("/bert/v1/models").json()["task"]["architecture"] == (
        "ModernBertForSequenceClassification")
    assert c.get("/deit/v1/models").json()["task"]["architecture"] == (
        "ViTForImageClassification")
    text = _valid_text(shortest=True)
    ids = AutoTokenizer.from_pretrained(modernbert)(text)["input_ids"]
    row = json.loads((EXAMPLES / "fashion-mnist-14x14.jsonl").read_text().splitlines()[3])
    image_labels = c.get("/deit/v1/models").json()["task"]["labels"]
    for variant in VARIANTS:
        r = c.post("/bert/v1/classify", json={"text": text, "variant": variant})
        assert r.status_code == 200, r.text
        assert r.json()["n"] == len(ids)
        mine = ClassifierEngine(str(modernbert), variant, "cpu", "auto", "auto").run(
            [np.array(ids)])[0]
        assert r.json()["label"] == mine["label"]
        assert r.json()["label_name"] == LABELS[mine["label"]]
        assert r.json()["probabilities"] == pytest.approx(mine["probabilities"], abs=1e-6)
        r = c.post("/deit/v1/classify", json={"ids": row["ids"], "variant": variant})
        assert r.status_code == 200, r.text
        mine = ClassifierEngine(str(vit), variant, "cpu", "auto", "auto").run(
            [np.array(row["ids"])])[0]
        assert r.json()["label"] == mine["label"]
        assert r.json()["label_name"] == image_labels[mine["label"]]
        assert r.json()["probabilities"] == pytest.approx(mine["probabilities"], abs=1e-6)
