"""The advisor on your own data, measured honestly (issue 61): rows cut as training cut them,
scores beyond accuracy (``mita.tools.scores``) pinned against scikit-learn's own on the same
predictions, ``--metric`` choosing the score the constraint reads, and the warnings.

The crafted rows: 10 sequences, 8 of class ``neg`` and 2 of ``pos``. Dense answers every one
right; m4 (the faster setting) answers ``neg`` for all of them (accuracy 80 %, the majority
rate, but macro-F1 0.444); m16 gets one ``neg`` wrong (accuracy 90 %, macro-F1 0.867).
"""

from __future__ import annotations

import csv
import json
import math
from dataclasses import replace

import numpy as np
import pytest
import torch
from sklearn.metrics import accuracy_score, balanced_accuracy_score, f1_score

from mita.data import labelled
from mita.data.task import Task, label_maps
from mita.data.tokenizers import BYTES
from mita.data.vocab import Vocabulary
from mita.model import EncoderClassifier, ModelConfig, load_checkpoint, save_checkpoint
from mita.tools.scores import BOOTSTRAP_SEED, classification_scores, paired_bootstrap
from profiler import advise, advise_report, recommend
from profiler.advise_config import AdviseConfig, Constraint, Setting

REL = 1e-12  # float sums in another order than scikit-learn's: only the last bits may differ
RESAMPLES = 40  # bootstrap resamples of the crafted units: few, so scikit-learn can redo them
NAMES = ("neg", "pos")
Y = np.array([0] * 8 + [1] * 2)
PRED = {"dense": Y.copy(), "m4 k4 s1 paper": np.zeros(10, dtype=np.int64),
        "m16 k16 s1 paper": np.where(np.arange(10) == 0, 1, Y)}
M4, M16 = Setting(4, 4), Setting(16, 16)


def probs(pred: np.ndarray) -> np.ndarray:
    """Class probabilities whose argmax is ``pred`` (binary fractions)."""
    return np.where(pred[:, None] == np.arange(2), 0.75, 0.25)


def units() -> dict:
    """Finished units of the crafted rows: quality as ``run_advise`` records it, and N = 256
    timed with dense beside each setting (m4 4×, m16 2×)."""
    dense = probs(PRED["dense"])
    done = {}
    for name, pred in PRED.items():
        done[("quality", name)] = (advise.compare(dense, probs(pred), Y)
                                   | advise.metric_scores(dense, probs(pred), Y, NAMES,
                                                          RESAMPLES))
    for name, ms in ((M4.name, 1.0), (M16.name, 2.0)):
        done[("latency", name, 256)] = {
            "p50_ms": ms, "min_ms": ms, "max_ms": ms, "dense_p50_ms": 4.0, "stages_ms": {},
            "peak_memory_bytes": None, "peak_memory_kind": "x"}
    return done


def cfg_of(constraint: Constraint) -> AdviseConfig:
    return AdviseConfig(checkpoint="ckpt/x", ns=[256], grid=[M4, M16],
                        constraint=constraint, data="data.tsv", data_format="own",
                        dtype="float32", mita_backend="torch", repeats=3)


def sklearn_boot(pred_a, pred_b=None):
    """Macro-F1 and balanced accuracy of each resample (the same rows as ``mita.tools.scores``'
    bootstrap), by scikit-learn; with ``pred_b``, a's minus b's."""
    idx = np.random.default_rng(BOOTSTRAP_SEED).integers(0, len(Y), size=(RESAMPLES, len(Y)))
    out = {"macro_f1": [], "balanced_accuracy": []}
    for i in idx:
        for name, fn in (("macro_f1", lambda t, p: f1_score(t, p, average="macro",
                                                              zero_division=0)),
                         ("balanced_accuracy", balanced_accuracy_score)):
            x = fn(Y[i], pred_a[i])
            out[name].append(x - fn(Y[i], pred_b[i]) if pred_b is not None else x)
    return {k: np.array(v) for k, v in out.items()}


