"""The load tester with a user's rows (``--data``), without Ray: rows joined and cut to exact
lengths (ids, UTF-8 bytes on a character boundary, characters), what the report says was sent,
the up-front refusals from a ``/v1/models`` answer, the ``max_length`` warning, the error
budget, the whole command against a stand-in service on loopback, and the dependencies a
``make serve`` install (no dev extra) gives it."""

from __future__ import annotations

import ast
import json
import re
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib.metadata import packages_distributions
from pathlib import Path

import pytest

from loadtest.__main__ import main
from loadtest.engine import Sample
from loadtest.inputs import build, error_gate, input_unit, join_rows, refusal, warnings
from mita.data.labelled import read_file

ROOT = Path(__file__).resolve().parents[2]


# ---------------------------------------------------------------------------- joining rows

def test_ids_rows_are_joined_back_to_back_and_cut_to_exactly_n():
    rows = [(1, 2, 3), (4, 5)]
    j = join_rows(rows, 7, 0, "ids")
    assert (j.payload, j.rows, j.last_cut, j.sent) == ({"ids": [1, 2, 3, 4, 5, 1, 2]}, 3, True, 7)
    j = join_rows(rows, 5, 0, "ids")  # ends on a row's end: nothing cut
    assert (j.payload, j.rows, j.last_cut) == ({"ids": [1, 2, 3, 4, 5]}, 2, False)
    j = join_rows(rows, 7, 1, "ids")  # from the second row, wrapping round
    assert (j.payload, j.start, j.rows, j.last_cut) == ({"ids": [4, 5, 1, 2, 3, 4, 5]}, 1, 3,
                                                        False)
    for n in range(1, 30):
        assert len(join_rows(rows, n, n % 2, "ids").payload["ids"]) == n


def test_text_rows_are_cut_to_n_bytes_on_a_character_boundary():
    """"aé ü€" is 1 + 2 + 1 + 2 + 3 = 9 UTF-8 bytes: a cut inside é, ü or € backs off to the
    character's start, so the text sent is a prefix of the joined rows of N − 3 … N bytes, and
    its byte count (the byte-level tokenizer's token count) is what ``sent`` says."""
    rows = ["aé", "ü€"]
    expected = {1: ("a", 1, True), 2: ("a", 1, True), 3: ("aé", 1, False),
                4: ("aé ", 1, False), 5: ("aé ", 1, False), 6: ("aé ü", 2, True),
                7: ("aé ü", 2, True), 8: ("aé ü", 2, True), 9: ("aé ü€", 2, False),
                10: ("aé ü€ ", 2, False), 11: ("aé ü€ a", 3, True)}
    for n, (text, used, cut) in expected.items():
        j = join_rows(rows, n, 0, "bytes")
        assert (j.payload, j.rows, j.last_cut, j.sent) == (
            {"text": text}, used, cut, len(text.encode())), n
    joined = " ".join(rows * 20)
    for n in range(1, 60):
        text = join_rows(rows, n, 0, "bytes").payload["text"]
        assert joined.startswith(text) and n - 3 <= len(text.encode()) <= n
    with pytest.raises(ValueError) as e:
        join_rows(["€uro"], 2, 0, "bytes")
    assert str(e.value) == ("N = 2 bytes cannot hold the first character of row 1 of the "
                            "file: nothing to send")


def test_text_rows_for_a_subword_model_are_cut_to_n_characters():
    j = join_rows(["ab", "cdé"], 5, 0, "characters")
    assert (j.payload, j.rows, j.last_cut, j.sent) == ({"text": "ab cd"}, 2, True, 5)
    assert join_rows(["ab", "cdé"], 6, 0, "characters").payload == {"text": "ab cdé"}


