"""Your own data, measured honestly: the scores beside accuracy (``mita.tools.scores``) pinned
against scikit-learn's own, the shipped skewed sample (``examples/austen-persuasion*.tsv``:
Austen's paragraphs, Persuasion against the other five novels, 10 % minority) through
training, ``--compare`` and ``python -m mita.training.evaluate --data``, and the silent
behaviours of issue 61 with their exact messages."""

from __future__ import annotations

import io
import json
import random
from pathlib import Path

import numpy as np
import pytest
from sklearn.metrics import (
    balanced_accuracy_score,
    classification_report,
    confusion_matrix,
    f1_score,
)

from mita.config import ModelConfig
from mita.data import labelled
from mita.tools.progress import Progress
from mita.tools.scores import _bootstrap, classification_scores, score_warnings
from mita.training.evaluate import main as evaluate_main
from mita.training.fit import Run, fit
from mita.training.train import main as train_main
from mita.training.train_data import fresh

ROOT = Path(__file__).resolve().parents[2]
TRAIN = ROOT / "examples/austen-persuasion.tsv"
VALID = ROOT / "examples/austen-persuasion-valid.tsv"
TINY = ["--dim", "16", "--ffn-dim", "32", "--num-heads", "2", "--depth", "1",
        "--num-landmarks", "4", "--topk", "4", "--threads", "1", "--batch-size", "16"]
MAJORITY_ONLY = ("the model answers 'other' for all 189 validation rows: it has learned no "
                 "distinction between the classes")
WITHIN = ("validation accuracy 89.9 % ± 2.2 % is within 1.96 standard errors of the majority "
          "rate 89.9 % (always answering 'other'): accuracy says nothing here; read macro-F1, "
          "balanced accuracy and the per-class recall")


def test_scores_equal_scikit_learns_own():
    rng = np.random.default_rng(7)
    t = rng.integers(0, 4, 300)
    p = np.where(rng.random(300) < 0.55, t, rng.integers(0, 3, 300))  # class 3 never predicted
    names = ["w", "x", "y", "z"]
    s = classification_scores(t.tolist(), p.tolist(), names)
    rep = classification_report(t, p, labels=[0, 1, 2, 3], output_dict=True, zero_division=0)
    for i, row in enumerate(s["per_class"]):
        assert row["label"] == names[i]
        for k in ("precision", "recall", "f1-score", "support"):
            assert row[k.split("-")[0]] == rep[str(i)][k]
    assert s["accuracy"] == rep["accuracy"] == float((t == p).mean())
    assert s["accuracy_se"] == pytest.approx(np.sqrt(s["accuracy"] * (1 - s["accuracy"]) / 300),
                                             rel=1e-15)
    assert s["macro_f1"] == f1_score(t, p, average="macro", zero_division=0)
    assert s["balanced_accuracy"] == balanced_accuracy_score(t, p)
    assert s["confusion_matrix"] == confusion_matrix(t, p).tolist()
    counts = np.bincount(t, minlength=4)
    assert s["majority_label"] == names[counts.argmax()]
    assert s["majority_rate"] == counts.max() / 300
    assert s["predicted_counts"] == {n: int((p == i).sum()) for i, n in enumerate(names)}
    # each bootstrap resample is scored as scikit-learn scores it (the same resampled rows:
    # numpy's seeded generator drawn as _bootstrap draws); float sums in another order: 1e-12
    boot = _bootstrap(t, p, 4, 50, seed=3)
    idx = np.random.default_rng(3).integers(0, 300, size=(50, 300))
    for r in range(50):
        assert boot["macro_f1"][r] == pytest.approx(
            f1_score(t[idx[r]], p[idx[r]], average="macro", zero_division=0), abs=1e-12)
        assert boot["balanced_accuracy"][r] == pytest.approx(
            balanced_accuracy_score(t[idx[r]], p[idx[r]]), abs=1e-12)
    assert s["macro_f1_ci95"][0] < s["macro_f1"] < s["macro_f1_ci95"][1]
    assert score_warnings(s) == []
    # below the majority rate by more than 1.96 SE, and a class without rows (predicted):
    # said in the project's words, scikit-learn's own UserWarning kept out of the output
    t2, p2 = [0] * 8 + [1] * 2, [1] * 7 + [2] + [1, 1]
    with __import__("warnings").catch_warnings():
        __import__("warnings").simplefilter("error")
        low = classification_scores(t2, p2, ["a", "b", "c"])
    assert low["per_class"][2]["support"] == 0
    assert score_warnings(low, "v.tsv") == [
        "v.tsv accuracy 20.0 % ± 12.6 % is below the majority rate 80.0 % by more than 1.96 "
        "standard errors: always answering 'a' would score more",
        "1 class(es) have no v.tsv rows ('c'): their recall is not measured here, and macro-F1 "
        "counts each one the model predicted as an F1 of 0"]
    with pytest.raises(ValueError, match="a class index outside the 4 labels"):
        classification_scores([0, 4], [0, 1], names)