def test_paired_bootstrap_is_scikit_learns_difference_on_the_same_resamples():
    """Per resample: scikit-learn's score of a minus that of b on the same resampled rows
    (classes absent from a resample take no part, as f1_score's default labels)."""
    y = np.array([0, 0, 0, 1, 1, 2, 2, 0, 1, 0, 2])
    a = np.array([0, 1, 0, 1, 1, 2, 0, 0, 1, 0, 2])
    b = np.array([0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0])
    got = paired_bootstrap(y, a, b, 3, resamples=6, seed=5)
    idx = np.random.default_rng(5).integers(0, len(y), size=(6, len(y)))
    for r, i in enumerate(idx):
        for name, fn in (("accuracy", accuracy_score),
                         ("macro_f1", lambda t, p: f1_score(t, p, average="macro",
                                                            zero_division=0)),
                         ("balanced_accuracy", balanced_accuracy_score)):
            want = fn(y[i], a[i]) - fn(y[i], b[i])
            assert got[name][r] == pytest.approx(want, rel=REL, abs=1e-15), (name, r)
    assert set(got) == {"accuracy", "macro_f1", "balanced_accuracy"}
    same = paired_bootstrap(y, a, a, 3, resamples=6, seed=5)
    assert all((v == 0).all() for v in same.values())
    # classification_scores' bootstrap draws the same resamples for the same n and seed
    sc = classification_scores(y, a, ["x", "y", "z"], resamples=6, seed=5)
    f1s = [f1_score(y[i], a[i], average="macro", zero_division=0) for i in idx]
    assert sc["macro_f1_se"] == pytest.approx(np.std(f1s, ddof=1), rel=1e-9)
    with pytest.raises(ValueError, match="equal, non-empty"):
        paired_bootstrap(y, a[:-1], b, 3)
    with pytest.raises(ValueError, match="outside the 3 classes"):
        paired_bootstrap(y, a, b + 2, 3)


def test_metric_chooses_the_score_the_constraint_reads():
    """Drop ≤ 20 points: on accuracy m4 (exactly 20, and 4×) wins; on macro-F1 (m4 drops
    55.6, m16 13.3) and balanced accuracy (m4 50, m16 6.25) only m16 meets it. Agreement
    reads no metric."""
    done = units()
    got = {}
    for metric in ("accuracy", "macro_f1", "balanced_accuracy"):
        rep = recommend.report(cfg_of(Constraint("accuracy_drop", 20.0, metric)),
                               done, [], 10)
        got[metric] = rep["recommendations"][0]["setting"]
        assert rep["metric"] == metric and rep["config"]["metric"] == metric
    assert got == {"accuracy": M4.name, "macro_f1": M16.name, "balanced_accuracy": M16.name}
    rep = recommend.report(cfg_of(Constraint("accuracy_drop", 20.0, "macro_f1")),
                           done, [], 10)
    m16 = rep["rows"][2]
    assert rep["constraint"] == "macro-F1 drop ≤ 20 points"
    assert m16["macro_f1_drop_points"] == round(100 * (1 - 0.8 * 13 / 12), 9)  # 13.333333333
    assert rep["rows"][1]["macro_f1_drop_points"] == round(100 * (1 - 4 / 9), 9)
    assert (m16["balanced_accuracy_drop_points"], m16["accuracy_drop_points"]) == (6.25, 10.0)
    se = 100 * sklearn_boot(PRED["dense"], PRED[M16.name])["macro_f1"].std(ddof=1)
    assert m16["macro_f1_drop_se_points"] == pytest.approx(se, rel=1e-9)
    assert rep["recommendations"][0]["answer"] == (
        "N = 256: m16 k16 s1 paper — 2.00× dense's speed (2.0 ms vs 4.0 ms, timed side by "
        "side), agreement 90.0 %, accuracy 90.0 % (dense 100.0 %, retention 90.0 %), macro-F1 "
        f"0.867 (dense 1.000, drop +13.3 ± {se:.1f} points)")
    assert rep["recommendations"][0]["macro_f1"] == pytest.approx(0.8 * 13 / 12, rel=REL)
    # Nothing meets 5 points: the refusal quotes the smallest drop in the metric's points.
    rep = recommend.report(cfg_of(Constraint("accuracy_drop", 5.0, "macro_f1")),
                           done, [], 10)
    assert rep["recommendations"][0]["answer"] == (
        "no setting meets macro-F1 drop ≤ 5 points at N = 256 (smallest macro-F1 drop 13.3333 "
        "points, agreement 90.0 % (m16 k16 s1 paper))")
    rep = recommend.report(cfg_of(Constraint("agreement", 0.95, "balanced_accuracy")),
                           done, [], 10)
    assert rep["recommendations"][0]["answer"] == (
        "no setting meets agreement with dense ≥ 95.0 % at N = 256 (best agreement 90.0 %, "
        "balanced accuracy drop 6.2 points (m16 k16 s1 paper))")
    assert Constraint("accuracy_drop", 1.5, "balanced_accuracy").describe() == (
        "balanced accuracy drop ≤ 1.5 points")


