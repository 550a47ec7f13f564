"""ListOps generator, tokenizer and TSV readers."""

from __future__ import annotations

from collections import Counter

import pytest

from mita.data.listops import (
    OPERATORS,
    PAD_ID,
    VOCAB,
    ListOpsConfig,
    check_expression,
    decode,
    encode,
    generate,
    generate_long,
)
from mita.data.tsv import encode_bytes, read_lra_listops, read_text_tsv


def evaluate_tokens(text: str) -> int:
    """Independent evaluator: a stack machine over the flat token string."""
    stack: list = []
    for tok in text.split():
        if tok in OPERATORS:
            stack.append(tok)
        elif tok == "]":
            args = []
            while stack[-1] not in OPERATORS:
                args.append(stack.pop())
            op = stack.pop()
            args.sort()
            n = len(args)
            if op == "[MIN":
                value = args[0]
            elif op == "[MAX":
                value = args[-1]
            elif op == "[MED":
                value = args[n // 2] if n % 2 else (args[n // 2 - 1] + args[n // 2]) // 2
            else:
                value = sum(args) % 10
            stack.append(value)
        else:
            stack.append(int(tok))
    assert len(stack) == 1
    return stack[0]


def test_generator_labels_match_independent_evaluator():
    for cfg, seed in ((ListOpsConfig(20, 200), 1), (ListOpsConfig(), 2)):
        data = generate(150, seed, cfg)
        assert len({t for t, _ in data}) == 150
        for text, label in data:
            assert cfg.min_length < len(text.split()) < cfg.max_length
            assert evaluate_tokens(text) == label


def test_generator_is_deterministic_and_seed_dependent():
    cfg = ListOpsConfig(10, 100)
    assert generate(30, 5, cfg) == generate(30, 5, cfg)
    assert generate(30, 5, cfg) != generate(30, 6, cfg)


def test_generator_covers_all_classes_and_operators():
    data = generate(1000, 3, ListOpsConfig(20, 200))
    counts = Counter(label for _, label in data)
    assert set(counts) == set(range(10))
    # No class dominates: the most common one stays well under half (LRA: ~10-20 %).
    assert max(counts.values()) / len(data) < 0.3
    ops = Counter(tok for text, _ in data for tok in text.split() if tok in OPERATORS)
    assert set(ops) == set(OPERATORS)


def test_empty_length_range_rejected():
    with pytest.raises(ValueError, match="empty length range"):
        generate(1, 0, ListOpsConfig(10, 11))


def test_tokenizer_round_trip_drops_parentheses_keeps_brackets():
    text = "( ( ( [MAX 2 ) 9 ) ] )"
    ids = encode(text)
    assert decode(ids) == "[MAX 2 9 ]"
    assert ids == [VOCAB.index("[MAX"), VOCAB.index("2"), VOCAB.index("9"), VOCAB.index("]")]
    assert PAD_ID not in ids
    assert decode(ids + [PAD_ID, PAD_ID]) == "[MAX 2 9 ]"
    with pytest.raises(ValueError, match="unknown token 'X' at position 2"):
        encode("[MAX 2 X ]")
    with pytest.raises(ValueError, match="unknown token '<pad>'"):
        encode("<pad>")
    with pytest.raises(ValueError, match="out of range"):
        decode([3, 99])


def test_lra_tsv_reader(tmp_path):
    good = tmp_path / "basic_test.tsv"
    good.write_text("Source\tTarget\n( ( ( [MAX 2 ) 9 ) ] )\t9\n( ( [SM 4 ) 7 ) ]\t1\n")
    assert read_lra_listops(good) == [(encode("[MAX 2 9 ]"), 9), (encode("[SM 4 7 ]"), 1)]

    cases = {
        "Src\tTarget\n[MAX 2 9 ]\t9\n": ":1: expected header",
        "Source\tTarget\n[MAX 2 9 ]\t9\n[MIN 1 2 ]\t1\textra\n": ":3: expected 2 tab-separated",
        "Source\tTarget\n[MAX 2 9 ]\t9\n[MIN 1 2 ]\tten\n": ":3: label 'ten' is not an integer",
        "Source\tTarget\n[MAX 2 9 ]\t10\n": ":2: label 10 outside",
        "Source\tTarget\n[MAX 2 9 ]\t9\n[MOD 2 9 ]\t9\n": ":3: unknown operator '\\[MOD'",
        "Source\tTarget\n( )\t9\n": ":2: empty Source",
        "Source\tTarget\n": "no rows",
    }
    for i, (content, message) in enumerate(cases.items()):
        bad = tmp_path / f"bad{i}.tsv"
        bad.write_text(content)
        with pytest.raises(ValueError, match=message):
            read_lra_listops(bad)


def test_text_tsv_reader(tmp_path):
    good = tmp_path / "docs.tsv"
    good.write_text("label\ttext\n1\thé\tllo\n0\tab\n")
    rows = read_text_tsv(good, num_classes=2)
    assert rows == [(encode_bytes("hé\tllo"), 1), ([ord("a") + 1, ord("b") + 1], 0)]
    assert encode_bytes("é") == [0xC3 + 1, 0xA9 + 1]
    for content, message in (("1 no tab\n", ":1: expected 'label<TAB>text'"),
                             ("0\tok\n2\tx\n", ":2: label 2 outside"),
                             ("0\tok\nx\ty\n", ":2: label 'x' is not an integer"),
                             ("0\t\n", ":1: empty text")):
        bad = tmp_path / "bad.tsv"
        bad.write_text(content)
        with pytest.raises(ValueError, match=message):
            read_text_tsv(bad, num_classes=2)


def test_every_generated_expression_is_well_formed():
    """The grammar check refuses no expression the generator makes (LRA's procedure, the long
    ones of the load tests, LRA's parenthesised form)."""
    for text, _ in generate(300, 4, ListOpsConfig(1, 300)):
        check_expression(text)
    for n in (3, 1000):
        check_expression(generate_long(n, seed=n)[0])
    check_expression("( ( ( [MAX 2 ) 9 ) ] )")


def test_generate_long_has_exact_length_and_right_label():
    for n in (3, 4, 11, 1000, 5000):
        text, label = generate_long(n, seed=n)
        assert len(text.split()) == n
        assert evaluate_tokens(text) == label
    with pytest.raises(ValueError, match="at least 3"):
        generate_long(2, 0)


def test_unpack_with_a_relative_out_folder(tmp_path, monkeypatch):
    """``datasets.unpack`` with a relative ``--out`` (as the Makefile's `make data` passes):
    dpkg-deb runs inside out/debs, so the package path must not be relative to the caller's
    folder (it was: `make data` failed with "failed to read archive … No such file")."""
    import subprocess
    from pathlib import Path

    from mita.data import datasets

    package = tmp_path / "build" / "mita-test-pkg"
    (package / "DEBIAN").mkdir(parents=True)
    (package / "DEBIAN" / "control").write_text(
        "Package: mita-test-pkg\nVersion: 1\nArchitecture: all\nMaintainer: t <t@t>\n"
        "Description: test\n")
    (package / "usr" / "share").mkdir(parents=True)
    (package / "usr" / "share" / "labels.txt").write_text("a\tb\n")
    (tmp_path / "rel" / "debs").mkdir(parents=True)
    subprocess.run(["dpkg-deb", "--build", str(package),
                    str(tmp_path / "rel" / "debs" / "mita-test-pkg_1_all.deb")],
                   check=True, capture_output=True)
    monkeypatch.chdir(tmp_path)
    root = datasets.unpack("mita-test-pkg", Path("rel"))
    assert (root / "usr" / "share" / "labels.txt").read_text() == "a\tb\n"
