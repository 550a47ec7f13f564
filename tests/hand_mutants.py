"""Realistic one-line mistakes in the numbers users read; the fast tier must fail on each.

``python -m tests.hand_mutants`` (part of ``make mutate``, ≈ 10–20 min on 2 cores) copies the
tree to a temporary folder, checks that the fast tier passes there, applies one mutant at a
time and runs the fast tier (``-x``: it stops at the first failure), then prints a table: the
mutant, what a user would read, and the first test that failed. Exit status 1 if any mutant
survives. These are the ten of issue 33; mutmut (the rest of ``make mutate``) makes two of them
too (``-`` → ``+``, ``>=`` → ``>``) but not the other eight: it does not swap arguments, change
a list comprehension's source or mutate pydantic bounds (class attributes).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

# (file, code, mutated code, what a user would then read)
MUTANTS = [
    ("mita/timer.py", "float(start.elapsed_time(end))", "float(end.elapsed_time(start))",
     "negative stage times on every GPU"),
    ("loadtest/engine.py", "lat = np.array([s.latency_s for s in ok]) * 1e3",
     "lat = np.array([s.latency_s for s in ss]) * 1e3",
     "failed requests in the latency percentiles"),
    ("loadtest/report.py", "{r['p90_ms']:.1f} | {r['p99_ms']:.1f}",
     "{r['p99_ms']:.1f} | {r['p99_ms']:.1f}", "the p90 column prints p99"),
    ("loadtest/engine.py", "rng.exponential(1.0 / cfg.rate,", "rng.exponential(cfg.rate,",
     "an open-loop run that sends almost nothing"),
    ("service/policy.py", "acc += cfg.weights[v] / total", "acc += cfg.weights[v]",
     "weights {mita: 1, dense: 3} send everything to mita"),
    ("service/policy.py", 'kl_divergence(probs["dense"], probs["mita"])',
     'kl_divergence(probs["mita"], probs["dense"])', "KL(MiTA ‖ dense) on the dashboard"),
    ("service/recorder.py", "stats.flops_total / stats.batch_size",
     "stats.flops_total", "4× the FLOPs per request in a batch of 4"),
    ("service/config_file.py", "max_replicas: int = Field(1, ge=1,",
     "max_replicas: int = Field(1, ge=0,", "a config with no replicas accepted"),
    ("profiler/advise.py", "(b - c) ** 2 / n", "(b + c) ** 2 / n",
     "a paired standard error too small (0 when b + c = n)"),
    ("profiler/advise_config.py", 'round(row["agreement"], DROP_DIGITS) >= self.value',
     'round(row["agreement"], DROP_DIGITS) > self.value',
     "a setting that meets the agreement constraint exactly refused"),
]
FAST = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider",
        "-m", "not service and not slow"]
SKIP = shutil.ignore_patterns(".venv", ".git", "mutants", "__pycache__", "test-artifacts",
                              "runs", "*.egg-info", ".pytest_cache", ".ruff_cache")


def main() -> int:
    root = Path(__file__).resolve().parents[1]
    survived = 0
    print("| file | mutant | a user would read | first failing test |")
    print("|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(tmp) / "tree"
        shutil.copytree(root, tree, ignore=SKIP)
        base = subprocess.run(FAST, cwd=tree, text=True, capture_output=True)
        if base.returncode != 0:  # then a failure would say nothing about the mutant
            raise SystemExit(f"the fast tier fails without a mutant:\n{base.stdout[-3000:]}")
        for path, code, mutated, effect in MUTANTS:
            f = tree / path
            src = f.read_text()
            if src.count(code) != 1:
                raise SystemExit(f"{path}: {code!r} is not there exactly once; update MUTANTS")
            f.write_text(src.replace(code, mutated))
            try:
                r = subprocess.run(FAST, cwd=tree, text=True, capture_output=True)
            finally:
                f.write_text(src)
            failed = re.search(r"^(?:FAILED|ERROR) (\S+)", r.stdout, re.M)
            if r.returncode == 1 and failed:
                verdict = failed.group(1)
            else:
                survived += 1
                verdict = f"SURVIVED (pytest exit {r.returncode})"
            cell = f"`{code}` → `{mutated}`".replace("|", "\\|")
            print(f"| {path} | {cell} | {effect} | {verdict} |", flush=True)
    print(f"{len(MUTANTS) - survived} of {len(MUTANTS)} hand mutants killed")
    return 1 if survived else 0


if __name__ == "__main__":
    sys.exit(main())