def test_report_columns_are_scikit_learns_numbers(tmp_path):
    """Every new number of the Markdown table, the per-class table and the CSV, against
    scikit-learn on the same predictions (bootstrap errors: scikit-learn's scores on the same
    resamples)."""
    rep = recommend.report(cfg_of(Constraint("accuracy_drop", 20.0, "macro_f1")),
                           units(), [], 10)
    md = advise_report.markdown(rep)
    lines = md.split("\n")
    assert lines[2] == (
        "| setting | m | k | s | scale | accuracy | macro-F1 | balanced accuracy | macro-F1 drop "
        "(± SE) points | agreement | KL(dense‖MiTA) | retention | p50 ms N=256: setting vs "
        "dense (×) |")
    assert "Metric: macro-F1 (--metric macro_f1). Drop = dense's macro-F1 minus the setting's " \
           "in points (100 × the difference), ± its paired standard error (paired bootstrap " \
           "over the same resampled rows)" in lines[0]
    want = {}
    for name, pred in PRED.items():
        acc = accuracy_score(Y, pred)
        boot = sklearn_boot(pred)
        f1 = f1_score(Y, pred, average="macro", zero_division=0)
        bal = balanced_accuracy_score(Y, pred)
        f1_se, bal_se = (boot[k].std(ddof=1) for k in ("macro_f1", "balanced_accuracy"))
        drop = "-"
        if name != "dense":
            d_se = 100 * sklearn_boot(PRED["dense"], pred)["macro_f1"].std(ddof=1)
            drop = f"{100 * (1 - f1):+.1f} ± {d_se:.1f}"
        want[name] = (acc, f1, bal, f1_se, bal_se)
        cells = (f"{100 * acc:.1f} ± {100 * math.sqrt(acc * (1 - acc) / 10):.1f} % | "
                 f"{f1:.3f} ± {f1_se:.3f} | {100 * bal:.1f} ± {100 * bal_se:.1f} % | {drop} |")
        row = next(x for x in lines if x.startswith(f"| {name} |"))
        assert cells in row, (row, cells)
    # the exact cells of the three rows (accuracy's error by hand: √(0.8·0.2/10) = 12.6 %)
    assert lines[4].startswith("| dense | - | - | - | - | 100.0 ± 0.0 % | 1.000 ± 0.000 | "
                               "100.0 ± 0.0 % | - | 100.0 % | 0.0000 | 100.0 % | - |")
    assert lines[5].startswith("| m4 k4 s1 paper | 4 | 4 | 1 | paper | 80.0 ± 12.6 % | 0.444 ± ")
    assert lines[5].endswith(" | 1.0 vs 4.0 (4.00×) |")
    assert lines[6].startswith("| m16 k16 s1 paper | 16 | 16 | 1 | paper | 90.0 ± 9.5 % | 0.867 ")
    # per-class F1 of dense and the recommended m16, the majority rate of the data
    f1s = {n: f1_score(Y, PRED[n], average=None, labels=[0, 1], zero_division=0)
           for n in ("dense", M16.name)}
    assert md.split("\n\nRecommendation")[0].split("\n\nPer-class F1")[1] == (
        " (dense and the recommended settings; support: the class's rows). Majority rate of "
        "the data: 80.0 % ('neg'): what always answering it scores.\n\n"
        "| class | support | dense | m16 k16 s1 paper |\n|---|---|---|---|\n"
        f"| neg | 8 | {f1s['dense'][0]:.3f} | {f1s[M16.name][0]:.3f} |\n"
        f"| pos | 2 | {f1s['dense'][1]:.3f} | {f1s[M16.name][1]:.3f} |")
    assert "| neg | 8 | 1.000 | 0.933 |\n| pos | 2 | 1.000 | 0.800 |" in md
    # the CSV and the JSON hold the same numbers, unrounded
    files = advise_report.write_outputs(rep, tmp_path)
    with open(files["csv"], newline="") as f:
        table = list(csv.DictReader(f))
    for r in table:
        acc, f1, bal, f1_se, bal_se = want[r["setting"]]
        got = {k: float(r[k]) for k in ("accuracy", "accuracy_se", "macro_f1", "macro_f1_se",
                                        "balanced_accuracy", "balanced_accuracy_se",
                                        "majority_rate", "f1 neg", "f1 pos")}
        per_class = f1_score(Y, PRED[r["setting"]], average=None, labels=[0, 1],
                             zero_division=0)
        assert got == pytest.approx({
            "accuracy": acc, "accuracy_se": math.sqrt(acc * (1 - acc) / 10), "macro_f1": f1,
            "macro_f1_se": f1_se, "balanced_accuracy": bal, "balanced_accuracy_se": bal_se,
            "majority_rate": 0.8, "f1 neg": per_class[0], "f1 pos": per_class[1]}, rel=1e-9)
        assert r["metric"] == "macro_f1"
        assert float(r["drop_points"]) == pytest.approx(100 * (1 - f1), rel=1e-9)
    back = json.loads(files["json"].read_text())
    assert back["rows"][2]["scores"]["per_class"][1] == {
        "label": "pos", "precision": pytest.approx(2 / 3, rel=REL), "recall": 1.0,
        "f1": pytest.approx(0.8, rel=REL), "support": 2}
    assert back["rows"][2]["scores"]["confusion_matrix"] == [[7, 1], [0, 2]]


