"""Serve exactly what was trained (issue 61, item 1), without Ray: the gateway's input checks
cut every sequence to the checkpoint's trained length as training cut it (``Task.cut``), before
``max_n`` (which applies to the length served); the answer reports the cut (``original_n``,
``truncated``); and the start banner lists every application with an example of its own
task. The service's side, end to end: tests/service/test_own_data_service.py."""

from __future__ import annotations

import numpy as np
import pytest
from fastapi.responses import JSONResponse

from mita.data.task import Task
from mita.data.tokenizers import BYTES, LISTOPS, Tokenizer, ids_tokenizer
from mita.data.vocab import Vocabulary
from service.__main__ import banner_lines, describe, example_command
from service.gateway import response_body
from service.inputs import ApiError, Served, served_binary, served_ids
from service.schemas import ClassifyRequest, ClassifyResponse


def text_task(max_length: int | None, side: str | None = None) -> Task:
    """A byte-level text task (byte b → id b + 1) trained with ``--max-len max_length``."""
    return Task("notes", ("a", "b"), BYTES, BYTES.vocab, max_length, side)


def served(req: ClassifyRequest, max_n: int, task: Task) -> Served:
    return served_ids(req, max_n, task.vocab, task.tokenizer, task)


def refusal(call, *args) -> tuple[int, str]:
    with pytest.raises(ApiError) as e:
        call(*args)
    return e.value.status, e.value.message


TEXT = "abcdefghij"  # ids 98 … 107


def test_text_and_ids_are_cut_at_either_end_as_training_cut_them():
    tail, head = text_task(4, "tail"), text_task(4, "head")
    got = served(ClassifyRequest(text=TEXT), 100, tail)
    assert got.ids.tolist() == [98, 99, 100, 101] and got.ids.dtype == np.int32
    assert (got.original_n, got.truncated) == (10, "tail")
    assert got.report() == {"original_n": 10, "truncated": "tail"}
    got = served(ClassifyRequest(text=TEXT), 100, head)
    assert got.ids.tolist() == [104, 105, 106, 107]
    assert got.report() == {"original_n": 10, "truncated": "head"}
    got = served(ClassifyRequest(ids=list(range(1, 11))), 100, head)
    assert got.ids.tolist() == [7, 8, 9, 10] and got.report()["original_n"] == 10
    # as long as the trained length, or shorter, or a task without one: nothing cut, nothing
    # reported (the answer then has no original_n / truncated)
    for task, text in ((tail, "abcd"), (tail, "ab"), (text_task(None), TEXT)):
        got = served(ClassifyRequest(text=text), 100, task)
        assert got.ids.tolist() == [ord(ch) + 1 for ch in text]
        assert (got.original_n, got.truncated, got.report()) == (len(text), None, {})


def test_max_n_applies_to_the_length_served_after_the_cut():
    long = ClassifyRequest(text="x" * 1000)
    got = served(long, 10, text_task(8, "tail"))  # 1,000 tokens sent, 8 served: not refused
    assert got.ids.size == 8 and got.report() == {"original_n": 1000, "truncated": "tail"}
    assert refusal(served, long, 10, text_task(None)) == (
        422, "sequence length N = 1000 exceeds max_n = 10")
    # a trained length above max_n: the cut length is what max_n refuses
    assert refusal(served, long, 10, text_task(20, "head")) == (
        422, "sequence length N = 20 exceeds max_n = 10")
    assert served(ClassifyRequest(text="x" * 10), 10, text_task(None)).ids.size == 10


def test_every_id_sent_is_checked_even_past_the_cut():
    task = text_task(4, "tail")
    # id 300 at position 9 would be cut off, but it was sent: refused, named where it was sent
    assert refusal(served, ClassifyRequest(ids=[*range(1, 10), 300]), 100, task) == (
        422, "token id 300 at position 9 is out of range [1, 256] (0 is padding)")
    assert refusal(served, ClassifyRequest(ids=[]), 100, task) == (
        422, "empty sequence: no tokens to classify")
    assert refusal(served, ClassifyRequest(text=""), 100, task) == (
        422, "empty sequence: no tokens to classify")


def test_binary_ids_are_cut_too():
    tail, head = text_task(3, "tail"), text_task(3, "head")
    body = bytes(range(1, 9))  # uint8 ids 1 … 8
    got = served_binary(body, "uint8", 5, BYTES.vocab, tail)
    assert got.ids.tolist() == [1, 2, 3] and got.ids.dtype == np.int32
    assert got.report() == {"original_n": 8, "truncated": "tail"}
    got = served_binary(np.arange(1, 9, dtype="<i4").tobytes(), "int32", 5, BYTES.vocab, head)
    assert got.ids.tolist() == [6, 7, 8] and got.report() == {"original_n": 8,
                                                                "truncated": "head"}
    assert served_binary(body, "uint8", 8, BYTES.vocab).report() == {}  # no task: no cut
    assert refusal(served_binary, body, "uint8", 5, BYTES.vocab) == (
        422, "sequence length N = 8 exceeds max_n = 5")
    assert refusal(served_binary, body + bytes([0]), "uint8", 5, BYTES.vocab, tail) == (
        422, "token id 0 at position 8 is out of range [1, 256] (0 is padding); the body was "
             "read as uint8 little-endian (?dtype=uint8): int32 ids need ?dtype=int32")
    assert refusal(served_binary, b"\x01\x00", "int32", 5, BYTES.vocab, tail) == (
        400, "a body of 2 bytes is not a whole number of int32 ids (4 bytes each)")


