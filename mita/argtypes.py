"""argparse ``type=`` callables that parse command-line numbers strictly.

``type=float`` accepts ``nan`` and ``inf``; ``type=int`` accepts any integer. These refuse
non-finite values and values outside a range, with argparse's usual "invalid value" message
naming the flag.
"""

from __future__ import annotations

import argparse
import math


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