def test_the_skewed_sample_through_training_evaluation_and_compare(tmp_path, capsys):
    """A tiny model on 8 steps answers the majority class ('other', 89.9 % of the validation
    rows) for everything: training, ``mita.training.evaluate`` and ``--compare`` say so, and every
    score they print is scikit-learn's on the predictions ``mita.training.evaluate`` writes."""
    out = tmp_path / "ck"
    metrics = train_main(["--train", str(TRAIN), "--valid", str(VALID), "--out", str(out),
                          "--steps", "8", "--eval-every", "8", "--max-len", "128", *TINY])
    printed = capsys.readouterr()
    assert "| Persuasion | 0.000 | 0.000 | 0.000 | 19 |" in printed.out
    assert "| other | 0.899 | 1.000 | 0.947 | 170 |" in printed.out
    assert "majority rate 89.9 % ('other'), 189 rows" in printed.out
    for a in ("mita", "dense"):
        assert f"warning: {a}: {MAJORITY_ONLY}\n" in printed.err
        assert f"warning: {a}: {WITHIN}\n" in printed.err
    assert ("warning: class 'other' is 89.9 % of the training rows and 89.9 % of the "
            "validation rows: always answering it scores that much on validation; read "
            "macro-F1, balanced accuracy and the per-class recall beside accuracy\n"
            ) in printed.err
    card = json.loads((out / "data_card.json").read_text())
    assert card["valid_scores"] == metrics["valid_scores"]
    assert f"mita: {MAJORITY_ONLY}" in card["warnings"]

    preds = tmp_path / "pred.jsonl"
    rows = evaluate_main([str(out), "--data", str(VALID), "--predictions", str(preds),
                          "--json", str(tmp_path / "ev.json")])
    printed = capsys.readouterr().out
    long = sum(len(x.split("\t", 1)[1].encode()) > 128 for x in VALID.read_text().splitlines()[1:])
    assert long == 149  # of the 189 paragraphs, byte-level tokens
    assert f"{out}: 149 of 189 rows were longer than the trained length 128" in printed
    assert f"warning: {out} [mita]: the model answers 'other' for all 189 " in printed
    lines = [json.loads(x) for x in preds.read_text().splitlines()]
    assert len(lines) == 2 * 189
    truth = [x.split("\t", 1)[0] for x in VALID.read_text().splitlines()[1:]]
    for r in rows:
        mine = [x for x in lines if x["attention"] == r["attention"]]
        assert [x["true_label"] for x in mine] == truth
        assert [x["line"] for x in mine] == list(range(2, 191))
        assert all(abs(sum(x["probabilities"]) - 1) < 1e-5 for x in mine)  # 6-digit rounding
        pred = [x["label_name"] for x in mine]
        s = r["scores"]
        f1 = f1_score(truth, pred, labels=["Persuasion", "other"], average=None,
                      zero_division=0)
        assert [c["f1"] for c in s["per_class"]] == f1.tolist()
        assert s["macro_f1"] == f1_score(truth, pred, average="macro", zero_division=0)
        assert s["balanced_accuracy"] == balanced_accuracy_score(truth, pred)
        assert s["majority_rate"] == truth.count("other") / 189
        # what training measured on the same rows, cut the same way, is what evaluation says
        assert s == metrics["valid_scores"][r["attention"]]

    # the advisor on the same checkpoint and file: the same scores (rows cut alike), per-class
    # F1 and the majority rate in its report, the majority-only model warned about
    from profiler.__main__ import main as profiler_main

    profiler_main(["advise", str(out), "--data", str(VALID), "--n", "64", "--grid", "4x4",
                   "--repeats", "1", "--out", str(tmp_path / "adv")])
    capsys.readouterr()
    adv = json.loads((tmp_path / "adv/advise.json").read_text())
    assert adv["rows"][0]["setting"] == "dense"
    assert adv["rows"][0]["scores"] == {r["attention"]: r["scores"] for r in rows}["dense"]
    md = (tmp_path / "adv/advise.md").read_text()
    assert "| Persuasion | 19 | 0.000 |" in md and "| other | 170 | 0.947 |" in md
    assert "Majority rate of the data: 89.9 % ('other')" in md
    assert f"- dense: the model answers 'other' for all 189 {VALID} rows: it has learned" in md

    cmp = tmp_path / "cmp"
    train_main(["--train", str(TRAIN), "--valid", str(VALID), "--out", str(cmp), "--steps",
                "2", "--eval-every", "2", "--max-len", "32", "--compare", "--keep-ways",
                "drop-in", *TINY])
    md = (cmp / "compare.md").read_text()
    assert md.startswith("Validation rows 189, majority rate 89.9 % ('other': what always "
                         "answering it scores); budget 2 steps of 16 or 25 min per run, ")
    assert "fine-tuning 1 step more;" in md
    assert "| way | attention | Persuasion | other |" in md
    assert f"- dense (dense): {MAJORITY_ONLY}" in md
    assert [p.name for p in (cmp / "ways").iterdir()] == ["drop-in"]
    report = json.loads((cmp / "compare.json").read_text())
    assert [r["checkpoint"] for r in report["rows"]] == [
        None, str(cmp / "ways/drop-in"), None, None, None, None]