def test_listops_keeps_its_grammar_check_and_a_grid_its_exact_length():
    listops = Task("listops", tuple("0123456789"), LISTOPS, LISTOPS.vocab)
    got = served(ClassifyRequest(text="[MAX 2 9 ]"), 100, listops)
    assert got.ids.tolist() == [12, 3, 10, 15] and got.report() == {}
    assert refusal(served, ClassifyRequest(text="[MAX 2"), 100, listops) == (
        422, "text is not a well-formed ListOps expression: unbalanced brackets: '[MAX' at "
             "position 0 is never closed")
    # a grid model's length is checked on what is served (training, too, checked it after its
    # cut): 2×2 = 4 tokens
    grid = Task("grid", ("a", "b"), ids_tokenizer(10), Vocabulary(10), 4, "tail", (2, 2))
    got = served(ClassifyRequest(ids=[1, 2, 3, 4, 5]), 100, grid)
    assert got.ids.tolist() == [1, 2, 3, 4] and grid.length_refusal(got.ids.size) is None
    short = served(ClassifyRequest(ids=[1, 2, 3]), 100, grid)
    assert grid.length_refusal(short.ids.size) == (
        "this model classifies 2×2 grids (2-D landmark pooling): a sequence must have exactly "
        "4 tokens, got 3")


def test_the_answer_reports_the_cut_as_the_response_model_does():
    result = {"label": 1, "probabilities": [0.25, 0.75], "variant": "dense", "n": 4,
              "model_id": "m@1"}
    cut = {"original_n": 10, "truncated": "head"}
    for extra in ({}, cut):
        body = response_body(result, None, None, ("a", "b"), extra)
        model = ClassifyResponse.model_validate(result | {"label_name": "b"} | extra)
        # keys, their order and values: what FastAPI's response model makes of it
        assert JSONResponse(body).body == JSONResponse(
            model.model_dump(mode="json", exclude_none=True)).body
    assert list(response_body(result, None, None, ("a", "b"), cut)) == [
        "label", "label_name", "probabilities", "variant", "n", "original_n", "truncated",
        "model_id"]
    assert "original_n" not in response_body(result, None, None, ("a", "b"))
    with pytest.raises(ValueError, match="truncated"):
        ClassifyResponse.model_validate(result | {"label_name": "b", "truncated": "middle"})


URL = "http://127.0.0.1:8000"
CURL = "curl -s -X POST http://127.0.0.1:8000"
JSON = "-H 'content-type: application/json'"


def test_the_start_banner_lists_every_application_with_an_example_of_its_task():
    apps = [("mita-serve", "/", Task("listops", tuple("0123456789"), LISTOPS, LISTOPS.vocab)),
            ("own-data", "/own", Task("austen-512", ("Emma", "Persuasion"), BYTES, BYTES.vocab,
                                      256, "tail")),
            ("events", "/events", Task("events", ("0", "1", "2"), Tokenizer("ids", 5),
                                       Vocabulary(5), 64, "head")),
            ("images", "/images", Task("fashion-mnist", tuple("abcd"), Tokenizer("ids", 257),
                                       Vocabulary(257), None, None, (14, 14))),
            ("lost", "/lost", None)]
    assert banner_lines(URL, apps) == [
        "Applications:",
        "  /        mita-serve, task listops: ListOps expressions, 10 classes",
        "  /own     own-data, task austen-512: text (bytes tokens) or token ids, 2 classes; a "
        "longer sequence is cut to its first 256 tokens (truncate tail), as in training",
        "  /events  events, task events: token ids, 3 classes; a longer sequence is cut to its "
        "last 64 tokens (truncate head), as in training",
        "  /images  images, task fashion-mnist: 14×14 grids of token ids (196 tokens), 4 "
        "classes",
        "  /lost    lost, task unknown",
        "Try:",
        f"  {CURL}/v1/classify {JSON} -d '{{\"text\": \"[MAX 2 [MIN 4 7 ] 0 ]\", "
        "\"profile\": true}'",
        "  (the expression's value is 4; \"label\" is the model's answer, right or wrong: see "
        "the README for its accuracy)",
        f"  {CURL}/own/v1/classify {JSON} -d '{{\"text\": \"The quick brown fox jumps over the "
        "lazy dog.\"}'",
        f"  {CURL}/events/v1/classify {JSON} -d '{{\"ids\": [1, 2, 3, 4]}}'",
        "  python3 -c 'import json; print(json.dumps({\"ids\": [1] * 196}))' | "
        f"{CURL}/images/v1/classify {JSON} -d @-",
    ]
    # ids avoid a padding id that is not 0 (a checkpoint without a task: its own pad_id)
    odd = Task("ids", ("0", "1"), Tokenizer("ids", 300), Vocabulary(300, pad_id=1),
               grid=(2, 3))
    assert example_command(URL + "/x", odd) == (
        "python3 -c 'import json; print(json.dumps({\"ids\": [0] * 6}))' | "
        f"{CURL}/x/v1/classify {JSON} -d @-")
    assert describe(odd) == "2×3 grids of token ids (6 tokens), 2 classes"


def test_the_banner_reads_each_applications_task_from_the_config():
    from service import launch
    from service.__main__ import served_apps

    own = launch.load_config(launch.PROJECT_ROOT / "deploy/serve_config.own-data.yaml")
    own.applications[1].args["checkpoint"] = "checkpoints/fashion-mnist-14x14"
    apps = served_apps(own)
    assert [(name, prefix, task.name) for name, prefix, task in apps] == [
        ("mita-serve", "/", "listops"), ("own-data", "/own", "fashion-mnist-14x14")]
    assert apps[1][2].grid == (14, 14)
    own.applications[1].args["checkpoint"] = "no/such/checkpoint"  # not readable here
    assert served_apps(own)[1] == ("own-data", "/own", None)
