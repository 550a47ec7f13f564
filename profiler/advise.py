"""(m, k, s) advisor: does MiTA pay off for this checkpoint, these data and these N, and with
which setting?

For every setting of a grid — m landmarks (= routed experts), k tokens per expert, s experts
per query, and the shared-branch scaling — the checkpoint's MiTA variant is compared with its
dense variant on the same inputs, through the serving code (``service.engine.ClassifierEngine``,
one unpadded forward per sequence, as the service's ``deterministic`` mode):

- quality on the user's labelled sequences, each cut as training cut them when the checkpoint
  was trained with ``--max-len`` (``mita.data.task.Task.cut``, as the service and
  ``python -m mita.training.evaluate`` cut them): label accuracy, macro-F1 and balanced
  accuracy with their errors and per-class precision / recall / F1 (``mita.tools.scores``),
  agreement of the predicted labels with dense, mean KL(dense ‖ MiTA) of the class
  probabilities (nats), and retention = MiTA accuracy / dense accuracy (the paper's Fig. 9
  measure for a swap without retraining);
- cost at each N served: forward latency (p50 of repeats, after one warm-up) with the
  per-stage breakdown the forward reports, and peak memory (CUDA: measured; CPU: the analytic
  activation estimate); the speed-up over dense is the ratio of p50s with dense's forwards
  interleaved with the setting's, in one process (machines are noisy). The input of length N
  is the user's own sequences concatenated and cut to N tokens (timed at N even where the
  served model would cut it to a shorter trained length: the report warns then).

The recommendation at each N is the setting with the largest speed-up over dense among those
that meet the quality constraint (agreement with dense ≥ a fraction, or the ``--metric`` —
accuracy, macro-F1 or balanced accuracy — at most some points below dense's) and beat dense
— or "dense is faster" / "no setting meets …"; one setting for the whole N range comes with a
serve-config snippet (``args.mita_setting``: the service swaps m, k, s at load time, same
weights).

Work is done in units (dense quality, dense latency at each N, then per setting: quality,
latency at each N), each appended to ``advise.jsonl`` as it finishes: a run stopped by its time
budget (or Ctrl-C) resumes where it stopped when started again with the same inputs.
"""

from __future__ import annotations

import itertools
import math
import sys
import time

import numpy as np

from mita.data.listops import ListOpsConfig, encode, generate
from mita.data.task import Task, checkpoint_task
from mita.data.tsv import read_lra_listops, read_text_tsv
from mita.data.vocab import Vocabulary
from mita.hooks import stage_sorted
from mita.model import checkpoint_config, checkpoint_metadata
from mita.quality import kl_divergence
from mita.tools.progress import Progress
from mita.tools.scores import HEADLINE, classification_scores, paired_bootstrap

from .advise_config import AdviseConfig, Setting, checkpoint_folder
from .advise_report import cpu_sharing_warning
from .advise_units import UnitStore, load_dense_probs
from .recommend import report

RUN_FILE = "advise.jsonl"
DENSE_PROBS = "dense_probabilities.npy"


def compare(reference: np.ndarray, probs: np.ndarray, labels: np.ndarray) -> dict:
    """Quality of ``probs`` against the dense ``reference`` (both ``(n, classes)`` float64
    probabilities) and the true ``labels`` ``(n,)``: accuracy, agreement of the argmax labels,
    mean KL(reference ‖ probs) in nats (``mita.quality.kl_divergence``), and
    ``drop_se_points``: the standard error of dense's accuracy minus this one, in points, for
    paired outcomes on the same sequences (√(b + c − (b − c)²/n) / n, b and c the sequences
    only one of the two gets right). Identical inputs give agreement 1.0, KL exactly 0 and
    SE 0."""
    pred, ref = probs.argmax(1), reference.argmax(1)
    kl = kl_divergence(reference, probs)
    right, ref_right = pred == labels, ref == labels
    b, c, n = int((ref_right & ~right).sum()), int((right & ~ref_right).sum()), len(labels)
    return {"accuracy": float(right.mean()), "agreement": float((pred == ref).mean()),
            "kl": float(kl.mean()),
            "drop_se_points": 100 * math.sqrt(max(b + c - (b - c) ** 2 / n, 0.0)) / n}


def metric_scores(reference: np.ndarray, probs: np.ndarray, labels: np.ndarray,
                  names, resamples: int | None = None) -> dict:
    """The scores beyond accuracy of ``probs`` (``(n, classes)``; its argmax the predicted
    classes) against the true ``labels`` ``(n,)``: ``scores`` (``mita.tools.scores.
    classification_scores`` with the class ``names``: accuracy ± SE, macro-F1 and balanced
    accuracy ± bootstrap SE, per-class precision / recall / F1, the majority rate), and for
    macro-F1 and balanced accuracy the standard error of dense's score minus this one, in
    points (``{metric}_drop_se_points``), from a paired bootstrap of the same resampled rows
    (``mita.tools.scores.paired_bootstrap``; the reference is dense's ``(n, classes)``
    probabilities). ``resamples``: the bootstrap's (default ``mita.tools.scores``')."""
    pred, ref = probs.argmax(1), reference.argmax(1)
    more = {} if resamples is None else {"resamples": resamples}
    out = {"scores": classification_scores(labels, pred, list(names), **more)}
    diff = paired_bootstrap(labels, ref, pred, len(names), **more)
    for name in HEADLINE[1:]:
        se = float(diff[name].std(ddof=1)) if len(diff[name]) > 1 else 0.0
        out[f"{name}_drop_se_points"] = 100 * se
    return out


