"""A user's own labelled sequences: reading, checking, truncating and splitting them.

Files (by suffix):
- ``.tsv`` / ``.txt``: ``label<TAB>text`` per line; the text is everything after the first
  tab. An optional first line ``label<TAB>text`` is a header. CRLF line ends and a UTF-8 BOM
  are accepted. Blank lines are skipped and counted.
- ``.jsonl``: one JSON object per line, ``{"text": "…", "label": …}`` or
  ``{"ids": [1, 2, …], "label": …}`` (ids 1 … V − 1; 0 is padding); one kind per file.

Labels are names: any string without a tab (a JSON integer is read as its decimal name).
Class indices follow ``label_order``: numeric when every name is an integer (so "10" follows
"2"), by name otherwise. Every error names the file and the 1-based line.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from .tokenizers import BYTES, Tokenizer, ids_tokenizer, train_subword

TSV_SUFFIXES = (".tsv", ".txt")
JSONL_SUFFIXES = (".jsonl",)
TRUNCATE_SIDES = ("tail", "head")  # which end of a long sequence is cut off
# A class holding at least this share of the training rows, and 1.5× its share in a uniform
# split (75 % of two classes), gets a warning: a constant answer already scores that much.
DOMINANT_SHARE = 0.5
DOMINANT_OVER_UNIFORM = 1.5
# A class with fewer training rows than this cannot be learned or measured: warned about,
# with its likely cause (a header line, a stray label type).
MIN_CLASS_ROWS = 5
# Labels that are nearly all distinct while the texts repeat a few values: the columns are
# swapped (text<TAB>label). Both shares of the training rows.
SWAPPED_LABELS_DISTINCT = 0.5
SWAPPED_TEXTS_DISTINCT = 0.1
_INTEGER = re.compile(r"[+-]?\d+")


@dataclass(frozen=True)
class Example:
    """One labelled sequence: ``ids`` (token ids, as read), ``label`` (its name) and the
    ``line`` of ``path`` it came from; ``text``: the text of a text row (None for ids);
    ``numeric_label``: the label was a JSON number (read as its decimal name)."""

    ids: tuple[int, ...]
    label: str
    path: str
    line: int
    text: str | None = None
    numeric_label: bool = False


@dataclass
class DataFile:
    """A file read by ``read_file``: ``kind`` ``"text"`` or ``"ids"``, its examples, its
    SHA-256 and the blank lines skipped."""

    path: str
    kind: str
    examples: list[Example]
    sha256: str
    blank_lines: int = 0
    truncated: int = 0


def _where(path: Path, line: int) -> str:
    return f"{path}:{line}"


def _suffix_kind(path: Path) -> str:
    suffix = path.suffix.lower()
    if suffix in TSV_SUFFIXES:
        return "tsv"
    if suffix in JSONL_SUFFIXES:
        return "jsonl"
    raise ValueError(f"{path}: unknown data format {suffix or '(no suffix)'!r}: use "
                     f"{' or '.join(TSV_SUFFIXES + JSONL_SUFFIXES)} (label<TAB>text lines, or "
                     "JSON lines with 'text' or 'ids' and 'label')")


def read_file(path: str | Path, tokenizer: Tokenizer | None = None,
              like: DataFile | None = None) -> DataFile:
    """Read a labelled file (TSV or JSON lines, by suffix) into examples.

    ``tokenizer``: the one text rows are encoded with (default byte-level) and ids rows are
    checked against (default: none, any id ≥ 1); ``like``: the training file, whose kind of
    rows this file must have. Raises FileNotFoundError, or ValueError
    ``"path:line: …"`` for: a format this reader does not know, text that is not UTF-8, a TSV
    line without a tab, an empty label or text, a JSON line that is not an object with
    ``label`` and one of ``text`` / ``ids``, ids that are not integers in the vocabulary, a
    file mixing text and ids rows, and a file without examples."""
    path = Path(path)
    fmt = _suffix_kind(path)
    raw = path.read_bytes()
    sha256 = hashlib.sha256(raw).hexdigest()
    if raw.startswith(b"\xef\xbb\xbf"):
        raw = raw[3:]
    examples, kinds, blank = [], set(), 0
    lines = raw.split(b"\n")
    if lines and lines[-1] == b"":  # the newline that ends the last line
        lines.pop()
    for line_no, line in enumerate(lines, start=1):
        if line.endswith(b"\r"):
            line = line[:-1]
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"{_where(path, line_no)}: not UTF-8 text (byte "
                             f"0x{line[e.start]:02x} at column {e.start + 1})") from None
        if not text.strip():
            blank += 1
            continue
        if fmt == "tsv":
            if line_no == 1 and text == "label\ttext":
                continue
            ex = _tsv_row(text, path, line_no)
        else:
            ex = _json_row(text, path, line_no)
        kind = "text" if ex.text is not None else "ids"
        if kinds and kind not in kinds:
            raise ValueError(f"{_where(path, line_no)}: a {kind} row in a file of "
                             f"{kinds.pop()} rows; one kind per file")
        kinds.add(kind)
        examples.append(ex)
    if not examples:
        raise ValueError(f"{path}: no examples (an empty file, or only blank lines and a "
                         "header)")
    kind = kinds.pop()
    if like is not None and kind != like.kind:
        raise ValueError(f"{path}: {kind} rows, but the training file {like.path} has "
                         f"{like.kind} rows")
    tokenizer = tokenizer or (BYTES if kind == "text" else None)
    out = []
    for ex in examples:
        if kind == "text":
            try:
                ids = tuple(tokenizer.encode(ex.text))
            except ValueError as e:
                raise ValueError(f"{_where(path, ex.line)}: {e}") from None
        else:
            ids = ex.ids
            _check_ids(ids, tokenizer, path, ex.line)
        out.append(Example(ids, ex.label, ex.path, ex.line, ex.text, ex.numeric_label))
    return DataFile(str(path), kind, out, sha256, blank)


def _label_name(value, path: Path, line_no: int) -> str:
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise ValueError(f"{_where(path, line_no)}: label must be a string or an integer, got "
                         f"{json.dumps(value)[:40]}")
    name = str(value)
    if not name.strip():
        raise ValueError(f"{_where(path, line_no)}: empty label")
    if "\t" in name or "\n" in name:
        raise ValueError(f"{_where(path, line_no)}: label {name[:40]!r} holds a tab or a "
                         "line break")
    return name


def _tsv_row(text: str, path: Path, line_no: int) -> Example:
    if "\t" not in text:
        raise ValueError(f"{_where(path, line_no)}: expected 'label<TAB>text', found no tab")
    label, body = text.split("\t", 1)
    if not body:
        raise ValueError(f"{_where(path, line_no)}: empty text")
    return Example((), _label_name(label, path, line_no), str(path), line_no, body)


def _json_row(text: str, path: Path, line_no: int) -> Example:
    try:
        row = json.loads(text)
    except ValueError as e:
        raise ValueError(f"{_where(path, line_no)}: not JSON ({e})") from None
    if not isinstance(row, dict):
        raise ValueError(f"{_where(path, line_no)}: expected a JSON object, got "
                         f"{type(row).__name__}")
    if "label" not in row:
        raise ValueError(f"{_where(path, line_no)}: no 'label'")
    if ("text" in row) == ("ids" in row):
        raise ValueError(f"{_where(path, line_no)}: needs exactly one of 'text' and 'ids'")
    extra = sorted(set(row) - {"label", "text", "ids"})
    if extra:
        raise ValueError(f"{_where(path, line_no)}: unknown field(s) {extra}; a row has "
                         "'label' and 'text' or 'ids'")
    label = _label_name(row["label"], path, line_no)
    numeric = isinstance(row["label"], int)
    if "text" in row:
        if not isinstance(row["text"], str) or not row["text"]:
            raise ValueError(f"{_where(path, line_no)}: 'text' must be a non-empty string")
        return Example((), label, str(path), line_no, row["text"], numeric)
    ids = row["ids"]
    if (not isinstance(ids, list) or not ids
            or any(isinstance(x, bool) or not isinstance(x, int) for x in ids)):
        raise ValueError(f"{_where(path, line_no)}: 'ids' must be a non-empty list of "
                         "integers")
    return Example(tuple(ids), label, str(path), line_no, numeric_label=numeric)


def _check_ids(ids: tuple[int, ...], tokenizer: Tokenizer | None, path: Path,
               line_no: int) -> None:
    top = tokenizer.vocab_size if tokenizer is not None else None
    for pos, x in enumerate(ids):
        if x < 1 or (top is not None and x >= top):
            allowed = f"[1, {top - 1}]" if top is not None else "≥ 1"
            raise ValueError(f"{_where(path, line_no)}: id {x} at position {pos} is outside "
                             f"the vocabulary {allowed} (0 is padding)")


def unknown_label(ex: Example, known, source: str) -> ValueError:
    """The error for ``ex``, whose label is not one of ``known`` (the label names of
    ``source``: the training file, a checkpoint): ``"path:line: label … is not in …"``, with
    the likely cause when the row's text is itself one of the labels (swapped columns)."""
    why = ""
    if ex.text is not None and ex.text.strip() in known:
        why = (f"; its text {ex.text.strip()[:40]!r} is a label: are the columns swapped? "
               "A row is label<TAB>text")
    elif ex.line == 1 and ex.path.lower().endswith(TSV_SUFFIXES):
        why = ("; line 1 looks like a header: the only header read as one is 'label<TAB>text'"
               "; rename the columns or delete the line")
    return ValueError(f"{_where(Path(ex.path), ex.line)}: label {ex.label[:60]!r} is not in "
                      f"{source}{why}")


