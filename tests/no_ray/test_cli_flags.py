"""Every command line of the project matches flags whole (``mita.tools.argtypes.Parser``): a prefix
such as ``--train`` is refused, not taken as ``--train-size``, and the refusal names the flag
meant and lists the command's flags."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from loadtest.__main__ import main as loadtest_main
from mita.training.train import main as train_main
from profiler.__main__ import main as profiler_main
from service.__main__ import main as service_main

ROOT = Path(__file__).resolve().parents[2]


def refusal(main, argv, capsys) -> str:
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    return capsys.readouterr().err


def test_a_prefix_of_a_flag_is_refused_naming_the_flag_meant(capsys, tmp_path):
    # argparse's default took --train as --train-size: "argument --train-size: invalid int
    # value: 'data.tsv'"; a file name must never be read as a number of examples.
    # (--train is now a flag of its own: a file, see test_train_data.py.)
    err = refusal(train_main, ["--test", "data.tsv", "--out", str(tmp_path)], capsys)
    assert "unrecognized arguments: --test data.tsv" in err
    assert "--test: did you mean --test-size?" in err
    flags = err.split("the flags of python -m mita.training: ", 1)[1].split()
    assert {"--train-size", "--val-size", "--out", "--steps", "--mode", "--train"} <= set(flags)
    assert flags == sorted(flags)


@pytest.mark.parametrize("main,argv,meant,prog", [
    (profiler_main, ["advise", "checkpoints/listops-default", "--max-accuracy", "1"],
     "--max-accuracy-drop", "python -m profiler advise"),
    (profiler_main, ["sweep", "--var", "mita"], "--variants", "python -m profiler sweep"),
    (loadtest_main, ["run", "--concurr", "4"], "--concurrency", "python -m loadtest run"),
    (service_main, ["--metrics-interval", "100"], "--metrics-interval-ms", "python -m service"),
])
def test_every_cli_and_subcommand_refuses_prefixes(main, argv, meant, prog, capsys):
    err = refusal(main, argv, capsys)
    assert f"did you mean {meant}" in err
    # the subcommand's own flags, not the top level's (-h only)
    assert meant in err.split(f"the flags of {prog}: ", 1)[1].split()


def test_a_whole_flag_with_equals_still_parses(capsys):
    # --n=…: argparse's own "--flag=value" form is not an abbreviation
    err = refusal(loadtest_main, ["run", "--n=0"], capsys)
    assert "argument --n: 0 is outside [1, 1048576]" in err


def test_no_command_line_is_built_on_argparse_directly():
    """A parser made with ``argparse.ArgumentParser`` would match prefixes again."""
    found = []
    for top in ("mita", "service", "profiler", "loadtest", "benchmarks", "tests"):
        for path in (ROOT / top).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                        and node.func.attr == "ArgumentParser"):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert found == []
    assert len(list((ROOT / "benchmarks").glob("*.py"))) > 5  # the scan saw the scripts
