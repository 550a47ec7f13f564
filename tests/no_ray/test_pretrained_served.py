"""A transformers model folder served and advised (``mita.pretrained.served``): the service's
own code without Ray — ``service.app.served_config`` (what deploy and ``--check`` read),
``service.engine.ClassifierEngine`` (what each classifier replica runs) and the gateway's input
checks — on tiny random-initialised folders whose heads carry label names
(``tests/pretrained_folders.py``); the same over HTTP in ``tests/service/
test_pretrained_service.py``."""

from __future__ import annotations

import json
import os
import pickle
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")
os.environ["HF_HUB_OFFLINE"] = "1"

from mita.hooks import MITA_STAGES  # noqa: E402
from mita.pretrained import PretrainedSetting, use_attention  # noqa: E402
from mita.pretrained.folder import pixel_batch  # noqa: E402
from profiler.__main__ import main as profiler_main  # noqa: E402
from service.app import served_config  # noqa: E402
from service.engine import ClassifierEngine  # noqa: E402
from service.inputs import ApiError, served_ids  # noqa: E402
from service.schemas import ClassifyRequest  # noqa: E402

from .. import pretrained_folders as folders  # noqa: E402

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
LABELS = ["Persuasion", "other"]
CLOTHES = ["T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker",
           "Bag", "Ankle boot"]
TEXT = "Anne Elliot walked to Camden Place with Captain Wentworth."


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    root = tmp_path_factory.mktemp("served")
    return {"bert": folders.bert(root / "bert", labels=LABELS),
            "deit": folders.vit(root / "deit", deit=True, labels=CLOTHES),
            "modernbert": folders.modernbert(root / "modernbert", labels=LABELS),
            "untrained": folders.bert(root / "untrained"),
            "deberta": folders.deberta(root / "deberta")}


def _hf(folder, implementation="sdpa"):
    from transformers import AutoModelForImageClassification, AutoModelForSequenceClassification

    auto = (AutoModelForImageClassification if "deit" in folder.name
            else AutoModelForSequenceClassification)
    return auto.from_pretrained(folder, attn_implementation=implementation,
                                dtype=torch.float32).eval()


def _text_ids(folder, text=TEXT) -> np.ndarray:
    from transformers import AutoTokenizer

    return np.array(AutoTokenizer.from_pretrained(folder)(text)["input_ids"], dtype=np.int64)


@torch.no_grad()
def test_dense_variant_is_the_models_own_sdpa_and_mita_its_setting(made):
    """Acceptance: with the same weights the dense variant's logits equal transformers' own
    SDPA within 1e-5 (float32; the same attention kernel, reached through the product's
    registration). The MiTA variant serves ``mita_setting`` (here m = 4, k = 8, not the default
    16 × 16): its logits are those of the model switched to MiTA with that setting
    (``use_attention``, the same float32 forward: 1e-6)."""
    ids = _text_ids(made["bert"])
    x = torch.from_numpy(ids)[None]
    want = _hf(made["bert"])(input_ids=x).logits
    dense = ClassifierEngine(str(made["bert"]), "dense", "cpu", dtype="float32")
    assert (dense.model(x) - want).abs().max() < 1e-5
    probs = dense.run([ids])[0]["probabilities"]
    assert probs == pytest.approx(torch.softmax(want.double(), -1)[0].tolist(), abs=1e-6)

    mita = ClassifierEngine(str(made["bert"]), "mita", "cpu", "torch", "float32",
                            setting={"num_landmarks": 4, "topk": 8})
    assert (mita.info["config"]["num_landmarks"], mita.info["config"]["topk"]) == (4, 8)
    reference = _hf(made["bert"])
    use_attention(reference, "mita", PretrainedSetting(4, 8, backend="torch"))
    got = mita.model(x)
    assert (got - reference(input_ids=x).logits).abs().max() < 1e-6
    use_attention(reference, "mita", PretrainedSetting(16, 16, backend="torch"))
    # the setting matters: the default's logits differ by more than 10× the tolerance above
    # (a random head's logits are ~1e-2)
    assert (got - reference(input_ids=x).logits).abs().max() > 1e-5
    info = mita.info["pretrained"]
    assert info["architecture"] == "BertForSequenceClassification" and info["kind"] == "text"
    assert info["labels"] == LABELS and info["positions"] == 512


