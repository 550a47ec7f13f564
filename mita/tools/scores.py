"""Scores of a classifier's predictions that hold on imbalanced data, computed with
scikit-learn: per-class precision, recall, F1 and support, macro-F1, balanced accuracy, the
confusion matrix, the majority rate of the scored rows, and an error bar for every headline
number (accuracy: its binomial standard error; macro-F1 and balanced accuracy: the standard
error and 95 % interval of a seeded bootstrap over the rows). Used by training's report,
``--compare``, ``python -m mita.training.evaluate --data`` and the advisor. No torch.
"""

from __future__ import annotations

import math
import warnings
from collections import Counter

import numpy as np
from sklearn.metrics import (
    balanced_accuracy_score,
    confusion_matrix,
    f1_score,
    precision_recall_fscore_support,
)

HEADLINE = ("accuracy", "macro_f1", "balanced_accuracy")  # the --metric choices
BOOTSTRAP_RESAMPLES = 1000
BOOTSTRAP_SEED = 0
# A score within this many standard errors of the majority rate is not told apart from
# always answering the majority class (1.96: a two-sided 95 % interval).
Z95 = 1.96


def _resample_indices(n: int, resamples: int, seed: int) -> np.ndarray:
    """The rows of ``resamples`` bootstrap resamples of ``n`` rows (with replacement, seeded):
    int64 ``(resamples, n)``."""
    return np.random.default_rng(seed).integers(0, n, size=(resamples, n))


def _resampled(y_true: np.ndarray, y_pred: np.ndarray, classes: int, idx: np.ndarray
               ) -> dict[str, np.ndarray]:
    """Accuracy, macro-F1 and balanced accuracy of each resample ``idx[r]`` (row indices) of
    the rows, each as scikit-learn computes them: classes absent from a resample's true and
    predicted labels take no part (``labels`` are those present), a class with no prediction
    has precision 0 (``zero_division=0``)."""
    resamples = idx.shape[0]
    t, p = y_true[idx], y_pred[idx]
    # confusion matrices of every resample at once: (resamples, C, C)
    flat = t * classes + p + (np.arange(resamples) * classes * classes)[:, None]
    cm = np.bincount(flat.ravel(), minlength=resamples * classes * classes).reshape(
        resamples, classes, classes).astype(float)
    tp = np.einsum("rcc->rc", cm)
    support, predicted = cm.sum(2), cm.sum(1)
    with np.errstate(divide="ignore", invalid="ignore"):
        precision = np.where(predicted > 0, tp / predicted, 0.0)
        recall = np.where(support > 0, tp / support, 0.0)
        f1 = np.where(precision + recall > 0, 2 * precision * recall / (precision + recall), 0.0)
    present = (support + predicted) > 0  # f1_score's labels: those in y_true or y_pred
    macro_f1 = (f1 * present).sum(1) / present.sum(1)
    true_present = support > 0  # balanced_accuracy_score: the classes in y_true
    balanced = (recall * true_present).sum(1) / true_present.sum(1)
    return {"accuracy": tp.sum(1) / t.shape[1], "macro_f1": macro_f1,
            "balanced_accuracy": balanced}


def _bootstrap(y_true: np.ndarray, y_pred: np.ndarray, classes: int, resamples: int,
               seed: int) -> dict[str, np.ndarray]:
    """Accuracy, macro-F1 and balanced accuracy of ``resamples`` resamples of the rows (with
    replacement, seeded), as ``_resampled``."""
    return _resampled(y_true, y_pred, classes, _resample_indices(len(y_true), resamples, seed))


