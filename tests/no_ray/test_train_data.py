"""Training on a user's file (``python -m mita.training --train FILE``): what the checkpoint folder
holds, the refusals of the command line, a resumed run equal to an unbroken one, and the
three ways compared. Tiny models and budgets: what is checked is the bookkeeping, exactly."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from mita.config import ModelConfig, checkpoint_config, checkpoint_metadata
from mita.data.task import checkpoint_task
from mita.model import load_checkpoint
from mita.training.fit import Run, fit
from mita.training.train import main as train_main
from mita.training.train_data import fresh

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--dim", "16", "--ffn-dim", "32", "--num-heads", "2", "--depth", "1",
        "--num-landmarks", "4", "--topk", "4", "--threads", "1", "--batch-size", "8"]


def reviews(tmp_path, n=60, seed=0):
    """A small real-looking TSV: two classes told apart by their words."""
    rng = random.Random(seed)
    words = {"good": ["great", "fine", "superb"], "bad": ["awful", "poor", "dull"]}
    lines = ["label\ttext"]
    for _ in range(n):
        lab = rng.choice(["good", "bad"])
        lines.append(lab + "\t" + " ".join(rng.choice(words[lab] + ["the", "plot"])
                                           for _ in range(rng.randint(4, 12))))
    path = tmp_path / "reviews.tsv"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_a_tsv_becomes_a_checkpoint_with_its_task_and_data_card(tmp_path, capsys):
    data, out = reviews(tmp_path), tmp_path / "ck"
    metrics = train_main(["--train", str(data), "--out", str(out), "--steps", "6",
                          "--eval-every", "3", "--valid-share", "0.25", "--max-len", "40",
                          "--task-name", "film reviews", *TINY])
    meta = checkpoint_metadata(out)
    cfg = checkpoint_config(out)
    assert (cfg.vocab_size, cfg.num_classes, cfg.pad_id) == (257, 2, 0)
    task = checkpoint_task(meta, cfg, out)
    assert (task.name, task.labels, task.tokenizer.kind, task.max_length, task.truncate) == (
        "film reviews", ("bad", "good"), "bytes", 40, "tail")
    assert meta["id2label"] == {"0": "bad", "1": "good"}
    assert meta["label2id"] == {"bad": 0, "good": 1}
    card = json.loads((out / "data_card.json").read_text())
    assert card["rows"] == {"train": 45, "valid": 15}  # round(0.25 × 60)
    assert sum(card["class_counts"]["train"].values()) == 45
    assert card["split"] == {"valid_share": 0.25, "seed": 0}
    assert card["files"][0]["rows"] == 60 and len(card["files"][0]["sha256"]) == 64
    assert set(card["valid_accuracy"]) == {"dense", "mita"}
    assert card["valid_accuracy"] == meta["training"]["valid_accuracy"] == (
        metrics["val_history"][-1]["val_accuracy"])
    assert [h["step"] for h in metrics["val_history"]] == [3, 6]
    assert metrics["tokens_per_s"] > 0 and metrics["steps"] == 6
    # the checkpoint loads, and no training state is left behind
    assert load_checkpoint(out).config == cfg
    assert not (out / "train_state.json").exists()
    assert "45 training and 15 validation rows, 2 classes: bad " in capsys.readouterr().out


@pytest.mark.parametrize("argv,why", [
    (["--valid", "v.tsv", "--valid-share", "0.2"], "--valid and --valid-share: give one"),
    (["--train-size", "10"], "--train-size is for generated ListOps; with --train the data "
                             "is your file"),
    (["--compare", "--resume"], "--resume resumes one training run; --compare runs five"),
    (["--landmark-grid", "2x3"], "reviews.tsv:2: "),
    (["--valid-share", "1"], "--valid-share must be in (0, 1), got 1.0"),
    (["--valid-share", "0"], "argument --valid-share: 0 is outside (0.0, 1.0]"),
])
def test_refusals_of_the_command_line(tmp_path, capsys, argv, why):
    data = reviews(tmp_path)
    with pytest.raises(SystemExit) as e:
        train_main(["--train", str(data), "--out", str(tmp_path / "o"), *argv, *TINY])
    assert e.value.code == 2
    assert why in capsys.readouterr().err


def test_refusals_name_the_file(tmp_path, capsys):
    with pytest.raises(SystemExit):
        train_main(["--train", str(tmp_path / "none.tsv"), "--out", str(tmp_path / "o")])
    assert capsys.readouterr().err.endswith(
        f"python -m mita.training: error: {tmp_path}/none.tsv: No such file or directory\n")
    with pytest.raises(SystemExit):
        train_main(["--train", str(reviews(tmp_path)), "--out", str(tmp_path / "o"),
                    "--landmark-grid", "2x3"])
    err = capsys.readouterr().err
    assert "but --landmark-grid 2x3 needs 6" in err
    with pytest.raises(SystemExit):  # own-data flags without --train
        train_main(["--out", str(tmp_path / "o"), "--max-len", "9"])
    assert "--max-len needs --train FILE" in capsys.readouterr().err


def test_a_resumed_run_ends_where_an_unbroken_one_does(tmp_path):
    """Stopped by its time budget at step 3 of 8 (a clock that jumps), then resumed from its
    saved state into other weights: the same weights, bit for bit, as 8 steps in one go."""
    cfg = ModelConfig(vocab_size=20, num_classes=3, dim=16, depth=1, num_heads=2, ffn_dim=32,
                      num_landmarks=4, topk=4)
    rng = random.Random(1)
    data = [([rng.randint(1, 19) for _ in range(rng.randint(5, 15))], rng.randint(0, 2))
            for _ in range(40)]
    run = Run("mixed", steps=8, batch_size=8, time_budget_min=1.0, eval_every=4, seed=2)
    whole = fresh(cfg, 2, "mixed")
    fit(whole, run, data, data[:8])
    # fit reads the clock at its start, after every step and at its end: late after step 3
    ticks = iter([0.0, 0.0, 0.0, 1e9, 1e9])
    cut = fit(fresh(cfg, 2, "mixed"), run, data, data[:8], state_dir=tmp_path,
              clock=lambda: next(ticks))
    assert cut.steps == 3 and [h["step"] for h in cut.history] == [3]
    assert (tmp_path / "train_state.safetensors").is_file()
    again = fresh(cfg, 99, "mixed")  # other weights: all of them come from the state
    rest = fit(again, run, data, data[:8], state_dir=tmp_path, resume=True,
               clock=lambda: 0.0)
    assert rest.steps == 8 and [h["step"] for h in rest.history] == [3, 4, 8]
    for (name, a), (_, b) in zip(whole["mita"].state_dict().items(),
                                 again["mita"].state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    other = Run(**run.__dict__ | {"lr": 0.5})
    with pytest.raises(ValueError, match=r"saved by a run with other settings \(lr\)"):
        fit(fresh(cfg, 2, "mixed"), other, data, data[:8], state_dir=tmp_path, resume=True)


def test_the_three_ways_side_by_side(tmp_path):
    data, out = reviews(tmp_path, n=48), tmp_path / "cmp"
    metrics = train_main(["--train", str(data), "--out", str(out), "--steps", "4",
                          "--eval-every", "4", "--compare", "--finetune-share", "0.5", *TINY])
    report = json.loads((out / "compare.json").read_text())
    rows = report["rows"]
    assert [(r["way"], r["attention"], r["steps"]) for r in rows] == [
        ("dense", "dense", 4), ("drop-in", "mita", 4), ("fine-tuned", "mita", 6),
        ("mita", "mita", 4), ("mixed", "mita", 4), ("mixed", "dense", 4)]
    assert rows[0]["retention"] == 1.0 and rows[0]["agreement"] == 1.0
    for r in rows:
        assert r["retention"] == pytest.approx(r["accuracy"] / rows[0]["accuracy"], rel=1e-12)
        assert r["forward_ms_p50"] > 0 and r["forward_ms_p99"] > 0
    # the dense rows time dense attention, the others MiTA: one timing per attention and N
    assert rows[0]["forward_ms_p50"] == rows[5]["forward_ms_p50"]
    assert rows[1]["forward_ms_p99"] == rows[3]["forward_ms_p99"]
    assert report["budget"] == {"steps": 4, "time_budget_min": 25.0, "finetune_steps": 2,
                                "batch_size": 8, "seed": 0}
    assert metrics["compare"] == rows
    md = (out / "compare.md").read_text()
    # the scores table and the F1-per-class table: a header and six rows each
    assert md.count("\n| ") == 14 and "| fine-tuned | mita | 6 |" in md
    assert (out / "compare.png").stat().st_size > 0
    # the served checkpoint is the --mode run's (mixed): its accuracy is that row's
    meta = checkpoint_metadata(out)
    assert meta["training"]["valid_accuracy"]["mita"] == rows[4]["accuracy"]
    assert meta["training"]["valid_accuracy"]["dense"] == rows[5]["accuracy"]
    # every way's weights are kept, each a checkpoint with the task, named in compare.md;
    # loaded again, each scores its row's accuracy on the same validation rows
    from mita.data import labelled
    from mita.training.fit import evaluate
    from mita.training.train_data import WAYS

    assert sorted(p.name for p in (out / "ways").iterdir()) == sorted(WAYS)
    val = labelled.load(data).encoded("valid")  # the command's split: share 0.1, seed 0
    for r in rows:
        folder = out / "ways" / r["way"]
        assert r["checkpoint"] == str(folder) and f"- {r['way']}: `{folder}`" in md
        ck = load_checkpoint(folder, attention=r["attention"])
        task = checkpoint_task(checkpoint_metadata(folder), ck.config, folder)
        assert task.labels == ("bad", "good")
        assert (checkpoint_config(folder).attention == "dense") is (r["way"] == "dense")
        assert evaluate(ck, val) == r["accuracy"]


def test_init_starts_from_a_checkpoints_weights(tmp_path, capsys):
    """``--init``: a dense-trained checkpoint's weights, fine-tuned with MiTA (one step at a
    learning rate of 1e-12: the weights stay where they started, to float32 precision)."""
    data = reviews(tmp_path)
    base = ["--train", str(data), "--steps", "3", "--eval-every", "3", *TINY]
    train_main([*base, "--out", str(tmp_path / "dense"), "--mode", "dense"])
    train_main([*base, "--out", str(tmp_path / "tuned"), "--mode", "mita", "--steps", "1",
                "--lr", "1e-12", "--init", str(tmp_path / "dense")])
    before = load_checkpoint(tmp_path / "dense").state_dict()
    after = load_checkpoint(tmp_path / "tuned").state_dict()
    assert all(torch.allclose(before[k], after[k], atol=1e-6) for k in before)
    assert load_checkpoint(tmp_path / "tuned").config.attention == "mita"
    with pytest.raises(SystemExit):
        train_main([*base, "--out", str(tmp_path / "x"), "--dim", "32", "--init",
                    str(tmp_path / "dense")])
    assert capsys.readouterr().err.endswith(f"error: --init {tmp_path}/dense: its model config "
                                            "differs in dim\n")


def test_the_advisor_reads_your_file_with_the_checkpoints_task(tmp_path):
    """``python -m profiler advise DIR --data FILE``: the file's label names indexed by the
    checkpoint's, its text tokenized by the checkpoint's tokenizer; a name it does not know
    is refused with its line."""
    from profiler import advise
    from profiler.advise_config import AdviseConfig, Constraint

    data = reviews(tmp_path)
    train_main(["--train", str(data), "--out", str(tmp_path / "ck"), "--steps", "2",
                "--eval-every", "2", *TINY])
    cfg = AdviseConfig(checkpoint=str(tmp_path / "ck"), ns=[64], grid=[],
                       constraint=Constraint("agreement", 0.9), data=str(data),
                       data_format="own", size=5)
    rows = advise.load_data(cfg, 2)
    lines = data.read_text().splitlines()[1:6]
    assert rows == [([b + 1 for b in text.encode()], ["bad", "good"].index(label))
                    for label, text in (ln.split("\t") for ln in lines)]
    other = tmp_path / "other.tsv"
    other.write_text("good\tfine\nugly\tno\n")
    with pytest.raises(ValueError) as e:
        advise.load_data(AdviseConfig(**cfg.__dict__ | {"data": str(other)}), 2)
    assert str(e.value) == (f"{other}:2: label 'ugly' is not in the checkpoint's labels (2: "
                            "bad, good)")


def test_a_subword_tokenizer_learned_from_the_training_split_travels_with_the_checkpoint(
        tmp_path):
    """``--subword-vocab``: sentencepiece pieces learned from the training windows of the
    Austen sample; every validation text round-trips exactly, the checkpoint's task loads the
    model file beside config.json, and it survives pickling (how Ray hands it to the
    gateway)."""
    import pickle

    from mita.data import labelled

    out = tmp_path / "sp"
    train_main(["--train", str(ROOT / "examples/austen-512.tsv"), "--valid",
                str(ROOT / "examples/austen-512-valid.tsv"),
                "--out", str(out), "--steps", "2", "--eval-every", "2", "--subword-vocab",
                "400", *TINY])
    meta = checkpoint_metadata(out)
    assert meta["task"]["tokenizer"] == {"kind": "sentencepiece", "file": "tokenizer.model",
                                         "vocab_size": 400}
    task = checkpoint_task(meta, checkpoint_config(out), out)
    assert checkpoint_config(out).vocab_size == 400 and task.tokenizer.kind == "sentencepiece"
    texts = [line.split("\t", 1)[1] for line in
             (ROOT / "examples/austen-512-valid.tsv").read_text().splitlines()[1:]]
    tok = pickle.loads(pickle.dumps(task.tokenizer))
    for text in texts + ["  two  spaces,\ta tab and é 😀 "]:
        ids = tok.encode(text)
        assert tok.decode(ids) == text and 0 not in ids and max(ids) < 400
    # fewer tokens than bytes, what a subword tokenizer is for: 5,769 for 9,216 bytes (0.63)
    # with sentencepiece 0.2.3's 400 pieces from 37 KB of text; 0.7 leaves room for another
    # release's pieces, and a byte-level tokenizer is 1.0
    n_bytes = sum(len(t.encode()) for t in texts)
    assert sum(len(tok.encode(t)) for t in texts) < 0.7 * n_bytes
    card = json.loads((out / "data_card.json").read_text())
    assert card["tokenizer"] == meta["task"]["tokenizer"]
    assert card["length_tokens"]["valid"]["max"] == max(len(tok.encode(t)) for t in texts)
    ids = tmp_path / "ids.jsonl"
    ids.write_text('{"ids": [1, 2], "label": "a"}\n{"ids": [3], "label": "b"}\n')
    with pytest.raises(ValueError, match=r"--subword-vocab is for text data; these rows are ids"):
        labelled.load(ids, subword_vocab=50)
    with pytest.raises(ValueError, match=r"^--subword-vocab 100000: "):
        labelled.load(ROOT / "examples/austen-512.tsv", subword_vocab=100_000)