def test_warnings_are_printed_in_the_markdown():
    """Under the accuracy constraint m4 is recommended: it answers 'neg' for every row, and
    its accuracy is the majority rate. A trained length below N: the timings measure a
    forward the service never runs."""
    task = Task("tiny", NAMES, BYTES, Vocabulary(257, 0), 128, "tail")
    rep = recommend.report(cfg_of(Constraint("accuracy_drop", 20.0)), units(), [], 10,
                           task)
    assert rep["recommendations"][0]["setting"] == M4.name
    warnings = [
        "N = 256: longer than the checkpoint's trained length 128; the served model cuts a "
        "sequence to its first 128 tokens (truncate tail), so the timings at this N measure a "
        "forward the service never runs",
        "m4 k4 s1 paper: the model answers 'neg' for all 10 data.tsv rows: it has learned no "
        "distinction between the classes",
        "m4 k4 s1 paper: data.tsv accuracy 80.0 % ± 12.6 % is within 1.96 standard errors of "
        "the majority rate 80.0 % (always answering 'neg'): accuracy says nothing here; read "
        "macro-F1, balanced accuracy and the per-class recall"]
    assert rep["warnings"] == warnings
    md = advise_report.markdown(rep)
    assert md.endswith("\n\nWarnings:\n\n" + "".join(f"- {w}\n" for w in warnings))
    assert "(10 sequences, rows longer than 128 tokens cut to their first 128 as training cut " \
           "them (truncate tail))" in md
    # no task, a dense that tells the classes apart, nothing recommended: no warning
    rep = recommend.report(cfg_of(Constraint("accuracy_drop", 1.0)), units(), [], 10)
    assert rep["warnings"] == [] and "Warnings" not in advise_report.markdown(rep)


def test_latency_cells_show_the_two_p50s_of_their_ratio():
    """Issue 61: a dense p50 of one measurement (its own row, dense timed alone) beside a
    ratio of another; a setting's cell now holds both p50s of its ratio."""
    x = {"p50_ms": 38.9, "dense_p50_ms": 19.85, "speedup": 19.85 / 38.9}
    assert advise_report.latency_cell(x, dense_row=False) == "38.9 vs 19.9 (0.51×)"
    assert advise_report.latency_cell({"p50_ms": 76.4}, dense_row=True) == "76.4"
    assert advise_report.latency_cell(x, dense_row=True) == "38.9"
    assert advise_report.latency_cell({"p50_ms": 2.0}, dense_row=False) == "2.0"  # timed alone
    assert advise_report.latency_cell(None, dense_row=False) == "-"


