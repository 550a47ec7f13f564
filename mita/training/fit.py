"""The training loop and evaluation shared by ListOps training and training on a user's data
(``python -m mita.training``): length-bucketed padded batches, AdamW with a one-cycle schedule,
gradient clipping at 1.0, accuracy and predictions, and a resumable training state.

A training state (``train_state.safetensors`` + ``train_state.json``) holds the weights, the
optimiser's moments, the schedule's step and the random states; no pickle is written or read.
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ..config import ATTENTIONS
from ..data.listops import PAD_ID
from ..model import EncoderClassifier
from ..tools.progress import Progress

STATE_FILES = ("train_state.safetensors", "train_state.json")


def pad_batch(seqs: list[list[int]], pad_id: int = PAD_ID) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad id lists to ``(B, max_len)`` int64 and return ``(ids, key_padding_mask)``
    with True at padding."""
    n = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), n), pad_id, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s, dtype=torch.long)
    return ids, ids == pad_id


def length_batches(lengths: list[int], batch_size: int, rng: random.Random) -> list[list[int]]:
    """Index batches of similar length (sorted, cut, batch order shuffled) to limit padding."""
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    batches = [order[i: i + batch_size] for i in range(0, len(order), batch_size)]
    rng.shuffle(batches)
    return batches


LOG_INTERVAL_S = 30.0  # seconds between progress lines when the output is a log


@torch.no_grad()
def probabilities(model: EncoderClassifier, data: list[tuple[list[int], int]],
                  batch_size: int = 32, progress: str | None = None) -> torch.Tensor:
    """Class probabilities (softmax of the logits), float32 ``(len(data), num_classes)``, of
    each ``(ids, label)`` pair in ``data``'s order (eval mode; padded batches of similar
    length); ``progress``: show a progress bar with this label."""
    was_training = model.training
    model.eval()
    out = torch.empty(len(data), model.config.num_classes)
    batches = length_batches([len(x) for x, _ in data], batch_size, random.Random(0))
    bar = (Progress(len(batches), progress, "batch", leave=False, interval_s=LOG_INTERVAL_S)
           if progress else None)
    for batch in batches:
        ids, mask = pad_batch([data[i][0] for i in batch])
        out[batch] = torch.softmax(model(ids, mask).float(), -1)
        if bar:
            bar.update()
    if bar:
        bar.close()
    model.train(was_training)
    return out


def predict(model: EncoderClassifier, data: list[tuple[list[int], int]], batch_size: int = 32,
            progress: str | None = None) -> list[int]:
    """Predicted class (the most probable, ``probabilities``) of each ``(ids, label)`` pair,
    in ``data``'s order."""
    return probabilities(model, data, batch_size, progress).argmax(-1).tolist()


def accuracy(pred: list[int], data: list[tuple[list[int], int]]) -> float:
    """Share of ``pred`` equal to ``data``'s labels (same order)."""
    return sum(p == label for p, (_, label) in zip(pred, data, strict=True)) / len(data)


def evaluate(model: EncoderClassifier, data: list[tuple[list[int], int]],
             batch_size: int = 32, progress: str | None = None) -> float:
    """Accuracy of ``model`` on ``(ids, label)`` pairs (``predict``)."""
    return accuracy(predict(model, data, batch_size, progress), data)


@dataclass
class Run:
    """One training run's settings: ``mode`` (``dense``, ``mita`` or ``mixed``: a random
    attention per step over tied weights), ``steps``, ``batch_size``, ``lr``,
    ``time_budget_min``, ``eval_every``, the ``seed`` of its batch order and modes, and
    ``class_weights``: the cross-entropy weight of each class (None: all 1; ``--class-weight
    balanced``: n_rows / (n_classes × the class's rows))."""

    mode: str
    steps: int
    batch_size: int = 32
    lr: float = 1e-3
    time_budget_min: float = 25.0
    eval_every: int = 500
    seed: int = 0
    label: str = ""
    class_weights: list[float] | None = None


@dataclass
class Result:
    """What ``fit`` did: ``history`` (per evaluation: step, loss, validation accuracy per
    attention), ``steps`` run in all, ``wall_s`` of this call, ``tokens`` trained on in this
    call (real tokens, no padding) and ``tokens_per_s``; ``budget_stop``: None, or what the
    time budget cut short (the step, the schedule's share run, the learning rate left)."""

    history: list[dict] = field(default_factory=list)
    steps: int = 0
    wall_s: float = 0.0
    tokens: int = 0
    budget_stop: dict | None = None

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s if self.wall_s else 0.0