def load_task(checkpoint: str) -> Task:
    """The checkpoint's task (``mita.data.task.checkpoint_task``): its label names, tokenizer and
    trained length."""
    folder = checkpoint_folder(checkpoint)
    meta = checkpoint_metadata(folder)
    return checkpoint_task(meta, checkpoint_config(folder, meta), folder)


def load_data(cfg: AdviseConfig, num_classes: int, vocab: Vocabulary | None = None,
              task: Task | None = None) -> list[tuple[list[int], int]]:
    """The labelled sequences as the served model reads them: ``size`` generated ListOps
    expressions (LRA's procedure, ``min_length < length < max_length``) or the first ``size``
    rows of the file, each cut to the checkpoint's trained length as training cut it
    (``task.cut``; ``task``: the checkpoint's, read from it by default). With ``vocab`` (the
    checkpoint's), every token id sent must be a real one (``Vocabulary.first_bad``, before
    the cut, as the service checks them). Raises ValueError for an unreadable file, an empty
    result, a label outside ``num_classes`` or an id outside the vocabulary (naming the
    row)."""
    task = task if task is not None else load_task(cfg.checkpoint)
    if cfg.data == "generated":
        rows = [(encode(t), y) for t, y in generate(
            cfg.size, cfg.seed, ListOpsConfig(cfg.min_length, cfg.max_length))]
    elif cfg.data_format == "own":
        rows = own_rows(cfg, task)
    else:
        try:
            rows = (read_lra_listops(cfg.data) if cfg.data_format == "lra"
                    else read_text_tsv(cfg.data, num_classes))[:cfg.size]
        except UnicodeDecodeError as e:
            raise ValueError(f"{cfg.data}: not UTF-8 text ({e.reason} at byte {e.start})"
                             ) from None
    if not rows:
        raise ValueError(f"no labelled sequences in {cfg.data}")
    for i, (seq, label) in enumerate(rows):
        if not 0 <= label < num_classes:
            raise ValueError(f"{cfg.data}: row {i + 1} has label {label}; the checkpoint has "
                             f"{num_classes} classes")
        bad = None if vocab is None else vocab.first_bad(seq)
        if bad is not None:
            raise ValueError(f"{cfg.data}: row {i + 1} has token id {seq[bad]}, not in the "
                             f"checkpoint's vocabulary (ids 0…{vocab.size - 1} but the "
                             f"padding id {vocab.pad_id}); does --format {cfg.data_format} suit "
                             "this checkpoint?")
        if not seq:
            raise ValueError(f"{cfg.data}: row {i + 1} is an empty sequence")
    return [(task.cut(seq), label) for seq, label in rows]


def sequence_of_length(data: list[tuple[list[int], int]], n: int) -> np.ndarray:
    """The data's sequences concatenated (repeated as needed) and cut to exactly n tokens:
    real content at any N. ``data``: (token ids, label) pairs; returns int64 ids of shape
    ``(n,)``. Raises ValueError when the data hold no token."""
    ids = np.fromiter(itertools.chain.from_iterable(seq for seq, _ in data), np.int64)
    if not ids.size:
        raise ValueError("the data hold no token to build a sequence from")
    return np.resize(ids, n)  # repeats ids as needed, then cuts at n


def own_rows(cfg: AdviseConfig, task: Task | None = None) -> list[tuple[list[int], int]]:
    """The first ``size`` rows of a labelled file as ``python -m mita.training --train`` reads
    it (TSV or JSON lines, label names), tokenized by the checkpoint's tokenizer, indexed by its
    label names and cut to its trained length as training cut them (``task.cut``): the rows
    ``python -m mita.training.evaluate CHECKPOINT --data FILE`` scores. ``task``: the checkpoint's
    (``mita.data.task``; read from it by default). Raises ValueError as ``Task.labelled_rows``
    (the file and line of a label the checkpoint does not know, ``read_file``'s errors)."""
    task = task if task is not None else load_task(cfg.checkpoint)
    return task.labelled_rows(cfg.data, cfg.size)[0]


def _engine(cfg: AdviseConfig, attention: str, setting: Setting | None):
    from service.engine import ClassifierEngine

    return ClassifierEngine(cfg.checkpoint, attention, cfg.device, cfg.mita_backend, cfg.dtype,
                            cuda_graphs=False,
                            setting=setting.overrides() if setting is not None else None)