def tiny_checkpoint(folder, max_length, side):
    """A random 1-layer byte-level classifier of NAMES trained (so its task says) with
    ``--max-len max_length --truncate side``."""
    torch.manual_seed(0)
    model = EncoderClassifier(ModelConfig(vocab_size=257, num_classes=2, dim=16, depth=1,
                                          num_heads=2, ffn_dim=32, num_landmarks=2, topk=2))
    task = Task("tiny", NAMES, BYTES, Vocabulary(257, 0), max_length, side)
    return save_checkpoint(model, folder, task=task.spec(), **label_maps(NAMES))


def test_own_rows_are_cut_as_training_cut_them_and_scored_as_evaluate_reads_them(tmp_path):
    """A checkpoint trained with ``--max-len 6 --truncate head``: a row longer than 6 gives
    the probabilities of its last 6 bytes (the same file with the rows cut by hand), not
    those of the whole row; the rows are ``mita.training.evaluate --data``'s (read_file, the task's
    label names, ``task.cut``) and the JSON report's dense scores are those of the model's
    own predictions on them."""
    folder = tiny_checkpoint(tmp_path / "ck", 6, "head")
    long, cut = tmp_path / "long.tsv", tmp_path / "cut.tsv"
    long.write_text("neg\tabcdefghij\npos\txyz\nneg\tqrstuvwxy\npos\tlmnopqrs\n")
    cut.write_text("neg\tefghij\npos\txyz\nneg\ttuvwxy\npos\tnopqrs\n")
    cfg = AdviseConfig(checkpoint=str(folder), ns=[8], grid=[Setting(2, 2)],
                       constraint=Constraint("agreement", 0.5), data=str(long),
                       data_format="own", repeats=1, mita_backend="torch",
                       out=tmp_path / "a")
    rows = advise.load_data(cfg, 2)
    assert rows == [([b + 1 for b in text], y) for text, y in (
        (b"efghij", 0), (b"xyz", 1), (b"tuvwxy", 0), (b"nopqrs", 1))]
    task = advise.load_task(str(folder))
    assert rows == [(list(task.cut(ex.ids)), task.labels.index(ex.label))
                    for ex in labelled.read_file(long, task.tokenizer).examples]
    assert rows == task.labelled_rows(long)[0]  # mita.training.evaluate --data's own preparation
    # the other formats are cut too (byte-level label<TAB>text with integer labels)
    text = tmp_path / "text.tsv"
    text.write_text("1\tabcdefghij\n")
    assert advise.load_data(replace(cfg, data=str(text), data_format="text"), 2) == [
        ([b + 1 for b in b"efghij"], 1)]
    rep = advise.run_advise(cfg)
    advise.run_advise(replace(cfg, data=str(cut), out=tmp_path / "b"))
    p_long, p_cut = (np.load(tmp_path / d / advise.DENSE_PROBS) for d in "ab")
    assert np.array_equal(p_long, p_cut)
    from service.engine import ClassifierEngine

    whole = ClassifierEngine(str(folder), "dense", "cpu", cuda_graphs=False).run(
        [[b + 1 for b in b"abcdefghij"]])[0]["probabilities"]
    assert whole != p_long[0].tolist()  # the cut is what makes them equal
    model = load_checkpoint(folder, attention="dense").eval()
    with torch.no_grad():
        pred = [int(model(torch.tensor([ids])).argmax()) for ids, _ in rows]
    back = json.loads(json.dumps(rep))
    assert back["rows"][0]["scores"] == classification_scores(
        [y for _, y in rows], pred, list(NAMES))
    # the advisor's dense scores are python -m mita.training.evaluate --data's on the same file
    from mita.training.evaluate import main as evaluate_main

    evaluated = {r["attention"]: r["scores"] for r in evaluate_main(
        [str(folder), "--data", str(long)])}
    assert back["rows"][0]["accuracy"] == evaluated["dense"]["accuracy"]
    assert back["rows"][0]["scores"] == evaluated["dense"]
    assert back["config"]["trained_length"] == 6 and back["config"]["truncate"] == "head"
    assert rep["warnings"][0] == (
        "N = 8: longer than the checkpoint's trained length 6; the served model cuts a sequence "
        "to its last 6 tokens (truncate head), so the timings at this N measure a forward the "
        "service never runs")
