"""A user's labelled files (``mita.data.labelled``), their tokenizers and the checkpoint's task
(``mita.data.task``): every refusal with its exact message, and the numbers a data card gives,
worked out by hand."""

from __future__ import annotations

import gzip
import hashlib
import json

import numpy as np
import pytest

from mita.config import ModelConfig
from mita.data import labelled
from mita.data.images import main as images_main
from mita.data.images import pool, read_idx, write_jsonl
from mita.data.task import checkpoint_task, label_maps
from mita.data.tokenizers import BYTES, LISTOPS, from_spec, ids_tokenizer
from mita.data.vocab import Vocabulary
from service.inputs import ApiError, to_ids
from service.schemas import ClassifyRequest


def write(tmp_path, name: str, data: bytes | str):
    path = tmp_path / name
    path.write_bytes(data.encode() if isinstance(data, str) else data)
    return path


def refused(path, **kw) -> str:
    with pytest.raises(ValueError) as e:
        labelled.load(path, **kw)
    return str(e.value)


def test_tsv_with_bom_crlf_header_and_blank_lines(tmp_path):
    raw = b"\xef\xbb\xbflabel\ttext\r\npos\tgood\tfilm\r\n\r\nneg\tbad\r\npos\t\xc3\xa9\n"
    f = labelled.read_file(write(tmp_path, "a.tsv", raw))
    assert f.kind == "text" and f.blank_lines == 1
    assert f.sha256 == hashlib.sha256(raw).hexdigest()  # of the file as it is, BOM and all
    # the text is everything after the first tab; bytes b → ids b + 1
    assert [(ex.label, ex.line, ex.text, ex.ids) for ex in f.examples] == [
        ("pos", 2, "good\tfilm", tuple(b + 1 for b in b"good\tfilm")),
        ("neg", 4, "bad", (99, 98, 101)),
        ("pos", 5, "é", (0xC3 + 1, 0xA9 + 1))]


@pytest.mark.parametrize("name,data,why", [
    ("a.tsv", "pos\tok\nno tab here\n", "a.tsv:2: expected 'label<TAB>text', found no tab"),
    ("a.tsv", "pos\tok\nneg\t\n", "a.tsv:2: empty text"),
    ("a.tsv", "pos\tok\n \tx\n", "a.tsv:2: empty label"),
    ("a.tsv", b"pos\tok\nneg\tb\xffd\n", "a.tsv:2: not UTF-8 text (byte 0xff at column 6)"),
    ("a.tsv", "", "a.tsv: no examples (an empty file, or only blank lines and a header)"),
    ("a.tsv", "label\ttext\n\n", "a.tsv: no examples (an empty file, or only blank lines and "
                                 "a header)"),
    ("a.csv", "pos,ok\n", "a.csv: unknown data format '.csv': use .tsv or .txt or .jsonl "
                          "(label<TAB>text lines, or JSON lines with 'text' or 'ids' and "
                          "'label')"),
    ("a.jsonl", '{"text": "ok", "label": 1}\n[1, 2]\n', "a.jsonl:2: expected a JSON object, "
                                                        "got list"),
    ("a.jsonl", '{"text": "ok"}\n', "a.jsonl:1: no 'label'"),
    ("a.jsonl", '{"text": "ok", "ids": [1], "label": 1}\n',
     "a.jsonl:1: needs exactly one of 'text' and 'ids'"),
    ("a.jsonl", '{"label": 1}\n', "a.jsonl:1: needs exactly one of 'text' and 'ids'"),
    ("a.jsonl", '{"text": "ok", "label": 1, "weight": 2}\n',
     "a.jsonl:1: unknown field(s) ['weight']; a row has 'label' and 'text' or 'ids'"),
    ("a.jsonl", '{"text": "", "label": 1}\n', "a.jsonl:1: 'text' must be a non-empty string"),
    ("a.jsonl", '{"ids": [1, 2.5], "label": 1}\n',
     "a.jsonl:1: 'ids' must be a non-empty list of integers"),
    ("a.jsonl", '{"ids": [], "label": 1}\n',
     "a.jsonl:1: 'ids' must be a non-empty list of integers"),
    ("a.jsonl", '{"ids": [3, 0, 2], "label": 1}\n',
     "a.jsonl:1: id 0 at position 1 is outside the vocabulary ≥ 1 (0 is padding)"),
    ("a.jsonl", '{"ids": [1], "label": true}\n',
     "a.jsonl:1: label must be a string or an integer, got true"),
    ("a.jsonl", '{"ids": [1], "label": "a\\tb"}\n',
     "a.jsonl:1: label 'a\\tb' holds a tab or a line break"),
    ("a.jsonl", '{"ids": [1], "label": 1}\n{"text": "x", "label": 2}\n',
     "a.jsonl:2: a text row in a file of ids rows; one kind per file"),
    ("a.jsonl", '{"ids": [1], "label": 1}\n{"ids": [1], "label": 2\n',
     "a.jsonl:2: not JSON (Expecting ',' delimiter: line 1 column 24 (char 23))"),
])
def test_each_bad_row_is_named_by_file_and_line(tmp_path, name, data, why):
    path = write(tmp_path, name, data)
    with pytest.raises(ValueError) as e:
        labelled.read_file(path)
    assert str(e.value) == f"{tmp_path}/{why}"