def check_not_swapped(examples: list[Example], path) -> None:
    """Raise ValueError when ``examples`` look like text<TAB>label rows read as
    label<TAB>text: nearly every label distinct (more than ``SWAPPED_LABELS_DISTINCT`` of
    the rows) while the texts hold few values (at most ``SWAPPED_TEXTS_DISTINCT`` of the
    rows). Files of fewer than 10 rows are not judged."""
    texts = Counter(ex.text for ex in examples if ex.text is not None)
    n = len(examples)
    labels = len({ex.label for ex in examples})
    if (n >= 10 and sum(texts.values()) == n and labels > SWAPPED_LABELS_DISTINCT * n
            and len(texts) <= SWAPPED_TEXTS_DISTINCT * n):
        shown = ", ".join(repr(t[:20]) for t, _ in texts.most_common(3))
        raise ValueError(f"{path}: the columns look swapped: {labels} distinct labels in {n} "
                         f"rows, while the text column holds only {len(texts)} distinct "
                         f"values ({shown}); a row is label<TAB>text")


def small_class_warnings(examples: list[Example], counts: Counter) -> list[str]:
    """A warning for each class with fewer than ``MIN_CLASS_ROWS`` of ``examples`` (the
    training rows; ``counts``: rows per label), naming its likely cause: a TSV header other
    than ``label<TAB>text`` read as a row (the class's one row is line 1), a JSON number among
    string labels, else a class too rare to learn."""
    numeric_elsewhere = any(not ex.numeric_label for ex in examples)
    out = []
    for name, n in sorted(counts.items(), key=lambda kv: (kv[1], kv[0])):
        if n >= MIN_CLASS_ROWS:
            continue
        rows = [ex for ex in examples if ex.label == name]
        first = min(rows, key=lambda ex: (ex.path, ex.line))
        where = _where(Path(first.path), first.line)
        if n == 1 and first.line == 1 and first.path.lower().endswith(TSV_SUFFIXES):
            cause = (f"its row {where} looks like a header line ({name[:40]!r}<TAB>"
                     f"{(first.text or '')[:40]!r}): the only header read as one is "
                     "'label<TAB>text'; rename the columns or delete the line")
        elif first.numeric_label and numeric_elsewhere:
            cause = (f"a stray label type: {where} has the JSON number {name} where the other "
                     "rows' labels are strings; write it as the name it stands for")
        else:
            cause = (f"first row {where}; too few rows to learn or measure it: add rows or "
                     "merge it into another class")
        out.append(f"class {name[:60]!r} has {n} training row{'s' * (n != 1)} (fewer than "
                   f"{MIN_CLASS_ROWS}): {cause}")
    return out


