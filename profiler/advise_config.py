"""The (m, k, s) advisor's configuration (``profiler.advise``): a MiTA setting and how the command
line names one, the default grid, the quality constraint a setting must meet, the inputs of one
run with the key that makes two runs' units interchangeable, and the rounding rule of a drop in
points. Both the advisor's run (``profiler.advise``) and its answer (``profiler.recommend``)
import them from here, so neither imports the other's module in a circle."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path

import torch

from mita import config
from mita.cost import fig5_setting
from mita.model import checkpoint_metadata

from .advise_report import METRIC_NAMES

FIXED_SIDES = (8, 16, 32, 64)  # m = k of the fixed small settings in the default grid
UNIT_FORMAT = 3  # in the run key: units written by another version are not mixed in

# Accuracies and agreements are k / n for n sequences (n far below 10⁹): rounding at 9 digits
# removes float noise of a subtraction and can never merge two distinct values.
DROP_DIGITS = 9


def drop_points(dense: dict, row: dict, metric: str = "accuracy") -> float:
    """Dense's ``metric`` (accuracy, macro-F1 or balanced accuracy) minus ``row``'s, in points
    (100 × the difference), rounded at ``DROP_DIGITS``: exact for accuracies that are counts
    over the same sequences."""
    return round(100 * (dense[metric] - row[metric]), DROP_DIGITS) + 0.0


@dataclass(frozen=True)
class Setting:
    """One MiTA setting: m, k, s and the shared-branch scaling (``mita.config.ModelConfig``
    names in ``overrides``)."""

    m: int
    k: int
    s: int = 1
    shared_scale: str = "paper"

    @property
    def name(self) -> str:
        return config.setting_name(self.m, self.k, self.s, self.shared_scale)

    def overrides(self) -> dict:
        return {"num_landmarks": self.m, "topk": self.k, "route_topk": self.s,
                "shared_scale": self.shared_scale}


def parse_setting(text: str, shared_scale: str = "paper") -> Setting:
    """``"MxK"`` or ``"MxKxS"`` (e.g. ``32x32x2``) → ``Setting``, read by
    ``mita.config.parse_setting`` (its errors: ValueError)."""
    return Setting(*config.parse_setting(text), shared_scale)


def default_grid(ns: list[int], shared_scales: list[str]) -> list[Setting]:
    """The paper's Fig. 5 setting of each N (m = k ≈ √(N/4), so m·k ≈ N/4) and the fixed
    m = k ∈ {8, 16, 32, 64}, each with s = 1 and s = 2, for each shared scaling."""
    sides = sorted({fig5_setting(n)[0] for n in ns} | set(FIXED_SIDES))
    return [Setting(side, side, s, scale) for scale in shared_scales for side in sides
            for s in (1, 2) if s <= side]


@dataclass(frozen=True)
class Constraint:
    """``kind``: ``"agreement"`` (predicted labels equal dense's on at least ``value``, a
    fraction) or ``"accuracy_drop"`` (the ``metric`` at most ``value`` points below dense's).
    ``metric``: the score a drop is measured in (``mita.tools.scores.HEADLINE``: ``"accuracy"``,
    ``"macro_f1"`` or ``"balanced_accuracy"``; points = 100 × the score), also the drop the
    report shows under an agreement constraint."""

    kind: str
    value: float
    metric: str = "accuracy"

    def met(self, row: dict, dense: dict) -> bool:
        """At the value is met: agreement and accuracy are counts over the same n sequences,
        so the drop is taken at ``DROP_DIGITS`` (far below the data's resolution of 100 / n
        points) and ``100 * (0.36 - 0.35)`` is 1 point, not 1.0000000000000009."""
        if self.kind == "agreement":
            return round(row["agreement"], DROP_DIGITS) >= self.value
        return drop_points(dense, row, self.metric) <= self.value

    def shortfall(self, row: dict, dense: dict) -> float:
        """How far ``row`` is from meeting the constraint (lower is closer): the setting
        that comes closest is the one a refusal names."""
        if self.kind == "agreement":
            return -row["agreement"]
        return drop_points(dense, row, self.metric)

    def describe(self) -> str:
        if self.kind == "agreement":
            return f"agreement with dense ≥ {100 * self.value:.1f} %"
        return f"{METRIC_NAMES[self.metric]} drop ≤ {self.value:g} points"


@dataclass
class AdviseConfig:
    """Inputs of one advisor run (``python -m profiler advise --help``)."""

    checkpoint: str
    ns: list[int]
    grid: list[Setting]
    constraint: Constraint
    data: str = "generated"  # "generated", or a file path
    # for a file: "lra" (LRA ListOps TSV), "text" (label<TAB>text, integer labels) or "own"
    # (your labelled file, label names: mita.data.labelled, the checkpoint's task)
    data_format: str = "lra"
    size: int = 1000
    min_length: int = 500  # generated data: LRA's test distribution, 500 < length < 2000
    max_length: int = 2000
    seed: int = 1_000_003
    device: str = "cpu"
    dtype: str = "auto"
    mita_backend: str = "auto"
    repeats: int = 5
    budget_s: float = 600.0
    out: Path = field(default_factory=lambda: Path("runs/advise"))

    def key(self) -> dict:
        """What makes two runs' units interchangeable (``advise.jsonl``'s header)."""
        meta = checkpoint_metadata(checkpoint_folder(self.checkpoint))
        task = meta.get("task") or {}
        data_id = (self.data if self.data == "generated" else
                   hashlib.sha256(Path(self.data).read_bytes()).hexdigest())
        generated = self.data == "generated"
        return {"unit_format": UNIT_FORMAT, "weights_sha256": meta["weights_sha256"],
                "data": data_id,
                "format": None if generated else self.data_format, "size": self.size,
                "lengths": [self.min_length, self.max_length] if generated else None,
                "seed": self.seed if generated else None,
                "device": self.device, "dtype": self.dtype, "mita_backend": self.mita_backend,
                "repeats": self.repeats, "torch": torch.__version__,
                "cut": [task.get("max_length"), task.get("truncate")]}


def checkpoint_folder(checkpoint: str) -> Path:
    """The checkpoint's folder (``service.engine.resolve_checkpoint``: a relative path is taken
    from the project root); the serving code is imported only when a checkpoint is read."""
    from service.engine import resolve_checkpoint

    return resolve_checkpoint(checkpoint)