def test_the_report_says_which_rows_were_joined_cut_and_repeated(tmp_path):
    """Three 4-id rows, two sequences per N: at N = 4 rows 1 and 2 whole; at N = 6 rows 1+2
    (the second cut), then 3+1 (the first again, cut): 4 row uses of 3 rows."""
    f = tmp_path / "rows.jsonl"
    f.write_text("".join(json.dumps({"ids": [10 * r + i for i in range(1, 5)], "label": r})
                         + "\n" for r in range(1, 4)))
    payloads, source = build(read_file(f), [6, 4], 2, "ids")
    assert payloads == {4: [{"ids": [11, 12, 13, 14]}, {"ids": [21, 22, 23, 24]}],
                        6: [{"ids": [11, 12, 13, 14, 21, 22]},
                            {"ids": [31, 32, 33, 34, 11, 12]}]}
    assert [x["text"] for x in source["per_n"]] == [
        "N = 4: 2 sequences of 1 row (rows 1–2 of 3), none cut; 4 ids sent",
        "N = 6: 2 sequences of 2 rows joined (all 3 rows, repeated: 4 row uses), the last row "
        "of each cut; 6 ids sent"]
    assert source["per_n"][1] | {"text": None} == {
        "n": 6, "unit": "ids", "rows_used": 3, "repeated": True, "text": None,
        "sequences": [{"first_row": 1, "rows": 2, "last_cut": True, "sent": 6},
                      {"first_row": 3, "rows": 2, "last_cut": True, "sent": 6}]}
    assert {k: source[k] for k in ("source", "path", "kind", "rows", "unit", "joined_by")} == {
        "source": "file", "path": str(f), "kind": "ids", "rows": 3, "unit": "ids",
        "joined_by": "nothing"}
    t = tmp_path / "rows.tsv"
    t.write_text("a\tzwölf\nb\tdrei\n")
    _, text = build(read_file(t), [8], 1, "bytes")
    assert text["per_n"][0]["text"] == ("N = 8: 1 sequence of 2 rows joined (rows 1–2 of 2), "
                                        "the last row of each cut; 8 bytes sent")
    # docs/load-testing.md's example: the Austen validation sample's 512-byte windows
    _, austen = build(read_file(ROOT / "examples/austen-512-valid.tsv"), [512, 2048], 4, "bytes")
    lines = [x["text"] for x in austen["per_n"]]
    assert lines == [
        "N = 512: 4 sequences of 1 row (rows 1–4 of 18), none cut; 512 bytes sent",
        "N = 2048: 4 sequences of 4 rows joined (rows 1–16 of 18), the last row of each cut; "
        "2048 bytes sent"]
    page = " ".join((ROOT / "docs/load-testing.md").read_text().split())
    assert all(f'"{line}"' in page for line in lines)


# ---------------------------------------------------------------------------- refusals

def models(kind="listops", name="listops", vocab=16, grid=None, max_length=None,
           max_n=16384) -> dict:
    """A /v1/models answer as the gateway gives it (``Task.info``, the Gateway's config)."""
    tok = {"kind": kind, "vocab_size": vocab} | (
        {"file": "tokenizer.model"} if kind == "sentencepiece" else {})
    return {"task": {"name": name, "labels": ["a", "b"], "tokenizer": tok,
                     "takes_text": kind != "ids", "max_length": max_length,
                     "truncate": "tail" if max_length else None, "grid": grid},
            "variants": {}, "ab_policy": {"max_n": max_n}}


@pytest.fixture
def files(tmp_path):
    ids = tmp_path / "pixels.jsonl"
    ids.write_text('{"ids": [1, 200], "label": 0}\n{"ids": [3, 256], "label": 1}\n')
    text = tmp_path / "novels.tsv"
    text.write_text("Emma\tEmma Woodhouse, handsome\n")
    return read_file(ids), read_file(text)