def fit(models: dict[str, EncoderClassifier], run: Run, train: list[tuple[list[int], int]],
        val: list[tuple[list[int], int]], state_dir: Path | None = None, resume: bool = False,
        checkpoint_every: int = 0, clock=time.perf_counter) -> Result:
    """Train ``models[run.mode]`` (``mixed``: a random one of ``models`` per step; all tied)
    on ``train``, evaluating every attention of ``models`` on ``val`` every ``eval_every``
    steps and at the end. ``state_dir``: where the training state (``save_state``) is saved
    every ``checkpoint_every`` steps (0: never) and when the time budget ends the run;
    ``resume``: go on from the state there (raises ValueError when it was saved by a run with
    other settings). ``clock``: seconds, for the time budget and ``wall_s``."""
    rng = random.Random(run.seed)
    model = models["mita" if run.mode == "mixed" else run.mode]
    opt = torch.optim.AdamW(model.parameters(), lr=run.lr, weight_decay=0.01)
    sched = one_cycle(opt, run.lr, run.steps)
    res, first = Result(), 1
    batches: list[list[int]] = []
    if resume and state_dir is not None and (state_dir / STATE_FILES[1]).is_file():
        first, batches, res.history = load_state(state_dir, model, opt, sched, rng, run)
    start = clock()
    bar = Progress(run.steps, run.label or f"train[{run.mode}]", "step",
                   interval_s=LOG_INTERVAL_S)
    weight = (torch.tensor(run.class_weights, dtype=torch.float32)
              if run.class_weights is not None else None)
    bar.update(first - 1)
    step = first - 1
    for step in range(first, run.steps + 1):
        if not batches:
            batches = length_batches([len(x) for x, _ in train], run.batch_size, rng)
        batch = batches.pop()
        ids, mask = pad_batch([train[i][0] for i in batch])
        labels = torch.tensor([train[i][1] for i in batch])
        mode = rng.choice(ATTENTIONS) if run.mode == "mixed" else run.mode
        loss = torch.nn.functional.cross_entropy(models[mode](ids, mask), labels, weight=weight)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        res.tokens += int((~mask).sum())
        bar.update()
        bar.phase(f"loss={loss.item():.3f}, mode={mode}")
        out_of_time = clock() - start > 60 * run.time_budget_min
        if step % run.eval_every == 0 or step == run.steps or out_of_time:
            acc = {a: evaluate(m, val) for a, m in models.items()}
            res.history.append({"step": step, "loss": loss.item(), "val_accuracy": acc})
            bar.write(f"step {step}/{run.steps}: loss {loss.item():.3f}, validation accuracy "
                      + ", ".join(f"{a} {100 * v:.1f} %" for a, v in acc.items()))
        if state_dir is not None and ((checkpoint_every and step % checkpoint_every == 0)
                                      or out_of_time):
            save_state(state_dir, model, opt, sched, rng, run, step, batches, res.history)
        if out_of_time and step < run.steps:
            lr = sched.get_last_lr()[0]
            res.budget_stop = {"step": step, "steps": run.steps,
                               "schedule_share": step / run.steps, "lr": lr, "peak_lr": run.lr}
            bar.write(f"time budget of {run.time_budget_min:g} min (--time-budget-min) reached "
                      f"at step {step} of {run.steps}: the one-cycle schedule ran "
                      f"{100 * step / run.steps:.0f} % of its length and stopped at learning "
                      f"rate {lr:.1e} (peak {run.lr:.1e}) before annealing to its end; raise "
                      "--time-budget-min or lower --steps for a finished schedule")
            break
    bar.close()
    res.steps, res.wall_s = step, clock() - start
    return res


def one_cycle(opt, lr: float, steps: int):
    """The one-cycle schedule (warm-up for 10 % of ``steps``, then cosine annealing), with a
    longer warm-up where 10 % is not more than one step (OneCycleLR divides by the warm-up's
    length); a single step runs at ``lr``."""
    if steps == 1:
        return torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)
    pct = 0.1 if 0.1 * steps > 1 else 1.5 / steps
    return torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps,
                                               pct_start=pct)


def save_state(folder: Path, model, opt, sched, rng: random.Random, run: Run, step: int,
               batches: list[list[int]], history: list[dict]) -> None:
    """The training state after ``step``: tensors in safetensors, the rest in JSON."""
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {f"model.{k}": v.detach().contiguous() for k, v in model.state_dict().items()}
    opt_state = opt.state_dict()
    for i, st in opt_state["state"].items():
        for k, v in st.items():
            tensors[f"opt.{i}.{k}"] = v.detach().contiguous().reshape(-1) if k == "step" else v
    save_file(tensors, folder / STATE_FILES[0])
    version, internal, gauss = rng.getstate()
    meta = {"run": run.__dict__, "step": step, "batches": batches, "history": history,
            "sched": {k: v for k, v in sched.state_dict().items() if k != "anneal_func"},
            "param_groups": opt_state["param_groups"],
            "rng": [version, list(internal), gauss], "torch_rng": torch.get_rng_state().tolist()}
    (folder / STATE_FILES[1]).write_text(json.dumps(meta) + "\n")


def load_state(folder: Path, model, opt, sched, rng: random.Random, run: Run
               ) -> tuple[int, list[list[int]], list[dict]]:
    """Restore ``save_state``'s state into ``model``, ``opt``, ``sched`` and ``rng``: returns
    (the next step, the batches left in the epoch, the evaluation history). Raises ValueError
    when the state was saved by a run with other settings."""
    meta = json.loads((folder / STATE_FILES[1]).read_text())
    if meta["run"] != run.__dict__:
        changed = sorted(k for k in run.__dict__ if meta["run"].get(k) != run.__dict__[k])
        raise ValueError(f"{folder / STATE_FILES[1]}: saved by a run with other settings "
                         f"({', '.join(changed)}); resume with the same ones or a new --out")
    tensors = load_file(folder / STATE_FILES[0])
    model.load_state_dict({k[6:]: v for k, v in tensors.items() if k.startswith("model.")})
    state: dict = {}
    for k, v in tensors.items():
        if k.startswith("opt."):
            _, i, name = k.split(".", 2)
            state.setdefault(int(i), {})[name] = v.reshape(()) if name == "step" else v
    opt.load_state_dict({"state": state, "param_groups": meta["param_groups"]})
    sched.load_state_dict(sched.state_dict() | meta["sched"])
    version, internal, gauss = meta["rng"]
    rng.setstate((version, tuple(internal), gauss))
    torch.set_rng_state(torch.tensor(meta["torch_rng"], dtype=torch.uint8))
    return meta["step"] + 1, meta["batches"], meta["history"]