def test_padded_batches_answer_as_one_by_one_and_every_stage_is_timed(made):
    """Three texts of different lengths in one padded forward (``deterministic=False``) give
    each the answer it gets alone, both variants (1e-5: float32, padded shapes change the
    matmuls' blocking; padded keys are masked exactly). A staged MiTA forward times MiTA's
    seven stages (inside every layer); dense's attention is one stage."""
    texts = [TEXT, "Emma Woodhouse, handsome, clever, and rich.",
             "Mr Knightley came to dine with them at Hartfield."]
    rows = [_text_ids(made["bert"], t) for t in texts]
    # one power-of-two length bucket (33 … 64 tokens), so one padded forward
    assert len({len(r) for r in rows}) == 3 and all(32 < len(r) <= 64 for r in rows)
    for attention in ("mita", "dense"):
        engine = ClassifierEngine(str(made["bert"]), attention, "cpu", "torch", "float32")
        together = engine.run(rows, deterministic=False)
        assert together[0]["profile"].batch_size == 3  # padded together
        for row, got in zip(rows, together, strict=True):
            alone = engine.run([row])[0]
            assert got["label"] == alone["label"]
            assert got["probabilities"] == pytest.approx(alone["probabilities"], abs=1e-5)
        staged = engine.run([rows[0]], staged=[True])[0]["profile"]
        stages = set(staged.stages_ms)
        assert stages == (set(MITA_STAGES) if attention == "mita" else {"attention"})


def test_text_is_tokenized_as_training_did_and_positions_refuse(made):
    """The gateway's task: text through the folder's own tokenizer with its special tokens
    (what ``python -m mita.training --model`` trained on), label names from ``id2label``, ids
    checked against the model's vocabulary, a sequence over the 512 positions a 422 naming the
    limit — and the task reaches the gateway's replica pickled, its tokenizer loaded there."""
    _, cfg, task = served_config({"checkpoint": str(made["bert"])})
    assert task.labels == tuple(LABELS) and task.positions == 512
    assert task.architecture == "BertForSequenceClassification"
    ids = _text_ids(made["bert"])
    assert ids[0] == 2 and ids[-1] == 3  # [CLS] … [SEP] of the character vocabulary
    task = pickle.loads(pickle.dumps(task))
    served = served_ids(ClassifyRequest(text=TEXT), 16384, task.vocab, task.tokenizer, task)
    assert served.ids.tolist() == ids.tolist() and served.truncated is None
    assert task.length_refusal(512) is None
    assert task.length_refusal(513) == ("sequence length N = 513 exceeds this model's 512 "
                                        "positions (BertForSequenceClassification's position "
                                        "embeddings)")
    # an empty text is the model's [CLS] [SEP] alone: refused as an empty sequence
    for empty in ("", "   "):
        with pytest.raises(ApiError, match=r"^empty sequence: the text has no tokens to "
                                           r"classify \(only the model's special tokens\)$"):
            served_ids(ClassifyRequest(text=empty), 16384, task.vocab, task.tokenizer, task)
    with pytest.raises(ApiError, match=r"token id 101 at position 1 is out of range \[1, 100\] "
                                       r"\(0 is padding\)") as e:
        served_ids(ClassifyRequest(ids=[2, 101]), 16384, task.vocab, task.tokenizer, task)
    assert e.value.status == 422
    assert (cfg.dim, cfg.depth, cfg.num_heads, cfg.ffn_dim) == (32, 2, 4, 64)
    assert task.info()["tokenizer"] == {"kind": "transformers", "file": "tokenizer.json",
                                        "vocab_size": 101}


def test_an_image_folder_takes_pixel_rows_as_training_did(made):
    """DeiT (class and distillation tokens before the 7 × 7 patches): a request is exactly
    14 × 14 pixel ids (grey value + 1), turned into ``pixel_values`` as training did
    (``folder.pixel_batch``); its answer is the model's own on those pixels (1e-6); the
    analytic FLOPs count the transformer's 51 tokens, not the 196 ids sent: qkv_proj =
    depth 2 × 2·51·32·96."""
    _, cfg, task = served_config({"checkpoint": str(made["deit"])})
    assert task.grid == (14, 14) and task.labels == tuple(CLOTHES) and cfg.landmark_grid == (7, 7)
    assert task.length_refusal(196) is None
    assert task.length_refusal(195) == ("this model (DeiTForImageClassification) classifies "
                                        "14×14 images: a sequence must have exactly 196 pixel "
                                        "ids (grey value + 1, row by row), got 195")
    row = json.loads((EXAMPLES / "fashion-mnist-14x14.jsonl").read_text().splitlines()[0])["ids"]
    for attention in ("mita", "dense"):
        engine = ClassifierEngine(str(made["deit"]), attention, "cpu", "torch", "float32")
        got = engine.run([np.array(row)])[0]
        model = _hf(made["deit"])
        use_attention(model, attention, PretrainedSetting(4, 4, landmark_grid=(7, 7),
                                                          backend="torch"))
        with torch.no_grad():
            want = torch.softmax(model(pixel_values=pixel_batch([row], model.config)
                                       ).logits.double(), -1)[0]
        assert got["probabilities"] == pytest.approx(want.tolist(), abs=1e-6)
        assert got["profile"].flops["qkv_proj"] == 2 * (2 * 51 * 32 * 96)