def test_what_the_target_cannot_take_is_refused_naming_cause_and_fix(files):
    ids, text = files
    austen = models("sentencepiece", "austen", 400, max_length=128)
    pixels = models("ids", "fashion", 257, grid=[14, 14])
    assert refusal({"detail": "Not Found"}, [1024], None) == (
        "the target's /v1/models has no 'task': is --url a mita-serve service (and its route "
        "prefix, e.g. http://127.0.0.1:8000/own)?")
    assert refusal(austen, [1024], None) == (
        "the target serves task 'austen' (sentencepiece text); generated ListOps expressions "
        "are not its input: pass --data FILE with its rows (a file in the format it was "
        "trained on)")
    assert refusal(pixels, [196], text) == (
        f"the target serves task 'fashion' (ids only, vocabulary 257): it takes no text, and "
        f"{text.path} has text rows: pass --data with ids rows (.jsonl, 'ids' and 'label')")
    assert refusal(models(), [64], text) == (
        f"the target serves task 'listops' (ListOps), whose text must be one well-formed "
        f"expression: the joined rows of {text.path} would be refused; run without --data "
        "(generated ListOps)")
    assert refusal(models("ids", "fashion", 256), [196], ids) == (
        f"{ids.path}:2: id 256 is outside the target's vocabulary [1, 255] (the target serves "
        "task 'fashion' (ids only, vocabulary 256)): pass --data with the rows of the file it "
        "was trained on")
    assert refusal(models(), [64], ids) == (
        f"{ids.path}:1: id 200 is outside the target's vocabulary [1, 15] (the target serves "
        "task 'listops' (ListOps)): pass --data with the rows of the file it was trained on")
    assert refusal(models("ids", "fashion", 257, grid=[2, 1]), [3, 2, 1], ids) == (
        "the target serves task 'fashion' (ids only, vocabulary 257), whose model classifies "
        "2×1 grids: every sequence must have exactly 2 tokens, and --n 1 3 would be refused: "
        "pass --n 2")
    assert refusal(models(), [1024, 32768, 20000], None) == (
        "--n 20000 32768 is above the target's max_n = 16384 (its gateway refuses longer "
        "sequences): pass --n up to 16384, or raise the Gateway's max_n in its Serve config")


def test_what_the_target_takes_passes(files):
    ids, text = files
    assert refusal(models(), [1024, 16384], None) is None
    assert refusal(models("ids", "fashion", 257, grid=[14, 14]), [196], ids) is None
    assert refusal(models("bytes", "reviews", 257), [4096], text) is None
    assert refusal(models("bytes", "reviews", 257), [4096], ids) is None  # ids for any task
    # cut to max_length before max_n: the service serves 128 tokens, not 32768
    assert refusal(models("bytes", "reviews", 257, max_length=128), [32768], text) is None
    # N characters: the token count is the model's; a warning instead
    austen = models("sentencepiece", "austen", 400)
    assert refusal(austen, [32768], text) is None
    assert warnings(austen, [1024, 32768], "characters") == [
        "N = 32768 characters may make more tokens than the target's max_n = 16384: such "
        "requests are refused (422) and count as errors"]


def test_a_pretrained_models_positions_refuse_ids_and_warn_for_text(files):
    """A pretrained transformers target (``positions``, its own tokenizer): N ids past its
    positions are refused before sending; text rows count N in characters (only its tokenizer
    knows the tokens), with a warning where N characters may pass the positions."""
    ids, text = files
    bert = models("transformers", "pretrained-text", 30522)
    bert["task"] |= {"architecture": "BertForSequenceClassification", "positions": 512}
    assert refusal(bert, [256, 600], ids) == (
        "--n 600 is above the target model's 512 positions (its gateway refuses longer "
        "sequences): pass --n up to 512")
    assert refusal(bert, [600], text) is None
    assert input_unit(bert, text) == "characters" and input_unit(bert, ids) == "ids"
    assert warnings(bert, [256, 600], "characters") == [
        "N = 600 characters may make more tokens than the target model's 512 positions: such "
        "requests are refused (422) and count as errors"]