def label_order(names) -> list[str]:
    """The class order of a set of label names: by value when every name is an integer
    (``"2"`` before ``"10"``), else by name."""
    names = set(names)
    if all(_INTEGER.fullmatch(n) for n in names):
        return sorted(names, key=lambda n: (int(n), n))
    return sorted(names)


def truncate(ids, max_len: int, side: str):
    """``ids`` cut to at most ``max_len`` tokens: ``side="tail"`` drops the end (the first
    ``max_len`` are kept), ``"head"`` drops the start (the last ``max_len``). ``ids``: a
    tuple, list or 1-D numpy array (returned as the same type). The one cut of training,
    serving and evaluation (``mita.data.task.Task.cut``). Raises ValueError for another ``side``."""
    if side not in TRUNCATE_SIDES:
        raise ValueError(f"truncate side must be one of {TRUNCATE_SIDES}, got {side!r}")
    if len(ids) <= max_len:
        return ids
    return ids[:max_len] if side == "tail" else ids[len(ids) - max_len:]


def split(examples: list[Example], share: float, seed: int
          ) -> tuple[list[Example], list[Example]]:
    """(train, validation): a seeded shuffle (``random.Random(seed)``), the last
    ``round(share × rows)`` (at least 1) for validation. Raises ValueError when ``share`` is
    outside (0, 1) or fewer than 2 rows remain for training."""
    if not 0 < share < 1:
        raise ValueError(f"--valid-share must be in (0, 1), got {share}")
    order = list(range(len(examples)))
    random.Random(seed).shuffle(order)
    n_valid = max(1, round(share * len(examples)))
    if len(examples) - n_valid < 2:
        raise ValueError(f"{examples[0].path}: {len(examples)} rows are too few to split off "
                         f"a validation share of {share}")
    return ([examples[i] for i in order[:-n_valid]], [examples[i] for i in order[-n_valid:]])