def test_modernbert_is_served_at_4096_tokens(made):
    """ModernBERT's 4,096 positions: a 4,096-token sequence is served by both variants (MiTA
    in its global layers, its local layers windowed), one more token is refused."""
    _, _, task = served_config({"checkpoint": str(made["modernbert"])})
    assert task.positions == 4096 and task.length_refusal(4097) is not None
    rng = np.random.default_rng(0)
    ids = np.concatenate([[2], rng.integers(5, 90, 4094), [3]])
    for attention in ("mita", "dense"):
        engine = ClassifierEngine(str(made["modernbert"]), attention, "cpu", "auto", "float32",
                                  setting={"num_landmarks": 32, "topk": 64})
        got = engine.run([ids])[0]
        assert got["n"] == 4096 and got["label"] in (0, 1)
        assert sum(got["probabilities"]) == pytest.approx(1.0, abs=1e-12)


@pytest.mark.parametrize("which,args,message", [
    ("untrained", {}, r"its classification head is untrained \(transformers' default labels "
                      r"LABEL_0 …\): fine-tune it on your labelled file first"),
    ("deberta", {}, "does not dispatch its attention through transformers' AttentionInterface"),
    ("no-weights", {}, r"no weights \(model.safetensors or model.safetensors.index.json"),
    ("no-tokenizer", {}, "a text model without its tokenizer"),
    ("deit", {"mita_setting": {"num_landmarks": 5}}, "application args mita_setting: .*perfect "
                                                     "square"),
])
def test_deploy_refuses_what_it_cannot_serve(made, tmp_path, which, args, message):
    """What deploy and ``python -m service --check`` refuse (``served_config``), naming it."""
    folder = made.get(which)
    if folder is None:
        folder = tmp_path / which
        shutil.copytree(made["bert"], folder)
        (folder / ("model.safetensors" if which == "no-weights" else "tokenizer.json")).unlink()
        (folder / "vocab.txt").unlink(missing_ok=True)
    if which == "deberta":  # its head carries labels: the architecture is what is refused
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps(config | {"id2label": {"0": "a", "1": "b"},
                                                                 "label2id": {"a": 0, "b": 1}}))
    with pytest.raises(ValueError, match=message):
        _, cfg, _ = served_config({"checkpoint": str(folder), **args})
        ClassifierEngine(str(folder), "mita", "cpu")


def test_the_advisor_runs_on_a_folder(made, tmp_path, capsys):
    """``python -m profiler advise DIR --data FILE``: the folder's labelled rows (its own
    tokenizer), dense against a MiTA setting through the serving code; an N past the
    positions is a usage error naming them."""
    rows = (EXAMPLES / "austen-persuasion.tsv").read_text().splitlines()
    pick = [r for r in rows[1:] if r.startswith("Persuasion")][:4] + [
        r for r in rows[1:] if r.startswith("other")][:4]
    data = tmp_path / "short.tsv"
    data.write_text("label\ttext\n" + "\n".join(r[:160] for r in pick) + "\n")
    out = tmp_path / "advise"
    profiler_main(["advise", str(made["bert"]), "--data", str(data), "--n", "64", "--grid",
                   "4x4", "--repeats", "1", "--out", str(out)])
    report = json.loads((out / "advise.json").read_text())
    assert [r["setting"] for r in report["rows"]] == ["dense", "m4 k4 s1 paper"]
    assert report["rows"][0]["agreement"] == 1.0
    with pytest.raises(SystemExit) as e:
        profiler_main(["advise", str(made["bert"]), "--data", str(data), "--n", "600",
                       "--out", str(tmp_path / "again")])
    assert e.value.code == 2
    assert "--n 600: sequence length N = 600 exceeds this model's 512 positions" in \
        capsys.readouterr().err