def test_evaluate_refusals(tmp_path, capsys):
    def refused(argv):
        with pytest.raises(SystemExit) as e:
            evaluate_main(argv)
        assert e.value.code == 2
        return capsys.readouterr().err.splitlines()[-1]

    ck = str(ROOT / "checkpoints/fashion-mnist-14x14")
    assert refused([ck, "--data", str(VALID), "--test-size", "5"]) == (
        "python -m mita.training.evaluate: error: --test-size is for generated ListOps; with "
        "--data the test set is your file")
    assert refused([ck]) == (  # generated ListOps means nothing to an image model
        f"python -m mita.training.evaluate: error: {ck}: a checkpoint of task "
        "'fashion-mnist-14x14' (ids tokens), not ListOps: score it on your labelled file with "
        "--data FILE")
    assert refused([ck, "--predictions", "p.csv"]) == (
        "python -m mita.training.evaluate: error: --predictions needs --data FILE")
    # text rows for an ids (image) checkpoint: refused with the file and line
    assert refused([ck, "--data", str(VALID)]) == (
        f"python -m mita.training.evaluate: error: {VALID}:2: this model takes token ids "
        "('ids'), not text: it was trained on ids, so it has no tokenizer for text")
    other = tmp_path / "o.jsonl"
    other.write_text('{"ids": ' + json.dumps([5] * 196) + ', "label": "Boot"}\n')
    assert refused([ck, "--data", str(other)]) == (
        f"python -m mita.training.evaluate: error: {other}:1: label 'Boot' is not in the "
        "checkpoint's labels (10: Ankle boot, Bag, Coat, Dress, Pullover, …)")


def test_the_fashion_sample_scored_to_csv(tmp_path, capsys):
    """An ids checkpoint on an ids file; CSV predictions with a probability column per class
    name."""
    out = tmp_path / "p.csv"
    rows = evaluate_main([str(ROOT / "checkpoints/fashion-mnist-14x14"), "--data",
                          str(ROOT / "examples/fashion-mnist-14x14.jsonl"), "--predictions",
                          str(out)])
    head = out.read_text().splitlines()
    assert head[0].startswith("checkpoint,line,true_label,attention,label,label_name,"
                              "p_Ankle boot,p_Bag,")
    assert len(head) == 1 + 2 * 100
    # 75 of 100 with MiTA, as docs/own-data.md says of this sample (its config.json)
    acc = {r["attention"]: r["scores"]["accuracy"] for r in rows}
    assert round(100 * acc["mita"]) == 75
    import csv

    table = list(csv.DictReader(io.StringIO(out.read_text())))
    for r in rows:
        mine = [x for x in table if x["attention"] == r["attention"]]
        assert r["scores"]["accuracy"] == sum(x["label_name"] == x["true_label"]
                                              for x in mine) / 100
    capsys.readouterr()


