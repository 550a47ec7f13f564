"""The project's command-line pieces: ``Parser``, ``type=`` callables that parse numbers
strictly, and ``output_folder``, a command's output folder made before its work.

``type=float`` accepts ``nan`` and ``inf``; ``type=int`` accepts any integer. These refuse
non-finite values and values outside a range, with argparse's usual "invalid value" message
naming the flag.
"""

from __future__ import annotations

import argparse
import difflib
import math
from pathlib import Path


class Parser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` for every CLI of the project: a flag is never matched by a
    prefix (``allow_abbrev=False``, so ``--train`` is not taken as ``--train-size`` and a new
    flag cannot change what an old command line means), and an unknown flag is answered with
    the closest flags and the list of this command's flags (of the subcommand given, for a
    command with subcommands). Exit status 2, as argparse."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def flags(self) -> list[str]:
        """Every long option string of this parser, sorted."""
        return sorted(s for a in self._actions for s in a.option_strings if s.startswith("--"))

    def parse_args(self, args=None, namespace=None):
        namespace, extras = self.parse_known_args(args, namespace)
        if extras:
            self._chosen(namespace).unknown(extras)
        return namespace

    def _chosen(self, namespace) -> Parser:
        """The (sub)parser that read the last subcommand of ``namespace``."""
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                chosen = action.choices.get(getattr(namespace, action.dest, None))
                if isinstance(chosen, Parser):
                    return chosen._chosen(namespace)
        return self

    def unknown(self, extras: list[str]) -> None:
        """Exit 2 with "unrecognized arguments: …", a "did you mean" per unknown flag, and
        this parser's flags."""
        lines = [f"unrecognized arguments: {' '.join(extras)}"]
        flags = self.flags()
        for word in (w.split("=", 1)[0] for w in extras if w.startswith("--")):
            # the flags it abbreviates first, then look-alikes (compared without the dashes,
            # which every flag shares)
            close = [f for f in flags if f.startswith(word)] or [
                "--" + f for f in difflib.get_close_matches(
                    word[2:], [f[2:] for f in flags], n=3, cutoff=0.6)]
            if close:
                lines.append(f"{word}: did you mean {' or '.join(close)}?")
        lines.append(f"the flags of {self.prog}: {' '.join(flags)}")
        self.error("\n".join(lines))


def bounded(kind: type, lo: float | None = None, hi: float | None = None,
            above_lo: bool = False):
    """A ``type=`` callable: ``kind`` (int or float) in [lo, hi] (``above_lo``: lo itself
    refused), finite. Raises ``argparse.ArgumentTypeError`` otherwise (argparse turns it into
    exit status 2 with the flag's name)."""

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a valid {kind.__name__}") from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
        if (lo is not None and (value < lo or (above_lo and value == lo))) or (
                hi is not None and value > hi):
            span = (f"{'(' if above_lo else '['}{lo if lo is not None else '-inf'}, "
                    f"{hi if hi is not None else 'inf'}]")
            raise argparse.ArgumentTypeError(f"{text} is outside {span}")
        return value

    parse.__name__ = kind.__name__  # argparse names the type in its message
    return parse


POSITIVE_INT = bounded(int, 1)
NONNEGATIVE_INT = bounded(int, 0)
POSITIVE_FLOAT = bounded(float, 0.0, above_lo=True)


def output_folder(flag: str, path: Path) -> Path:
    """Make the folder ``path`` a command writes to (``flag``: the option that named it), with
    its parents, before the command's work, so that a bad one fails at once and not after it.
    Returns ``path``. Raises ValueError ``"FLAG PATH: is a file, not a folder"``, or ``"FLAG
    PATH: <reason>"`` when it cannot be made (a file on the way, no permission)."""
    if path.exists() and not path.is_dir():
        raise ValueError(f"{flag} {path}: is a file, not a folder")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"{flag} {path}: {e.strerror}") from None
    return path