def test_a_trained_length_shorter_than_n_is_a_warning():
    austen = models("sentencepiece", "austen", 400, max_length=128)
    assert warnings(austen, [100, 4096, 1024], "bytes") == [
        "the target's model reads at most 128 tokens (max_length; the tail of a longer "
        "sequence is cut off): at N = 1024, 4096 the service cuts each sequence to 128 tokens, "
        "so those rows time 128-token forwards"]
    assert warnings(austen, [1024], "characters") == [
        "the target's model reads at most 128 tokens (max_length; the tail of a longer "
        "sequence is cut off): N = 1024 characters may make more tokens than that, and then "
        "the model reads only 128 of them (the served n column)"]
    assert warnings(austen, [128], "bytes") == warnings(models(), [16384], "tokens") == []


# ---------------------------------------------------------------------------- error budget

def sample(status: int) -> Sample:
    return Sample(256, "mita", "mita" if status == 200 else None, status, 0.0, 0.01)


def test_the_error_budget_counts_every_answer_but_200():
    four = [sample(200), sample(503), sample(200), sample(200)]
    assert error_gate(four, 0.0) == (
        "1 of 4 timed requests were not answered 200 (25.0 % > --max-error-rate 0): 1 × 503")
    assert error_gate(four, 0.25) is None  # at the budget: passes
    mixed = [sample(0), sample(429), sample(0), sample(422), sample(200)]
    assert error_gate(mixed, 0.5) == (
        "4 of 5 timed requests were not answered 200 (80.0 % > --max-error-rate 0.5): "
        "2 × no answer (transport error), 1 × 422, 1 × 429")
    assert error_gate([sample(200)] * 3, 0.0) is None
    assert error_gate([], 1.0) == "no timed request was sent: nothing was measured"


# ---------------------------------------------------------------------------- the command

