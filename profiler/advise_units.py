"""The finished units of an advisor run (``profiler.advise``): each unit's result appended to
``advise.jsonl`` as it finishes, under a header holding the run's key, so a run stopped by its
time budget (or Ctrl-C) resumes where it stopped; and the dense probabilities saved beside it."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np


def load_dense_probs(path: Path) -> np.ndarray:
    try:
        return np.load(path)
    except OSError:
        raise ValueError(f"{path} is missing: the run in {path.parent} cannot resume; pass "
                         "--fresh") from None


class UnitStore:
    """The finished units of a run (``advise.jsonl``), appended as each one finishes."""

    def __init__(self, path: Path, key: dict, fresh: bool):
        self.path, self.done = path, {}
        if path.exists() and not fresh:
            try:
                lines = path.read_text().splitlines()
                header = json.loads(lines[0]) if lines else {}
                if not isinstance(header, dict):
                    raise ValueError("its first line is not a header")
                units = [json.loads(line) for line in lines[1:] if line.strip()]
            except (ValueError, UnicodeDecodeError) as e:
                raise ValueError(f"{path} is damaged ({e}); pass --fresh to start over") from None
            if header.get("key") != key:
                raise ValueError(f"{path} holds a run with other inputs ({_diff(header, key)}); "
                                 "pass --fresh to start over or choose another --out")
            for unit in units:
                self.done[tuple(unit["unit"])] = unit
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps({"key": key}) + "\n")
        self.resumed = len(self.done)

    def add(self, unit: tuple, result: dict) -> dict:
        record = {"unit": list(unit), **result}
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        self.done[unit] = record
        return record


def _diff(header: dict, key: dict) -> str:
    old = header.get("key") or {}
    changed = sorted(k for k in set(old) | set(key) if old.get(k) != key.get(k))
    return "differs in " + ", ".join(changed) if changed else "no header"