def _probabilities(engine, data) -> np.ndarray:
    return np.array([r["probabilities"] for r in engine.run([seq for seq, _ in data])])


def _latency(engine, ids: np.ndarray, repeats: int, dense=None) -> dict:
    """p50 (and min, max) of ``repeats`` timed forwards after one warm-up, stages and peak
    memory; with ``dense``, dense forwards interleaved with these ones (``dense_p50_ms``), so
    the speed-up is a ratio measured side by side."""
    for e in (engine, dense) if dense is not None else (engine,):
        e.run([ids])  # warm-up: kernel build, allocator, caches
    profiles, dense_ms = [], []
    for _ in range(repeats):
        profiles.append(engine.run([ids])[0]["profile"])
        if dense is not None:
            dense_ms.append(dense.run([ids])[0]["profile"].total_ms)
    stages = stage_sorted({s for p in profiles for s in p.stages_ms})
    total = [p.total_ms for p in profiles]
    out = {"p50_ms": float(np.median(total)), "min_ms": min(total), "max_ms": max(total),
           "stages_ms": {s: float(np.median([p.stages_ms.get(s, 0.0) for p in profiles]))
                         for s in stages},
           "peak_memory_bytes": profiles[-1].peak_memory_bytes,
           "peak_memory_kind": profiles[-1].peak_memory_kind}
    if dense is not None:
        out["dense_p50_ms"] = float(np.median(dense_ms))
    return out


def run_advise(cfg: AdviseConfig, fresh: bool = False) -> dict:
    """Run (or resume) the grid within ``cfg.budget_s`` seconds of work and return the report
    dict (``rows``, ``recommendations``, ``overall``, ``skipped``, ``config``). Units already in
    ``cfg.out/advise.jsonl`` from a run with the same inputs are not run again. Raises
    ValueError for bad data, a checkpoint that will not load or a foreign ``advise.jsonl``.
    Warns on stderr first when other processes share the CPU (``cpu_sharing_warning``)."""
    warning = cpu_sharing_warning()
    if warning:
        print(warning, file=sys.stderr, flush=True)
    meta = checkpoint_metadata(checkpoint_folder(cfg.checkpoint))
    model_cfg = meta["config"]
    task = load_task(cfg.checkpoint)
    for n in cfg.ns:  # a grid model takes H·W tokens, a pretrained one its positions
        why = task.length_refusal(n)
        if why is not None:
            raise ValueError(f"--n {n}: {why}")
    data = load_data(cfg, model_cfg["num_classes"],
                     Vocabulary(model_cfg["vocab_size"], model_cfg["pad_id"]), task)
    labels = np.array([y for _, y in data])
    run = UnitStore(cfg.out / RUN_FILE, cfg.key(), fresh)
    units = [("quality", "dense")] + [("latency", "dense", n) for n in cfg.ns]
    for setting in cfg.grid:
        units += [("quality", setting.name)] + [("latency", setting.name, n) for n in cfg.ns]
    by_name = {s.name: s for s in cfg.grid}
    start, skipped = time.monotonic(), []
    engines: dict[str, object] = {}
    dense_engine = None  # kept loaded: every setting's latency is timed beside it
    dense_probs = None
    bar = Progress(len(units), "advise", "unit")
    if run.resumed:
        bar.write(f"resuming: {run.resumed} of {len(units)} units from {run.path}")
    for unit in units:
        bar.update()
        if unit in run.done:
            continue
        if time.monotonic() - start > cfg.budget_s:
            skipped.append(unit)
            continue
        name = unit[1]
        what = f"{name} {unit[0]}" + (f" N={unit[2]}" if len(unit) > 2 else "")
        bar.phase(what)
        if dense_engine is None:
            dense_engine = _engine(cfg, "dense", None)
        if name not in engines:  # one MiTA engine at a time: load, use, drop
            engines.clear()
            engines[name] = (dense_engine if name == "dense" else
                             _engine(cfg, "mita", by_name[name]))
        engine = engines[name]
        if unit[0] == "quality":
            probs = _probabilities(engine, data)
            if name == "dense":
                dense_probs = probs
                np.save(cfg.out / DENSE_PROBS, probs)
            elif dense_probs is None:
                dense_probs = load_dense_probs(cfg.out / DENSE_PROBS)
            run.add(unit, compare(dense_probs, probs, labels)
                    | metric_scores(dense_probs, probs, labels, task.labels))
        else:
            ids = sequence_of_length(data, unit[2])
            run.add(unit, _latency(engine, ids, cfg.repeats,
                                   None if name == "dense" else dense_engine))
        bar.phase_done(what)
    bar.close()
    if skipped:
        bar.write(f"time budget of {cfg.budget_s:g} s spent: {len(skipped)} of {len(units)} "
                   f"units not run; run the same command again to resume")
    return report(cfg, run.done, skipped, len(data), task)
