"""Fine-tuning a transformers model folder with ``python -m mita.training --model DIR``
(``mita.training.pretrained``): the four ways of ``--compare`` on one budget, one run per
attention, text (BERT, ModernBERT at 4,096 tokens) and images (ViT), each saved the
transformers way and loaded back; and the command's refusals. Tiny random-initialised
models (``tests/pretrained_folders.py``): these tests check what is run and written, not
what accuracy a real model reaches (``benchmarks/RESULTS.md`` has MiniLM's)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
os.environ["HF_HUB_OFFLINE"] = "1"

from safetensors.torch import load_file  # noqa: E402

from mita.training.train import main  # noqa: E402

from .. import pretrained_folders as folders  # noqa: E402

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.fixture(scope="module")
def text_rows(tmp_path_factory):
    """60 rows of the shipped Persuasion sample, both classes: 48 to train, 12 to validate."""
    lines = (EXAMPLES / "austen-persuasion.tsv").read_text().splitlines()
    header, rows = lines[0], lines[1:]
    pick = [r for r in rows if r.startswith("Persuasion")][:20] + [
        r for r in rows if r.startswith("other")][:40]
    folder = tmp_path_factory.mktemp("rows")
    (folder / "train.tsv").write_text("\n".join([header] + pick[:16] + pick[20:52]) + "\n")
    (folder / "valid.tsv").write_text("\n".join([header] + pick[16:20] + pick[52:]) + "\n")
    return folder


def test_compare_runs_the_four_ways_on_one_budget(tmp_path, text_rows):
    model = folders.bert(tmp_path / "bert")
    out = tmp_path / "out"
    report = main(["--model", str(model), "--train", str(text_rows / "train.tsv"),
                   "--valid", str(text_rows / "valid.tsv"), "--out", str(out), "--compare",
                   "--steps", "4", "--batch-size", "8", "--setting", "4x8", "--seed", "3"])
    rows = {r["way"]: r for r in report["rows"]}
    assert list(rows) == ["dense", "drop-in", "fine-tuned", "mita"]
    assert [rows[w]["attention"] for w in rows] == ["dense", "mita", "mita", "mita"]
    # fine-tuned: the dense run's 4 steps, then --finetune-share 0.25 × 4 = 1 more with MiTA
    assert [rows[w]["steps"] for w in rows] == [4, 4, 5, 4]
    assert rows["dense"]["agreement"] == 1.0 and report["valid_rows"] == 12
    assert report["labels"] == ["Persuasion", "other"]
    assert report["setting"]["num_landmarks"] == 4 and report["setting"]["topk"] == 8
    assert json.loads((out / "compare.json").read_text())["rows"][0]["way"] == "dense"
    assert (out / "compare.png").stat().st_size > 1000
    assert "transformers model folder" in (out / "compare.md").read_text()
    # the activation estimate at the p99 length: dense holds N × N scores per head, MiTA not
    assert 0 < rows["mita"]["activation_bytes_p99"] < rows["dense"]["activation_bytes_p99"]
    assert rows["drop-in"]["activation_bytes_p99"] == rows["mita"]["activation_bytes_p99"]
    assert "activation memory at N = " in (out / "compare.md").read_text()
    weights = {w: load_file(out / "ways" / w / "model.safetensors") for w in rows}
    key = "bert.encoder.layer.0.attention.self.query.weight"
    assert torch.equal(weights["drop-in"][key], weights["dense"][key])  # swapped, untrained
    assert not torch.equal(weights["fine-tuned"][key], weights["dense"][key])
    assert not torch.equal(weights["mita"][key], weights["dense"][key])
    original = load_file(model / "model.safetensors")[key]
    assert not torch.equal(weights["dense"][key], original)  # it did train
    config = json.loads((out / "ways" / "mita" / "config.json").read_text())
    assert config["id2label"] == {"0": "Persuasion", "1": "other"}
    assert config["mita"]["num_landmarks"] == 4
    assert (out / "ways" / "mita" / "tokenizer.json").is_file()


def test_one_run_each_way_text_and_image(tmp_path, text_rows):
    from transformers import AutoModelForImageClassification, AutoModelForSequenceClassification

    bert = folders.bert(tmp_path / "bert")
    for mode in ("mita", "dense"):
        record = main(["--model", str(bert), "--train", str(text_rows / "train.tsv"),
                       "--out", str(tmp_path / mode), "--mode", mode, "--steps", "2",
                       "--batch-size", "8"])
        assert record["mode"] == mode and record["steps"] == 2
        assert record["valid"]["rows"] == 5  # --valid-share 0.1 of 48 rows
        assert AutoModelForSequenceClassification.from_pretrained(tmp_path / mode).config.mita
    for kind in ("vit", "deit"):
        image_model = folders.vit(tmp_path / kind, deit=kind == "deit")
        for mode in ("mita", "dense"):
            out = tmp_path / f"{kind}-{mode}"
            record = main(["--model", str(image_model), "--train",
                           str(EXAMPLES / "fashion-mnist-14x14.jsonl"), "--out", str(out),
                           "--mode", mode, "--steps", "2", "--batch-size", "8"])
            assert record["steps"] == 2 and record["valid"]["rows"] == 10
            again = AutoModelForImageClassification.from_pretrained(out)
            assert again.config.mita["landmark_grid"] == [7, 7]
            assert len(again.config.id2label) == len(record["valid"]["per_class"]) == 10


@pytest.mark.parametrize("mode", ["mita", "dense"])
def test_modernbert_fine_tunes_at_4096_tokens(tmp_path, mode):
    model = folders.modernbert(tmp_path / "modernbert")
    rows = ["label\ttext"] + [f"{'ab'[i % 2]}\t" + ("the cat sat. " if i % 2 else
                                                     "a dog ran! ") * 500 for i in range(4)]
    (tmp_path / "long.tsv").write_text("\n".join(rows) + "\n")
    record = main(["--model", str(model), "--train", str(tmp_path / "long.tsv"),
                   "--valid", str(tmp_path / "long.tsv"), "--out", str(tmp_path / "out"),
                   "--mode", mode, "--steps", "1", "--batch-size", "2", "--setting", "32x64"])
    assert record["steps"] == 1 and record["valid"]["rows"] == 4
    assert record["train_tokens"]["max"] == record["train_tokens"]["limit"] == 4096  # cut
    assert record["last_loss"] == record["last_loss"]  # a number: the backward ran


@pytest.mark.parametrize("argv,message", [
    (["--setting", "4x4"], "--setting is the MiTA setting of a --model folder"),
    (["--model", "{bert}", "--resume"], "--resume is not for --model"),
    (["--model", "{trained}"], r"its head was trained on labels \['spam', 'ham'\], the data "
                               r"has \['Persuasion', 'other'\]"),
    (["--model", "{deberta}"], "does not dispatch its attention"),
    (["--model", "{bert}", "--setting", "4x"], "setting '4x' is not MxK"),
])
def test_refusals_are_usage_errors_naming_the_problem(tmp_path, text_rows, capsys, argv,
                                                       message):
    made = {"bert": folders.bert(tmp_path / "bert"),
            "trained": folders.bert(tmp_path / "trained", labels=["spam", "ham"]),
            "deberta": folders.deberta(tmp_path / "deberta")}
    argv = [a.format(**made) for a in argv]
    with pytest.raises(SystemExit) as e:
        main([*argv, "--train", str(text_rows / "train.tsv"), "--out", str(tmp_path / "o")])
    assert e.value.code == 2
    assert pytest.importorskip("re").search(message, capsys.readouterr().err)


def test_a_float16_folder_fine_tunes_in_float32_and_heads_are_seeded(tmp_path, text_rows):
    # a float16 model fine-tuned in float16 went to NaN weights with exit 0 (a new user's
    # report); the new head was drawn unseeded, so two ways of --compare started apart
    from transformers import BertForSequenceClassification

    half = folders.bert(tmp_path / "bert")
    BertForSequenceClassification.from_pretrained(half).half().save_pretrained(half)
    out = tmp_path / "out"
    main(["--model", str(half), "--train", str(text_rows / "train.tsv"), "--valid",
          str(text_rows / "valid.tsv"), "--out", str(out), "--compare", "--steps", "1",
          "--batch-size", "4", "--lr", "1e-12"])
    ways = {w: load_file(out / "ways" / w / "model.safetensors") for w in ("dense", "mita")}
    for w in ways.values():
        assert all(t.dtype == torch.float32 and torch.isfinite(t).all() for t in w.values())
    # the same seed, the same initial head: one step at lr 1e-12 moves it by ~1e-12
    head = "classifier.weight"
    assert (ways["dense"][head] - ways["mita"][head]).abs().max() < 1e-6
    assert ways["dense"][head].abs().max() > 1e-3


def test_text_is_cut_to_the_positions_and_the_cut_counted(tmp_path, text_rows):
    model = folders.bert(tmp_path / "bert", max_positions=64)
    record = main(["--model", str(model), "--train", str(text_rows / "train.tsv"), "--out",
                   str(tmp_path / "o"), "--mode", "dense", "--steps", "1"])
    tokens = record["train_tokens"]
    assert tokens["limit"] == 64 and tokens["max"] == 64 and tokens["cut_train_rows"] > 0


def test_roberta_positions_hold_two_fewer_tokens():
    from transformers import RobertaConfig, RobertaForSequenceClassification

    from mita.pretrained.folder import max_tokens

    cfg = RobertaConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1,
                        num_attention_heads=2, intermediate_size=32,
                        max_position_embeddings=514, pad_token_id=1)
    assert max_tokens(RobertaForSequenceClassification(cfg)) == 512


@pytest.mark.parametrize("argv,message", [
    (["--model", "{bert}", "--num-landmarks", "4"], "--num-landmarks is for the product's own "
                                                    "encoder"),
    (["--model", "{bert}", "--mode", "mixed"], "--mode mixed trains the product's own"),
    (["--model", "{bert}", "--finetune-share", "0.5"], "--finetune-share is the fine-tuned"),
    (["--model", "{bert}", "--landmark-grid", "4x4"], "--landmark-grid is for image models"),
    (["--model", "{vit}", "--landmark-grid", "9x9"], "more cells than the model's 7×7"),
    (["--model", "{bert}", "--max-len", "600"], "--max-len 600: the model's positions allow "
                                                "512"),
    (["--model", "{decoder}"], "a decoder or cross-attention config"),
    (["--model", "{vit}", "--train", "{big}"], r"big\.jsonl:\d: an image row of 784 pixels; "
                                               r"the model takes 14×14 images"),
    (["--model", "{bert}", "--train", "{one}"], r"one class only \('a'\)"),
])
def test_more_refusals(tmp_path, text_rows, capsys, argv, message):
    made = {"bert": folders.bert(tmp_path / "bert"), "vit": folders.vit(tmp_path / "vit"),
            "decoder": folders.bert(tmp_path / "decoder", is_decoder=True),
            "big": tmp_path / "big.jsonl", "one": tmp_path / "one.tsv"}
    made["big"].write_text("".join(json.dumps({"ids": [1 + i] * 784, "label": "xy"[i % 2]})
                                   + "\n" for i in range(6)))
    made["one"].write_text("label\ttext\n" + "a\tsome text here\n" * 6)
    argv = [a.format(**made) for a in argv]
    if "--train" not in argv:
        argv += ["--train", str(text_rows / "train.tsv")]
    with pytest.raises(SystemExit) as e:
        main([*argv, "--out", str(tmp_path / "o"), "--steps", "1"])
    assert e.value.code == 2
    assert pytest.importorskip("re").search(message, capsys.readouterr().err)