def test_ids_outside_the_given_vocabulary_and_the_validation_files_checks(tmp_path):
    train = write(tmp_path, "t.jsonl", '{"ids": [1, 7], "label": "a"}\n'
                                       '{"ids": [2], "label": "b"}\n{"ids": [3], "label": "a"}\n')
    why = refused(train, vocab_size=7)
    assert why == f"{train}:1: id 7 at position 1 is outside the vocabulary [1, 6] (0 is padding)"
    # the training file sets the vocabulary (largest id + 1 = 8): the validation file keeps it
    valid = write(tmp_path, "v.jsonl", '{"ids": [8], "label": "a"}\n')
    assert refused(train, valid_path=valid) == (
        f"{valid}:1: id 8 at position 0 is outside the vocabulary [1, 7] (0 is padding)")
    valid = write(tmp_path, "v2.jsonl", '{"ids": [1], "label": "a"}\n{"ids": [2], "label": "c"}\n')
    assert refused(train, valid_path=valid) == (
        f"{valid}:2: label 'c' is not in the training data ({train})")
    valid = write(tmp_path, "v3.tsv", "a\tx\n")
    assert refused(train, valid_path=valid) == (
        f"{valid}: text rows, but the training file {train} has ids rows")
    text = write(tmp_path, "x.tsv", "a\tx\nb\ty\n")
    assert refused(text, vocab_size=9) == (
        f"{text}: --vocab-size is for ids data; text is byte-level")
    one = write(tmp_path, "one.tsv", "a\tx\na\ty\na\tz\n")
    assert refused(one, valid_share=0.34) == (
        f"{one}: one class only ('a'); a classifier needs two or more")
    assert refused(text, truncate_side="middle") == (
        "--truncate must be one of ('tail', 'head'), got 'middle'")


def test_labels_sort_numerically_when_all_are_integers():
    assert labelled.label_order(["10", "2", "1", "-3"]) == ["-3", "1", "2", "10"]
    assert labelled.label_order(["10", "2", "b"]) == ["10", "2", "b"]  # names: by name
    assert labelled.label_order(["01", "1", "2"]) == ["01", "1", "2"]  # equal values: by name


def test_truncation_rule_and_the_card(tmp_path):
    assert labelled.truncate((1, 2, 3, 4), 2, "tail") == (1, 2)
    assert labelled.truncate((1, 2, 3, 4), 2, "head") == (3, 4)
    assert labelled.truncate((1, 2), 2, "head") == (1, 2)
    rows = [("b", "x" * 10), ("a", "y" * 3), ("b", "z" * 4), ("a", "w" * 7), ("b", "v")]
    train = write(tmp_path, "t.tsv", "".join(f"{lab}\t{txt}\n" for lab, txt in rows))
    valid = write(tmp_path, "v.tsv", "a\tyyy\nb\tqqqqqq\n")  # row 1 repeats training line 2
    d = labelled.load(train, valid, max_len=5, truncate_side="head")
    assert d.labels == ["a", "b"]
    assert d.encoded("train") == [([ord("x") + 1] * 5, 1), ([ord("y") + 1] * 3, 0),
                                  ([ord("z") + 1] * 4, 1), ([ord("w") + 1] * 5, 0),
                                  ([ord("v") + 1], 1)]
    assert d.encoded("valid") == [([ord("y") + 1] * 3, 0), ([ord("q") + 1] * 5, 1)]
    card = d.card
    assert card["class_counts"] == {"train": {"a": 2, "b": 3}, "valid": {"a": 1, "b": 1}}
    assert card["rows"] == {"train": 5, "valid": 2}
    # lengths before truncation: 10, 3, 4, 7, 1 → p50 4; p99 = 7 + 0.96 · (10 − 7) = 9.88
    assert card["length_tokens"]["train"] == {"p50": 4.0, "p99": pytest.approx(9.88),
                                              "max": 10, "min": 1}
    assert card["truncation"] == {"max_len": 5, "side": "head", "rows_cut": 3}  # 10, 7, 6
    assert card["split"] == {"valid_file": str(valid)}
    assert d.warnings == [
        f"1 of 2 validation rows also appear in the training data (first: {valid}:1 = "
        f"{train}:2); their accuracy measures memory, not generalisation",
        f"class 'a' has 2 training rows (fewer than 5): first row {train}:2; too few rows to "
        "learn or measure it: add rows or merge it into another class",
        f"class 'b' has 3 training rows (fewer than 5): first row {train}:1; too few rows to "
        "learn or measure it: add rows or merge it into another class",
        "3 of 7 rows were longer than --max-len 5 and lost their head (--truncate head)"]