@dataclass
class Dataset:
    """Training and validation examples with their class order, tokenizer and what was
    noticed on the way (``warnings``, ``card``)."""

    train: list[Example]
    valid: list[Example]
    labels: list[str]
    tokenizer: Tokenizer
    card: dict
    warnings: list[str] = field(default_factory=list)

    def encoded(self, which: str) -> list[tuple[list[int], int]]:
        """``(ids, class index)`` pairs of ``"train"`` or ``"valid"``."""
        index = {name: i for i, name in enumerate(self.labels)}
        return [(list(ex.ids), index[ex.label]) for ex in getattr(self, which)]


def _lengths(examples: list[Example]) -> dict:
    n = np.array([len(ex.ids) for ex in examples])
    return {"p50": float(np.percentile(n, 50)), "p99": float(np.percentile(n, 99)),
            "max": int(n.max()), "min": int(n.min())}


def load(train_path: str | Path, valid_path: str | Path | None = None,
         valid_share: float = 0.1, seed: int = 0, max_len: int | None = None,
         truncate_side: str = "tail", vocab_size: int | None = None,
         subword_vocab: int | None = None) -> Dataset:
    """Read, check, truncate and split a user's data (the training command's ``--train``,
    ``--valid`` or ``--valid-share``, ``--seed``, ``--max-len``, ``--truncate``,
    ``--vocab-size``, ``--subword-vocab``: a sentencepiece tokenizer of that many pieces
    learned from the training split's texts instead of bytes). Raises ValueError
    (``read_file``'s, and: a validation file of the other kind, a label seen only in the
    validation data, one class only, ``--vocab-size`` for text data, ``--subword-vocab`` for
    ids data or more pieces than the texts give)."""
    if truncate_side not in TRUNCATE_SIDES:
        raise ValueError(f"--truncate must be one of {TRUNCATE_SIDES}, got {truncate_side!r}")
    first = read_file(train_path)
    if first.kind == "text" and vocab_size is not None:
        raise ValueError(f"{train_path}: --vocab-size is for ids data; text is byte-level")
    if first.kind == "ids" and subword_vocab is not None:
        raise ValueError(f"{train_path}: --subword-vocab is for text data; these rows are ids")
    tok = BYTES
    if first.kind == "ids":
        tok = ids_tokenizer(vocab_size if vocab_size is not None
                            else max(max(ex.ids) for ex in first.examples) + 1)
        for ex in first.examples:
            _check_ids(ex.ids, tok, Path(train_path), ex.line)
    files = [first]
    if valid_path is not None:
        second = read_file(valid_path, tok, like=first)
        files.append(second)
        train, valid = first.examples, second.examples
    else:
        train, valid = split(first.examples, valid_share, seed)
    check_not_swapped(first.examples, train_path)
    counts = Counter(ex.label for ex in train)
    if len(counts) < 2:
        raise ValueError(f"{train_path}: one class only ({next(iter(counts))!r}); a classifier "
                         "needs two or more")
    for ex in valid:
        if ex.label not in counts:
            raise unknown_label(ex, counts, f"the training data ({train_path})")
    labels = label_order(counts)
    if subword_vocab is not None:  # learned from the training split only, then both encoded
        tok = train_subword([ex.text for ex in train], subword_vocab)
        train, valid = ([replace(ex, ids=tuple(tok.encode(ex.text))) for ex in part]
                        for part in (train, valid))
    warnings = []
    seen = {(ex.text, ex.ids): ex for ex in train}
    twins = [(ex, seen[ex.text, ex.ids]) for ex in valid if (ex.text, ex.ids) in seen]
    if twins:
        v, t = twins[0]
        warnings.append(f"{len(twins)} of {len(valid)} validation rows also appear in the "
                        f"training data (first: {v.path}:{v.line} = {t.path}:{t.line}); their "
                        "accuracy measures memory, not generalisation")
    top, top_n = counts.most_common(1)[0]
    if top_n / len(train) >= max(DOMINANT_SHARE, DOMINANT_OVER_UNIFORM / len(counts)):
        in_valid = sum(ex.label == top for ex in valid) / len(valid)
        warnings.append(f"class {top!r} is {100 * top_n / len(train):.1f} % of the training "
                        f"rows and {100 * in_valid:.1f} % of the validation rows: always "
                        "answering it scores that much on validation; read macro-F1, balanced "
                        "accuracy and the per-class recall beside accuracy")
    warnings += small_class_warnings(train, counts)
    card = {"files": [{"path": f.path, "sha256": f.sha256, "rows": len(f.examples),
                       "blank_lines": f.blank_lines} for f in files],
            "kind": first.kind, "tokenizer": tok.spec(),
            "split": ({"valid_file": str(valid_path)} if valid_path is not None
                      else {"valid_share": valid_share, "seed": seed}),
            "labels": labels,
            "class_counts": {"train": {n: counts[n] for n in labels},
                             "valid": {n: sum(ex.label == n for ex in valid) for n in labels}},
            "rows": {"train": len(train), "valid": len(valid)},
            "length_tokens": {"train": _lengths(train), "valid": _lengths(valid)}}
    if max_len is not None:
        cut = sum(len(ex.ids) > max_len for ex in train + valid)
        train, valid = ([replace(ex, ids=truncate(ex.ids, max_len, truncate_side))
                         for ex in part] for part in (train, valid))
        card["truncation"] = {"max_len": max_len, "side": truncate_side, "rows_cut": cut}
        if cut:
            warnings.append(f"{cut} of {card['rows']['train'] + card['rows']['valid']} rows "
                            f"were longer than --max-len {max_len} and lost their "
                            f"{truncate_side} (--truncate {truncate_side})")
    return Dataset(train, valid, labels, tok, card, warnings)