def test_silent_classes_are_named_with_their_likely_cause(tmp_path):
    header = tmp_path / "h.tsv"
    header.write_text("class\tsequence\n" + "".join(f"{'ab'[i % 2]}\tt{i}\n" for i in range(20)))
    d = labelled.load(header, valid_share=0.1)
    assert [w for w in d.warnings if "'class'" in w] == [
        f"class 'class' has 1 training row (fewer than 5): its row {header}:1 looks like a "
        "header line ('class'<TAB>'sequence'): the only header read as one is "
        "'label<TAB>text'; rename the columns or delete the line"]
    stray = tmp_path / "s.jsonl"
    stray.write_text("".join(json.dumps({"text": f"t{i}", "label": 7 if i == 4 else "ab"[i % 2]})
                             + "\n" for i in range(20)))
    with pytest.raises(ValueError) as e:  # a header line in the validation file
        labelled.load(stray, header)
    assert str(e.value) == (f"{header}:1: label 'class' is not in the training data ({stray}); "
                            "line 1 looks like a header: the only header read as one is "
                            "'label<TAB>text'; rename the columns or delete the line")
    plain = tmp_path / "p.jsonl"
    plain.write_text('{"text": "v", "label": "a"}\n{"text": "w", "label": "b"}\n')
    assert labelled.load(stray, plain).warnings[-1] == (
        f"class '7' has 1 training row (fewer than 5): a stray label type: {stray}:5 has the "
        "JSON number 7 where the other rows' labels are strings; write it as the name it "
        "stands for")
    swapped = tmp_path / "w.tsv"
    swapped.write_text("".join(f"words of row {i}\t{'ab'[i % 2]}\n" for i in range(20)))
    with pytest.raises(ValueError) as e:
        labelled.load(swapped)
    assert str(e.value) == (f"{swapped}: the columns look swapped: 20 distinct labels in 20 "
                            "rows, while the text column holds only 2 distinct values ('a', "
                            "'b'); a row is label<TAB>text")
    good = tmp_path / "g.tsv"
    good.write_text("".join(f"{'ab'[i % 2]}\twords of row {i}\n" for i in range(20)))
    first = tmp_path / "f.tsv"  # swapped on line 1: the swap, not a header, is the cause
    first.write_text("words of a row\tb\n")
    with pytest.raises(ValueError) as e:
        labelled.load(good, first)
    assert str(e.value).endswith("its text 'b' is a label: are the columns swapped? A row is "
                                 "label<TAB>text")
    valid = tmp_path / "v.tsv"
    valid.write_text("a\tmore words\nwords of a row\tb\n")
    with pytest.raises(ValueError) as e:
        labelled.load(good, valid)
    assert str(e.value) == (f"{valid}:2: label 'words of a row' is not in the training data "
                            f"({good}); its text 'b' is a label: are the columns swapped? A "
                            "row is label<TAB>text")


def test_a_budget_stop_says_how_far_the_schedule_got(capsys):
    cfg = ModelConfig(vocab_size=20, num_classes=2, dim=16, depth=1, num_heads=2, ffn_dim=32,
                      num_landmarks=4, topk=4)
    rng = random.Random(1)
    data = [([rng.randint(1, 19) for _ in range(8)], rng.randint(0, 1)) for _ in range(16)]
    # fit reads the clock at its start and after every step: late after step 3 of 10
    ticks = iter([0.0, 0.0, 0.0, 1e9, 1e9])
    res = fit(fresh(cfg, 0, "dense"), Run("dense", steps=10, batch_size=8, time_budget_min=1,
                                          eval_every=100), data, data[:4],
              clock=lambda: next(ticks))
    stop = res.budget_stop
    assert (stop["step"], stop["steps"], stop["schedule_share"]) == (3, 10, 0.3)
    assert f"the one-cycle schedule ran 30 % of its length and stopped at learning rate " \
           f"{stop['lr']:.1e} (peak 1.0e-03) before annealing to its end" in capsys.readouterr().err


def test_progress_lines_in_a_log_at_a_steady_interval():
    log, now = io.StringIO(), [0.0]
    bar = Progress(10, "train[mita]", "step", file=log, interval_s=30, clock=lambda: now[0])
    for t in (10, 31, 45, 62):
        now[0] = t
        bar.phase(f"loss={t / 100:.3f}")
        bar.update()
    assert log.getvalue() == ("train[mita]: 2/10 step, 31 s, ETA 124 s, loss=0.310\n"
                              "train[mita]: 4/10 step, 62 s, ETA 93 s, loss=0.620\n")


def test_class_weight_balanced(tmp_path, capsys):
    metrics = train_main(["--train", str(TRAIN), "--valid", str(VALID), "--out",
                          str(tmp_path / "w"), "--steps", "1", "--eval-every", "1",
                          "--max-len", "16", "--class-weight", "balanced", *TINY])
    # scikit-learn's "balanced": rows / (classes × the class's rows): 425 / (2 × 43), / (2 × 382)
    assert metrics["class_weights"] == pytest.approx([425 / 86, 425 / 764], rel=1e-12)
    assert "class weights (balanced): Persuasion 4.942, other 0.556" in capsys.readouterr().out