def paired_bootstrap(y_true, y_a, y_b, classes: int, resamples: int = BOOTSTRAP_RESAMPLES,
                     seed: int = BOOTSTRAP_SEED) -> dict[str, np.ndarray]:
    """A paired bootstrap of two classifiers' predictions ``y_a`` and ``y_b`` of the same rows
    (class indices below ``classes``, as ``y_true``): for each ``HEADLINE`` score, its value
    for ``y_a`` minus its value for ``y_b`` on each of ``resamples`` resamples of the rows,
    the same resampled rows for both (so what the two share cancels). Each score is
    scikit-learn's on the resample (as ``classification_scores``' bootstrap, whose resamples
    these are for the same number of rows and ``seed``). Returns float64 arrays of shape
    ``(resamples,)``; their standard deviation is the standard error of the difference.
    Raises ValueError for empty or unequal inputs, or an index outside ``classes``."""
    t, a, b = (np.asarray(x, dtype=np.int64) for x in (y_true, y_a, y_b))
    if t.ndim != 1 or not len(t) or a.shape != t.shape or b.shape != t.shape:
        raise ValueError(f"need equal, non-empty lists of true and predicted classes, got "
                         f"{t.shape}, {a.shape} and {b.shape}")
    if min(t.min(), a.min(), b.min()) < 0 or max(t.max(), a.max(), b.max()) >= classes:
        raise ValueError(f"a class index outside the {classes} classes")
    idx = _resample_indices(len(t), resamples, seed)
    sa, sb = _resampled(t, a, classes, idx), _resampled(t, b, classes, idx)
    return {name: sa[name] - sb[name] for name in HEADLINE}


def classification_scores(y_true, y_pred, labels, resamples: int = BOOTSTRAP_RESAMPLES,
                          seed: int = BOOTSTRAP_SEED) -> dict:
    """The scores of predictions ``y_pred`` against ``y_true`` (class indices into ``labels``,
    the class names; equal lengths ≥ 1). Returns a JSON-ready dict: ``rows``; ``accuracy``
    with ``accuracy_se`` (√(p(1−p)/n)); ``macro_f1`` and ``balanced_accuracy`` (scikit-learn's,
    over the classes present in the rows) each with ``_se`` and ``_ci95`` from ``resamples``
    bootstrap resamples (seeded by ``seed``); ``majority_label`` / ``majority_rate`` (the most
    common true class of these rows and its share: what always answering it scores);
    ``per_class``: label, precision, recall, F1 and support of every class of ``labels``
    (0 where a class has no prediction or no row); ``confusion_matrix`` (rows: true class,
    columns: predicted, in ``labels`` order); ``predicted_counts`` per label. Raises
    ValueError for empty or unequal inputs, or an index outside ``labels``."""
    with warnings.catch_warnings():  # a class absent from the rows: said by score_warnings
        warnings.simplefilter("ignore", UserWarning)
        return _scores(y_true, y_pred, labels, resamples, seed)


def _scores(y_true, y_pred, labels, resamples: int, seed: int) -> dict:
    t, p = np.asarray(y_true, dtype=np.int64), np.asarray(y_pred, dtype=np.int64)
    c = len(labels)
    if t.shape != p.shape or t.ndim != 1 or not len(t):
        raise ValueError(f"need equal, non-empty lists of true and predicted classes, got "
                         f"{t.shape} and {p.shape}")
    if min(t.min(), p.min()) < 0 or max(t.max(), p.max()) >= c:
        raise ValueError(f"a class index outside the {c} labels")
    n = len(t)
    acc = float((t == p).mean())
    everything = list(range(c))
    prec, rec, f1, support = precision_recall_fscore_support(
        t, p, labels=everything, zero_division=0)
    boot = _bootstrap(t, p, c, resamples, seed)
    top, top_n = Counter(t.tolist()).most_common(1)[0]
    out = {"rows": n, "accuracy": acc, "accuracy_se": math.sqrt(acc * (1 - acc) / n),
           "macro_f1": float(f1_score(t, p, average="macro", zero_division=0)),
           "balanced_accuracy": float(balanced_accuracy_score(t, p))}
    for name in ("macro_f1", "balanced_accuracy"):
        out[f"{name}_se"] = float(boot[name].std(ddof=1)) if resamples > 1 else 0.0
        out[f"{name}_ci95"] = [float(x) for x in np.percentile(boot[name], [2.5, 97.5])]
    out |= {"majority_label": labels[top], "majority_rate": top_n / n,
            "per_class": [{"label": labels[i], "precision": float(prec[i]),
                           "recall": float(rec[i]), "f1": float(f1[i]),
                           "support": int(support[i])} for i in everything],
            "confusion_matrix": confusion_matrix(t, p, labels=everything).tolist(),
            "predicted_counts": {labels[i]: int((p == i).sum()) for i in everything},
            "bootstrap": {"resamples": resamples, "seed": seed}}
    return out


