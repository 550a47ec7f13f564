"""Every command the README and its pages under docs/ show, run as a newcomer runs it (CI: from
a clean clone).

``pages.README_COMMANDS`` says how each command is exercised: run here as written (``run``), run
with arguments appended that shrink it (``run`` + ``shrink``: argparse keeps a repeated
flag's last value, so the README's own flags stay in the command), run by a named test
(``test``), or not runnable on a CPU machine without Docker or Kubernetes (``no``, with the
reason). ``test_every_readme_command_is_listed`` fails when the README gains a command this
table does not know, or loses one it lists. ``test_readme_walkthrough`` starts ``make serve``
on its default ports (8000, 9100, 8265) and runs the README's commands against it in the
README's order; ``test_readme_offline_commands`` runs the ones that need no service (training,
evaluation, sweep, advisor), in a test of their own so that they run beside the service tests.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from .. import pages
from ..pages import listops_value, readme_env, sh, shrink

# heavy(5): ~39 CPU s in a serial run (the offline commands)
pytestmark = pytest.mark.heavy(5)

ROOT = Path(__file__).resolve().parents[2]
README_COMMANDS, TINY_TRAIN = pages.README_COMMANDS, pages.TINY_TRAIN
readme_commands, offline = pages.readme_commands, pages.offline
def test_every_readme_command_is_listed():
    got = readme_commands()
    assert [c for c in got if c not in README_COMMANDS] == [], "README command not covered"
    assert [c for c in README_COMMANDS if c not in got] == [], "listed but not in the README"
    for how, detail in README_COMMANDS.values():
        assert how in ("run", "test", "no")
        if how == "test" and detail.startswith("tests/"):
            path, _, name = detail.split(" ")[0].partition("::")
            assert (ROOT / path).is_file(), detail
            assert not name or f"def {name}(" in (ROOT / path).read_text(), detail




def test_listops_value_matches_the_generator():
    from mita.data.listops import ListOpsConfig, generate

    for text, label in generate(200, seed=5, cfg=ListOpsConfig(1, 200)):
        assert listops_value(text) == label, text














@pytest.mark.slow  # subprocess CLIs
def test_readme_offline_commands(tmp_path):
    """The README's commands that need no service, shrunk: tiny training runs (mixed, dense,
    mita), both evaluations on them, the sweep on both MiTA backends, the advisor and the
    committed kernel table."""
    cmds = [c for c in readme_commands() if README_COMMANDS[c][0] == "run" and offline(c)]
    env = readme_env()
    ran: set[str] = set()

    def run(command: str, timeout_s: float = 300) -> subprocess.CompletedProcess:
        ran.add(command)
        return sh(shrink(command, tmp_path), env, timeout_s)

    train = next(c for c in cmds if "-m mita.training --mode" in c)
    run(train)
    for mode in ("dense", "mita"):
        sh(shrink(train, tmp_path) + f" --mode {mode} --out {tmp_path}/runs/listops-{mode}", env)
    for c in cmds:
        if "-m mita.training.evaluate" in c:  # `python` is .venv/bin's first on PATH
            out = run(c, 300).stdout
            assert "| mixed |" in out, out
    sweep = next(c for c in cmds if "-m profiler sweep --n" in c)
    run(sweep)
    assert (tmp_path / "runs" / "sweep" / "sweep.md").is_file()
    sh(shrink(sweep, tmp_path) + f" --mita-backend torch --out {tmp_path}/runs/sweep-torch", env)
    ran.add("python -m profiler sweep --mita-backend torch|cpu|triton")
    assert (tmp_path / "runs" / "sweep-torch" / "sweep.md").is_file()
    out = run(next(c for c in cmds if "-m profiler advise" in c), 300).stdout
    assert "Recommendation" in out and (tmp_path / "runs" / "advise" / "frontier.png").is_file()
    own = next(c for c in cmds if "-m mita.training --train" in c)
    run(own)  # your own data, on the shipped real sample: a checkpoint with its task and card
    meta = json.loads((tmp_path / "runs" / "own-data" / "config.json").read_text())
    assert meta["task"]["labels"][0] == "Emma" and meta["task"]["tokenizer"] == {"kind": "bytes"}
    assert json.loads((tmp_path / "runs" / "own-data" / "data_card.json").read_text())[
        "rows"] == {"train": 72, "valid": 18}
    table = run("python -m mita.kernels.aot_table --markdown").stdout.splitlines()
    assert table[0].startswith("triton ") and table[2].startswith("| case | sm | tiles |")
    assert len(table) == 4 + 440, table[:5]  # versions, blank, header, rule, 440 rows
    assert ran >= set(cmds), set(cmds) - ran
