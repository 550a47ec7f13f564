"""Readers for users' own data: LRA's released ListOps TSVs and byte-level text TSVs.

Errors name the file, the 1-based line number and what was wrong.
"""

from __future__ import annotations

import csv
from pathlib import Path

from .listops import NUM_CLASSES, encode
from .tokenizers import BYTES

LRA_HEADER = ["Source", "Target"]


def read_lra_listops(path: str | Path) -> list[tuple[list[int], int]]:
    """Read an LRA ListOps TSV (header ``Source<TAB>Target``) into ``(ids, label)`` pairs.

    ``Source`` is the tree with ``(`` ``)`` pairs, which are dropped; ``]`` is kept.
    Raises: ValueError ``"path:line: …"`` for a wrong header, a row without exactly two
    columns, an empty source, an unknown token or a label outside 0-9.
    """
    path = Path(path)
    out = []
    with open(path, newline="", encoding="utf-8") as f:
        for line_no, row in enumerate(csv.reader(f, delimiter="\t"), start=1):
            if line_no == 1:
                if row != LRA_HEADER:
                    raise ValueError(f"{path}:1: expected header {LRA_HEADER}, got {row[:4]}")
                continue
            if not row:
                continue
            if len(row) != 2:
                raise ValueError(f"{path}:{line_no}: expected 2 tab-separated columns "
                                 f"(Source, Target), got {len(row)}")
            source, target = row
            try:
                ids = encode(source)
            except ValueError as e:
                raise ValueError(f"{path}:{line_no}: {e}") from None
            if not ids:
                raise ValueError(f"{path}:{line_no}: empty Source")
            out.append((ids, _label(target, NUM_CLASSES, path, line_no)))
    if not out:
        raise ValueError(f"{path}: no rows after the header")
    return out


def encode_bytes(text: str) -> list[int]:
    """UTF-8 bytes of ``text`` as ids ``byte + 1`` (0 is padding): the byte-level
    tokenizer's (``tokenizers.BYTES``)."""
    return BYTES.encode(text)


def read_text_tsv(path: str | Path, num_classes: int) -> list[tuple[list[int], int]]:
    """Read ``label<TAB>text`` lines (an optional ``label<TAB>text`` header) into byte-level
    ``(ids, label)`` pairs; the text is everything after the first tab.

    Raises: ValueError ``"path:line: …"`` for a line without a tab, a label that is not an
    integer in ``[0, num_classes)``, or empty text.
    """
    path = Path(path)
    out = []
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            line = line.rstrip("\n").rstrip("\r")
            if not line or (line_no == 1 and line == "label\ttext"):
                continue
            if "\t" not in line:
                raise ValueError(f"{path}:{line_no}: expected 'label<TAB>text', found no tab")
            label, text = line.split("\t", 1)
            if not text:
                raise ValueError(f"{path}:{line_no}: empty text")
            out.append((encode_bytes(text), _label(label, num_classes, path, line_no)))
    if not out:
        raise ValueError(f"{path}: no rows")
    return out


def _label(text: str, num_classes: int, path: Path, line_no: int) -> int:
    try:
        value = int(text.strip())
    except ValueError:
        raise ValueError(f"{path}:{line_no}: label {text[:20]!r} is not an integer") from None
    if not 0 <= value < num_classes:
        raise ValueError(f"{path}:{line_no}: label {value} outside [0, {num_classes})")
    return value