def score_warnings(scores: dict, what: str = "validation") -> list[str]:
    """What a reader must not miss in ``scores`` (``classification_scores``): a model that
    answers one class for every row; an accuracy within ``Z95`` standard errors of the
    majority rate (not told apart from always answering the majority class), or below it by
    more; classes with no row among the scored ones. ``what`` names
    the rows (``"validation"``, a file). Returns sentences, empty when nothing applies."""
    out = []
    answered = [k for k, v in scores["predicted_counts"].items() if v]
    if len(answered) == 1:
        out.append(f"the model answers {answered[0]!r} for all {scores['rows']} {what} rows: "
                   "it has learned no distinction between the classes")
    acc, se, maj = scores["accuracy"], scores["accuracy_se"], scores["majority_rate"]
    margin = Z95 * max(se, 1e-12)
    if acc < maj - margin:
        out.append(f"{what} accuracy {100 * acc:.1f} % ± {100 * se:.1f} % is below the "
                   f"majority rate {100 * maj:.1f} % by more than {Z95:g} standard errors: "
                   f"always answering {scores['majority_label']!r} would score more")
    elif acc <= maj + margin:
        out.append(f"{what} accuracy {100 * acc:.1f} % ± {100 * se:.1f} % is within "
                   f"{Z95:g} standard errors of the majority rate {100 * maj:.1f} % (always "
                   f"answering {scores['majority_label']!r}): accuracy says nothing here; "
                   "read macro-F1, balanced accuracy and the per-class recall")
    absent = [r["label"] for r in scores["per_class"] if not r["support"]]
    if absent:
        shown = ", ".join(map(repr, absent[:5])) + (", …" if len(absent) > 5 else "")
        out.append(f"{len(absent)} class(es) have no {what} rows ({shown}): their recall is "
                   "not measured here, "
                   "and macro-F1 counts each one the model predicted as an F1 of 0")
    return out


def pct(x: float) -> str:
    """A share as a percentage with one decimal (``0.9063`` → ``"90.6 %"``)."""
    return f"{100 * x:.1f} %"


def summary_line(scores: dict) -> str:
    """The headline numbers of ``scores`` in one line, rounded for reading."""
    s = scores
    return (f"accuracy {pct(s['accuracy'])} ± {pct(s['accuracy_se'])}, macro-F1 "
            f"{s['macro_f1']:.3f} ± {s['macro_f1_se']:.3f}, balanced accuracy "
            f"{pct(s['balanced_accuracy'])} ± {pct(s['balanced_accuracy_se'])}, majority rate "
            f"{pct(s['majority_rate'])} ({s['majority_label']!r}), {s['rows']} rows")


def report_text(scores: dict, title: str) -> str:
    """A Markdown report of ``scores``: ``title``, the summary line (± one standard error),
    per-class precision / recall / F1 / support and the confusion matrix."""
    lines = [f"{title}: {summary_line(scores)}", "",
             "| class | precision | recall | F1 | support |", "|---|---|---|---|---|"]
    for r in scores["per_class"]:
        lines.append(f"| {r['label']} | {r['precision']:.3f} | {r['recall']:.3f} | "
                     f"{r['f1']:.3f} | {r['support']} |")
    names = [r["label"] for r in scores["per_class"]]
    lines += ["", "confusion matrix (rows: true class, columns: predicted)", "",
              "| true \\ predicted | " + " | ".join(names) + " |",
              "|---|" + "---|" * len(names)]
    for name, row in zip(names, scores["confusion_matrix"], strict=True):
        lines.append(f"| {name} | " + " | ".join(str(x) for x in row) + " |")
    return "\n".join(lines) + "\n"