def test_seeded_split_and_the_dominant_class_warning(tmp_path):
    path = write(tmp_path, "t.tsv", "".join(f"{'a' if i < 8 else 'b'}\tt{i}\n"
                                            for i in range(10)))
    d = labelled.load(path, valid_share=0.2, seed=3)
    again = labelled.load(path, valid_share=0.2, seed=3)
    assert [ex.line for ex in d.valid] == [ex.line for ex in again.valid]
    assert len(d.train) == 8 and len(d.valid) == 2
    assert sorted(ex.line for ex in d.train + d.valid) == list(range(1, 11))
    assert d.card["split"] == {"valid_share": 0.2, "seed": 3}
    other = labelled.load(path, valid_share=0.2, seed=4)
    assert [ex.line for ex in other.valid] != [ex.line for ex in d.valid]
    share = d.card["class_counts"]["train"]["a"] / 8
    in_valid = sum(ex.label == "a" for ex in d.valid) / 2
    b_rows = sorted(ex.line for ex in d.train if ex.label == "b")
    assert d.warnings == [
        f"class 'a' is {100 * share:.1f} % of the training rows and {100 * in_valid:.1f} % of "
        "the validation rows: always answering it scores that much on validation; read "
        "macro-F1, balanced accuracy and the per-class recall beside accuracy",
        f"class 'b' has {len(b_rows)} training row{'s' * (len(b_rows) != 1)} (fewer than 5): "
        f"first row {path}:{b_rows[0]}; too few rows to learn or measure it: add rows or "
        "merge it into another class"]
    # two classes at 70 %: below 1.5 × the uniform 50 %, no warning; at 75 %, one
    valid = write(tmp_path, "v.tsv", "a\tv1\nb\tv2\n")
    for a, warned in ((7, False), (75, True)):
        path = write(tmp_path, "u.tsv", "".join(f"{'a' if i < a else 'b'}\tt{i}\n"
                                                for i in range(10 * (a // 7 if a == 7 else 10))))
        assert any(" % of the training rows" in w
                   for w in labelled.load(path, valid).warnings) is warned


def test_tokenizers_and_their_specs():
    # the gateway's tokenizing of a text for a byte-level checkpoint (mita.data.task)
    assert to_ids(ClassifyRequest(text="hé"), 10, BYTES.vocab, BYTES).tolist() == [
        ord("h") + 1, 0xC3 + 1, 0xA9 + 1]
    with pytest.raises(ApiError, match="^this model takes token ids"):
        to_ids(ClassifyRequest(text="x"), 10, Vocabulary(50), ids_tokenizer(50))
    assert BYTES.encode("aé") == [98, 0xC3 + 1, 0xA9 + 1] and BYTES.vocab_size == 257
    assert LISTOPS.encode("[MAX 2 3 ]") == [12, 3, 4, 15]
    with pytest.raises(ValueError, match="^this model takes token ids"):
        ids_tokenizer(100).encode("text")
    for tok in (BYTES, LISTOPS, ids_tokenizer(100)):
        assert from_spec(json.loads(json.dumps(tok.spec()))) == tok
    with pytest.raises(ValueError, match=r"^an ids vocabulary size must be an int in \[2, "):
        ids_tokenizer(1)
    with pytest.raises(ValueError, match=r"^tokenizer 'bytes' takes only \['kind'\]"):
        from_spec({"kind": "bytes", "vocab_size": 257})
    with pytest.raises(ValueError, match=r"^tokenizer must be an object with 'kind' one of"):
        from_spec({"kind": "wordpiece"})
    with pytest.raises(ValueError, match=r"^tokenizer 'sentencepiece' needs file "
                                         r"'tokenizer.model' beside config.json$"):
        from_spec({"kind": "sentencepiece", "file": "other.model", "vocab_size": 9}, ".")


def test_checkpoint_task_reads_back_and_refuses_what_does_not_fit():
    cfg = ModelConfig(vocab_size=257, num_classes=3)
    spec = {"name": "reviews", "labels": ["neg", "neu", "pos"], "tokenizer": {"kind": "bytes"},
            "max_length": 512, "truncate": "tail"}
    task = checkpoint_task({"task": spec}, cfg, "ck")
    assert (task.name, task.labels, task.tokenizer, task.vocab.size, task.grid) == (
        "reviews", ("neg", "neu", "pos"), BYTES, 257, None)
    assert task.spec() == spec
    assert label_maps(task.labels) == {"id2label": {"0": "neg", "1": "neu", "2": "pos"},
                                       "label2id": {"neg": 0, "neu": 1, "pos": 2}}
    # no task: the ListOps vocabulary is ListOps, with the values as names
    old = checkpoint_task({}, ModelConfig(), "ck")
    assert old.listops and old.labels == tuple("0123456789")
    for change, why in (
            ({"labels": ["neg", "pos"]}, "task 'labels' must be 3 distinct names (num_classes)"),
            ({"labels": ["a", "a", "b"]}, "task 'labels' must be 3 distinct names"),
            ({"tokenizer": {"kind": "ids", "vocab_size": 100}},
             "the task's tokenizer has 100 ids (0 padding); the model has vocab_size 257"),
            ({"truncate": None}, "task 'truncate' must be one of ('tail', 'head') with a "
                                 "max_length, null without"),
            ({"max_length": 0}, "task 'max_length' must be null or an int ≥ 1"),
            ({"name": ""}, "task 'name' must be 1-200 characters")):
        with pytest.raises(ValueError) as e:
            checkpoint_task({"task": spec | change}, cfg, "ck")
        assert str(e.value).startswith(f"ck/config.json: {why}"), str(e.value)


def idx(array: np.ndarray) -> bytes:
    """``array`` (uint8) in the IDX format: 0, 0, dtype 0x08, ndim, big-endian dims, data."""
    return (bytes([0, 0, 8, array.ndim]) + np.array(array.shape, ">u4").tobytes()
            + array.astype(np.uint8).tobytes())


def test_images_become_pixel_id_rows_with_their_grid(tmp_path, capsys):
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (3, 4, 6)).astype(np.uint8)
    (tmp_path / "im.idx.gz").write_bytes(gzip.compress(idx(images)))
    (tmp_path / "lab.idx").write_bytes(idx(np.array([9, 0, 3], np.uint8)))
    assert np.array_equal(read_idx(tmp_path / "im.idx.gz"), images)
    # 2×2 blocks averaged, half up: [[0, 1], [2, 4]] → 1.75 → 2; [[0, 0], [1, 2]] → 0.75 → 1
    # and the tie 0.5 → 1
    block = np.array([[[0, 1, 0, 0], [2, 4, 1, 2]]], np.uint8)
    assert pool(block, 2).tolist() == [[[2, 1]]]
    assert pool(np.array([[[0, 1], [0, 1]]], np.uint8), 2).tolist() == [[[1]]]
    with pytest.raises(ValueError, match=r"^--pool 4 does not divide the 4×6 images$"):
        pool(images, 4)
    out = tmp_path / "px.jsonl"
    images_main([str(tmp_path / "im.idx.gz"), str(tmp_path / "lab.idx"), "--out", str(out),
                 "--names", "fashion-mnist", "--pool", "2", "--limit", "2"])
    got = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["label"] for r in got] == ["Ankle boot", "T-shirt/top"]
    assert got[0]["ids"] == (pool(images[:1], 2).reshape(-1).astype(int) + 1).tolist()
    assert "2 images of 2×3" in capsys.readouterr().err
    d = labelled.load(out, valid_path=out)
    assert d.tokenizer == ids_tokenizer(max(max(r["ids"]) for r in got) + 1)
    with pytest.raises(ValueError, match=r"^label 9 has no name \(names of 0…1\)$"):
        write_jsonl(tmp_path / "x.jsonl", images, np.array([9, 0, 3], np.uint8), ("a", "b"))
    (tmp_path / "bad.idx").write_bytes(b"\0\0\x0d\x01" + b"\0" * 8)
    with pytest.raises(ValueError, match=r"bad.idx: not an unsigned-byte IDX file \(header "
                                         r"00000d01\)$"):
        read_idx(tmp_path / "bad.idx")
    (tmp_path / "short.idx").write_bytes(idx(images)[:-1])
    with pytest.raises(ValueError, match=r"short.idx: header says \(3, 4, 6\) = 72 values, the "
                                         r"file holds 71$"):
        read_idx(tmp_path / "short.idx")
