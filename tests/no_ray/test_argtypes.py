"""Command-line numbers at their edges (``mita.tools.argtypes``): every CLI's bounds are these."""

from __future__ import annotations

import argparse

import pytest

from mita.tools.argtypes import NONNEGATIVE_INT, POSITIVE_FLOAT, POSITIVE_INT, bounded


@pytest.mark.parametrize("parse,text,value", [
    (POSITIVE_INT, "1", 1), (NONNEGATIVE_INT, "0", 0), (POSITIVE_FLOAT, "1e-300", 1e-300),
    (bounded(int, 1, 5), "5", 5), (bounded(float, -1.0, 1.0), "-1", -1.0),
])
def test_values_at_the_edge_are_accepted(parse, text, value):
    got = parse(text)
    assert got == value and type(got) is type(value)


@pytest.mark.parametrize("parse,text,message", [
    (POSITIVE_INT, "0", "0 is outside [1, inf]"),
    (NONNEGATIVE_INT, "-1", "-1 is outside [0, inf]"),
    (POSITIVE_FLOAT, "0", "0 is outside (0.0, inf]"),
    (bounded(int, 1, 5), "6", "6 is outside [1, 5]"),
    (bounded(float, None, 2.5), "2.6", "2.6 is outside [-inf, 2.5]"),
    (POSITIVE_INT, "1.5", "'1.5' is not a valid int"),
    (POSITIVE_FLOAT, "nan", "'nan' is not a finite number"),
    (POSITIVE_FLOAT, "inf", "'inf' is not a finite number"),
])
def test_values_past_the_edge_are_refused_naming_the_range(parse, text, message):
    with pytest.raises(argparse.ArgumentTypeError) as e:
        parse(text)
    assert str(e.value) == message


def test_argparse_names_the_type():
    assert POSITIVE_INT.__name__ == "int" and POSITIVE_FLOAT.__name__ == "float"