class _Target(ThreadingHTTPServer):
    """A stand-in service on loopback: ``/v1/models`` answers ``info``; ``/v1/classify``
    answers 200 with ``n`` the ids' count or the text's UTF-8 bytes, but 503 for every
    ``refuse_every``-th. Keeps every classify body."""

    daemon_threads = True

    def __init__(self, info: dict, refuse_every: int = 0):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.info, self.refuse_every, self.bodies = info, refuse_every, []
        self.thread = threading.Thread(target=self.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return f"http://127.0.0.1:{self.server_address[1]}"

    def __exit__(self, *exc):
        self.shutdown()
        self.server_close()


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def _answer(self, code: int, payload: dict) -> None:
        data = json.dumps(payload).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        self._answer(200, self.server.info)

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.bodies.append(body)
        k = self.server.refuse_every
        if k and len(self.server.bodies) % k == 0:
            return self._answer(503, {"error": "overloaded"})
        n = len(body["ids"]) if "ids" in body else len(body["text"].encode())
        self._answer(200, {"label": 0, "probabilities": [1.0, 0.0], "variant": body["variant"],
                           "n": n, "model_id": "x"})

    def log_message(self, *args):
        pass


def run(url: str, out: Path, *flags: str) -> dict:
    return main(["run", "--url", url, "--variants", "mita", "--requests", "4", "--warmup", "0",
                 "--concurrency", "1", "--out", str(out), *flags])


def test_the_command_refuses_before_sending_and_fails_past_its_error_budget(tmp_path, capsys):
    text = tmp_path / "reviews.tsv"
    text.write_text("pos\tgrüße aus köln\nneg\tnicht gut\n")
    with _Target(models("ids", "fashion", 257, grid=[14, 14])) as url:
        with pytest.raises(SystemExit) as e:
            run(url, tmp_path / "a", "--n", "196")
        assert e.value.code == 2
        assert capsys.readouterr().err.endswith(
            "python -m loadtest: error: the target serves task 'fashion' (ids only, vocabulary "
            "257); generated ListOps expressions are not its input: pass --data FILE with its "
            "rows (a file in the format it was trained on)\n")
    with _Target(models("bytes", "reviews", 257, max_length=8), refuse_every=4) as url:
        with pytest.raises(SystemExit) as e:
            run(url, tmp_path / "b", "--n", "14", "--data", str(text))
        assert e.value.code == 1
        out, err = capsys.readouterr()
        assert err.splitlines()[0] == (
            "warning: the target's model reads at most 8 tokens (max_length; the tail of a "
            "longer sequence is cut off): at N = 14 the service cuts each sequence to 8 "
            "tokens, so those rows time 8-token forwards")
        assert err.splitlines()[-1] == (
            "python -m loadtest: error: 1 of 4 timed requests were not answered 200 (25.0 % > "
            f"--max-error-rate 0): 1 × 503; see {tmp_path / 'b' / 'loadtest.md'}")
        report = json.loads((tmp_path / "b" / "loadtest.json").read_text())  # written first
        assert report["error_budget"] == {"max_error_rate": 0.0, "sent": 4, "failed": 1,
                                          "passed": False}
        assert report["input"]["per_n"][0]["text"] == (
            "N = 14: 4 sequences of 1–2 rows joined (all 2 rows, repeated: 7 row uses), the "
            "last row of each cut; 13–14 bytes sent")
        md = (tmp_path / "b" / "loadtest.md").read_text()
        assert "| N | served n | variant |" in md
        assert "| 14 | 13–14 | mita | 4 | 3 | 503: 1 |" in md
        assert "FAILED (exit status 1)." in md
        # the budget raised: the same run passes
        summary = run(url, tmp_path / "c", "--n", "14", "--data", str(text),
                      "--max-error-rate", "0.25")
        assert summary["error_budget"]["passed"] and summary["rows"][0]["ok"] == 3


# ---------------------------------------------------------------------------- make serve

def name(requirement: str) -> str:
    """A distribution's name as PEP 503 compares them (lower case, runs of -_. as -)."""
    return re.sub(r"[-_.]+", "-", requirement).lower()


def requirements(pyproject: str, block: str) -> set[str]:
    """The names of the quoted requirements in the part of ``pyproject`` that the regular
    expression ``block`` (multi-line, dot-all) captures, comments left out (no TOML reader:
    tomllib is Python 3.11+, the project 3.10+)."""
    found = re.search(block, pyproject, re.M | re.S)
    assert found, block
    body = re.sub(r"#.*", "", found.group(1))
    return {name(m) for m in re.findall(r'"([A-Za-z0-9][A-Za-z0-9._-]*)', body)}


def test_the_load_tester_needs_only_the_projects_dependencies():
    """``make serve`` installs ``pip install -e .`` without the dev extra: every library that
    loadtest/ and the mita modules it may import (tests/no_ray/test_import_rules.py) import
    must be one of ``[project] dependencies`` (httpx was only in dev: ModuleNotFoundError)."""
    text = (ROOT / "pyproject.toml").read_text()
    needed = requirements(text, r"^\[project\]$.*?^dependencies = \[(.*?)^\]")
    dev = requirements(text, r"^dev = \[(.*?)\]$")
    # mita/data/datasets.py is make data's command: its libraries are the data extra's
    files = [*(ROOT / "loadtest").glob("*.py"), *(ROOT / "mita/tools").glob("*.py"),
             *(f for f in (ROOT / "mita/data").glob("*.py") if f.name != "datasets.py"),
             ROOT / "mita/hooks.py"]
    tops = set()
    for f in files:
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Import):
                tops |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                tops.add(node.module.split(".")[0])
    third = tops - set(sys.stdlib_module_names) - {"mita", "loadtest", "__future__"}
    dists = packages_distributions()
    libraries = {name(d) for t in third for d in dists[t]}
    assert "httpx" in libraries and {"numpy", "matplotlib"} <= libraries
    assert libraries - needed == set()
    assert "httpx" not in dev  # listed once


def test_help_names_the_new_flags(capsys):
    with pytest.raises(SystemExit) as e:
        main(["run", "--help"])
    assert e.value.code == 0
    shown = capsys.readouterr().out
    assert "--data FILE" in shown and "--max-error-rate R" in shown
