"""The request input checks' messages, pinned on hand-made inputs (issue 33): ids, text,
binary bodies and strict JSON, each refusal's status and text.
Expected values are worked out by hand in the comments; nothing here needs Ray, a server or
a subprocess."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest
from fastapi import Request  # the endpoint's annotation below, resolved at module level

from mita.data.vocab import Vocabulary
from service.inputs import (
    ApiError,
    StrictJSONRequest,
    binary_ids,
    charset_refusal,
    check_ids,
    declared_charset,
    to_ids,
)
from service.schemas import (
    ClassifyRequest,
)

LISTOPS = Vocabulary(16, pad_id=0)


# ---- request inputs: the 4xx messages -----------------------------------------------------

def refusal(call, *args) -> tuple[int, str]:
    with pytest.raises(ApiError) as e:
        call(*args)
    return e.value.status, e.value.message


def test_ids_at_the_edges_of_the_vocabulary_and_max_n():
    ids = np.array([1, 15, 7], dtype=np.uint8)
    out = check_ids(ids, 3, LISTOPS)  # N = max_n is allowed; 15 = size - 1 is a token
    assert out.tolist() == [1, 15, 7] and np.shares_memory(out, ids)  # no second copy
    assert refusal(check_ids, np.array([1, 2, 3, 4]), 3, LISTOPS) == (
        422, "sequence length N = 4 exceeds max_n = 3")
    assert refusal(check_ids, np.array([3, 16, 0]), 10, LISTOPS) == (  # the first bad one
        422, "token id 16 at position 1 is out of range [1, 15] (0 is padding)")
    assert refusal(check_ids, np.array([3, 4, 0]), 10, LISTOPS) == (
        422, "token id 0 at position 2 is out of range [1, 15] (0 is padding)")
    assert refusal(check_ids, np.array([2, -1]), 10, LISTOPS) == (
        422, "token id -1 at position 1 is out of range [1, 15] (0 is padding)")
    # range before emptiness before length
    assert refusal(check_ids, np.array([], dtype=np.int64), 3, LISTOPS) == (
        422, "empty sequence: no tokens to classify")
    assert refusal(check_ids, np.array([1, 1, 1, 99]), 3, LISTOPS)[1].startswith("token id 99")
    byte = Vocabulary(300, pad_id=7)
    assert refusal(check_ids, np.array([0, 7]), 10, byte) == (
        422, "token id 7 at position 1 is out of range [0, 299] except the padding id 7")
    assert check_ids(np.array([0, 299]), 10, byte).dtype == np.int32


def test_ids_travel_in_the_smallest_dtype():
    assert Vocabulary(256).dtype is np.uint8 and Vocabulary(257).dtype is np.int32
    assert Vocabulary(16, 0).listops and not Vocabulary(17, 0).listops
    assert not Vocabulary(16, 1).listops


def test_huge_ids_are_named_and_cut_at_30_characters():
    assert refusal(to_ids, ClassifyRequest(ids=[1, 10 ** 29]), 10, LISTOPS) == (
        422, f"token id {10 ** 29} at position 1 is out of range [1, 15] (0 is padding)")
    assert refusal(to_ids, ClassifyRequest(ids=[1, 2, 10 ** 30]), 10, LISTOPS) == (
        422, f"token id {'1' + '0' * 29}… at position 2 is out of range [1, 15] (0 is padding)")
    # int64's edges: -2^63 fits (then out of range as any negative id), -2^63 - 1 does not
    assert refusal(to_ids, ClassifyRequest(ids=[-(2 ** 63)]), 10, LISTOPS)[1].startswith(
        f"token id {-(2 ** 63)} at position 0")
    # past int64, the first such id is named (here after an in-range-of-int64 bad one)
    assert refusal(to_ids, ClassifyRequest(ids=[1, 2 ** 63 - 1, -(2 ** 63) - 1]), 10,
                   LISTOPS)[1].startswith(f"token id {-(2 ** 63) - 1} at position 2")
    assert refusal(to_ids, ClassifyRequest(ids=[1, -(2 ** 63) - 1, 2 ** 63]), 10,
                   LISTOPS)[1].startswith(f"token id {-(2 ** 63) - 1} at position 1")
    assert refusal(to_ids, ClassifyRequest(ids=[-(2 ** 63), 2 ** 63]), 10,
                   LISTOPS)[1].startswith(f"token id {2 ** 63} at position 1")


def test_ids_are_free_form_and_text_is_checked_only_for_listops():
    assert to_ids(ClassifyRequest(ids=[12, 3, 4]), 3, LISTOPS).tolist() == [12, 3, 4]
    assert to_ids(ClassifyRequest(text="[MAX 2 3"), 3, Vocabulary(257)).tolist() == [12, 3, 4]
    assert to_ids(ClassifyRequest(text="[MAX 2 3 ]"), 4, LISTOPS).tolist() == [12, 3, 4, 15]


def test_text_refusals_say_what_and_where():
    assert refusal(to_ids, ClassifyRequest(text="[MAX 2 x ]"), 100, LISTOPS) == (
        422, "unknown token 'x' at position 2; expected one of 0 1 2 3 4 5 6 7 8 9 [MIN [MAX "
             "[MED [SM ]")
    assert refusal(to_ids, ClassifyRequest(text="[MAX 2 3"), 100, LISTOPS) == (
        422, "text is not a well-formed ListOps expression: unbalanced brackets: '[MAX' at "
             "position 0 is never closed")


def test_binary_bodies_messages():
    int32 = np.array([1, 300], dtype="<i4").tobytes()
    assert binary_ids(np.array([1, 15], dtype="<i4").tobytes(), "int32", 10,
                      LISTOPS).tolist() == [1, 15]
    assert binary_ids(int32, "int32", 10, Vocabulary(301)).tolist() == [1, 300]
    assert refusal(binary_ids, b"", "int32", 10, LISTOPS) == (
        400, "empty request body: send the token ids as bytes (int32, little-endian)")
    assert refusal(binary_ids, b"\x01" * 5, "int32", 10, LISTOPS) == (
        400, "a body of 5 bytes is not a whole number of int32 ids (4 bytes each)")
    assert refusal(binary_ids, int32, "int32", 10, LISTOPS) == (
        422, "token id 300 at position 1 is out of range [1, 15] (0 is padding); the body "
             "was read as int32 little-endian (?dtype=int32): uint8 ids need ?dtype=uint8")
    # uint8 ids 1, 2, 3, 4 read as one int32: 0x04030201 = 67,305,985
    assert refusal(binary_ids, bytes([1, 2, 3, 4]), "int32", 10, LISTOPS) == (
        422, "token id 67305985 at position 0 is out of range [1, 15] (0 is padding); the "
             "body was read as int32 little-endian (?dtype=int32): uint8 ids need ?dtype=uint8")
    assert refusal(binary_ids, bytes([1, 0, 0, 0]), "uint8", 10, LISTOPS) == (
        422, "token id 0 at position 1 is out of range [1, 15] (0 is padding); the body was "
             "read as uint8 little-endian (?dtype=uint8): int32 ids need ?dtype=int32")
    assert refusal(binary_ids, bytes([1, 2, 3]), "uint8", 2, LISTOPS) == (
        422, "sequence length N = 3 exceeds max_n = 2")
    assert refusal(binary_ids, b"", "uint8", 2, LISTOPS)[0] == 400


def json_of(body: bytes, content_type: str | None = None):
    async def receive():
        return {"type": "http.request", "body": body, "more_body": False}

    headers = [] if content_type is None else [(b"content-type", content_type.encode())]

    async def parse():
        request = StrictJSONRequest({"type": "http", "method": "POST", "headers": headers},
                                    receive)
        first = await request.json()
        assert await request.json() is first  # parsed once
        return first
    return asyncio.run(parse())


@pytest.mark.parametrize("body,why", [
    (b'{"a": 1, "b": {"c": 2, "c": 3}}', "duplicate key 'c'"),
    (b"[" * 100_000 + b"]" * 100_000, "nesting too deep"),
    # UTF-16 JSON (Python reads it): its bytes are not UTF-8, the message's doc replaces them
    (("[" * 100_000 + '"é"' + "]" * 100_000).encode("utf-16-le"), "nesting too deep"),
    (b'{"n": ' + b"1" * 5000 + b"}", "an integer with too many digits"),
    (b'{"a": "\xff"}', "the body is not valid UTF-8: byte 0xff at line 1, column 8 (invalid "
                        "start byte)"),
])
def test_strict_json_refusals_are_decode_errors(body, why):
    with pytest.raises(json.JSONDecodeError) as e:
        json_of(body)
    assert e.value.msg == why
    # the doc is the text as decoded (UTF-16 here by its NUL bytes), else the bytes replaced
    utf16 = body[1:2] == b"\x00"
    assert (e.value.doc, e.value.pos) == (
        body.decode("utf-16-le") if utf16 else body.decode(errors="replace"), 0)


# Issue 62: CESU-8 surrogate bytes (ED A0 80 is U+D800 encoded as if it were a character)
# went through json.loads's "surrogatepass" and ended in a 422 about '\ud800'; every invalid
# sequence is now the same 400. The byte and column are counted by hand in each body.
@pytest.mark.parametrize("body,why", [
    (b'{"text": "\xed\xa0\x80"}', "byte 0xed at line 1, column 11 (invalid continuation byte)"),
    (b'{"text": "a\xed\xbf\xbf"}', "byte 0xed at line 1, column 12 (invalid continuation byte)"),
    (b'{\n  "text":\n "\xc0\xaf"}', "byte 0xc0 at line 3, column 3 (invalid start byte)"),
    (b'{"text": "\xe2\x82"}', "byte 0xe2 at line 1, column 11 (invalid continuation byte)"),
    (b'{"text": "\xf4\x90\x80\x80"}', "byte 0xf4 at line 1, column 11 (invalid continuation "
                                  "byte)"),
], ids=["surrogate-d800", "surrogate-dfff", "overlong", "truncated", "above-10ffff"])
def test_every_invalid_utf8_sequence_is_one_refusal(body, why):
    with pytest.raises(json.JSONDecodeError) as e:
        json_of(body)
    assert e.value.msg == "the body is not valid UTF-8: " + why
    # the same with UTF-8 declared, the charset named as declared
    with pytest.raises(json.JSONDecodeError) as e:
        json_of(body, "application/json; charset=utf-8")
    assert e.value.msg == ("the body is not valid utf-8: " + why
                           + ", the charset its Content-Type declares")


def test_a_lone_surrogate_in_utf16_json_is_refused_too():
    body = '{"text": "ab"}'.encode("utf-16-le")
    body = body[:20] + b"\x00\xd8" + body[20:]  # U+D800 alone, after "ab"
    with pytest.raises(json.JSONDecodeError) as e:
        json_of(body)
    assert e.value.msg.startswith("the body is not valid utf-16-le: byte 0x00 at line 1, "
                                  "column 21 (")


def test_strict_json_route_hands_the_endpoint_a_strict_request():
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from service.inputs import StrictJSONRoute

    app = FastAPI()
    app.router.route_class = StrictJSONRoute

    @app.post("/echo")
    async def echo(request: Request):
        try:
            return {"body": await request.json()}
        except json.JSONDecodeError as e:
            return {"refused": e.msg}

    with TestClient(app) as client:
        assert client.post("/echo", content=b'{"a": 1}').json() == {"body": {"a": 1}}
        assert client.post("/echo", content=b'{"a": 1, "a": 2}').json() == {
            "refused": "duplicate key 'a'"}


def test_strict_json_parses_a_plain_body():
    assert json_of(b'{"a": [1, 2], "b": {"a": 3}}') == {"a": [1, 2], "b": {"a": 3}}


@pytest.mark.parametrize("content_type,charset", [
    ("application/json", None),
    ("application/json; charset=UTF-8", "utf-8"),
    ('application/json;Charset="Latin-1" ', "latin-1"),   # any case, quoted, spaced
    ("application/json; q=1; charset = ISO-8859-1", "iso-8859-1"),  # not the first parameter
    ("application/json; notcharset=utf-16", None),
    ("charset=utf-16", None),                               # the media type, not a parameter
    ("application/json; charset=", ""),
    ("application/json; charset=x=y", "x=y"),               # split at the first '='
    ("application/json; charset=X-MAC-ROMAN", "x-mac-roman"),  # only quotes stripped
    ("", None),
])
def test_declared_charset_is_the_content_types_parameter(content_type, charset):
    assert declared_charset(content_type) == charset


UNKNOWN = ("{!r} is not a text encoding this service knows; send UTF-8 (JSON's encoding, "
           "RFC 8259) or name a known charset")


@pytest.mark.parametrize("charset,why", [
    (None, None), ("utf-8", None), ("latin-1", None), ("cp1252", None),
    ("utf-32", None),        # known: two bytes are too few for it, which is not the point here
    ("klingon", "charset " + UNKNOWN.format("klingon")),
    ("base64", "charset " + UNKNOWN.format("base64")),   # a codec, but bytes to bytes
    ("", "charset " + UNKNOWN.format("")),
    ("x" * 100, "charset " + UNKNOWN.format("x" * 40)),  # cut at 40 characters
], ids=["none", "utf-8", "latin-1", "cp1252", "utf-32", "klingon", "base64", "empty", "long"])
def test_charset_refusal_names_unknown_charsets_only(charset, why):
    assert charset_refusal(charset) == why


def test_strict_json_decodes_by_the_declared_charset():
    # 'é' is 0xe9 in latin-1 and not UTF-8 on its own: read as declared
    assert json_of(b'{"text": "caf\xe9"}', "application/json; charset=latin-1") == {
        "text": "caf\u00e9"}
    body = '{"text": "caf\u00e9"}'.encode("utf-16-le")
    assert json_of(body, "application/json; charset=utf-16-le") == {"text": "caf\u00e9"}
    # declared UTF-8 as no charset at all
    assert json_of('{"a": "\u00e9"}'.encode(), "application/json; charset=utf-8") == {
        "a": "\u00e9"}


@pytest.mark.parametrize("body,charset,why,doc", [
    (b'{"a": "\xff"}', "utf-8",
     "the body is not valid utf-8: byte 0xff at line 1, column 8 (invalid start byte), the "
     "charset its Content-Type declares",
     '{"a": "\ufffd"}'),
    (b'{"a": 1, "a": 2}', "latin-1", "duplicate key 'a'", '{"a": 1, "a": 2}'),
    (b"[" * 100_000 + b"]" * 100_000, "ascii", "nesting too deep",
     "[" * 100_000 + "]" * 100_000),
], ids=["not-utf-8", "duplicate-key", "too-deep"])
def test_strict_json_refusals_with_a_declared_charset(body, charset, why, doc):
    with pytest.raises(json.JSONDecodeError) as e:
        json_of(body, f"application/json; charset={charset}")
    assert (e.value.msg, e.value.doc, e.value.pos) == (why, doc, 0)


def test_api_error_defaults():
    e = ApiError(503, "busy")
    assert (e.status, e.message, e.headers, e.rejected, str(e)) == (503, "busy", {}, False,
                                                                    "busy")
    e = ApiError(503, "busy", {"Retry-After": "1"}, rejected=True)
    assert (e.headers, e.rejected) == ({"Retry-After": "1"}, True)


def test_a_utf8_bom_is_skipped_declared_or_not():
    # A new user's review: with no charset the BOM was skipped (utf-8-sig), with
    # charset=utf-8 it was refused ("Unexpected UTF-8 BOM"), naming no byte.
    body = b'\xef\xbb\xbf{"ids": [1, 2]}'
    for content_type in (None, "application/json; charset=utf-8",
                         "application/json; charset=UTF8"):
        assert json_of(body, content_type) == {"ids": [1, 2]}


def test_charsets_that_cannot_carry_json_are_refused_or_named():
    # "undefined" passed the charset check (its decode error was taken for a short probe) and
    # then failed as "There was an error parsing the body": it is refused up front (415)
    assert charset_refusal("undefined") == (
        "charset 'undefined' cannot encode JSON text; send UTF-8 (JSON's encoding, RFC 8259) "
        "or name a text encoding")
    assert charset_refusal("utf-32") is None and charset_refusal("latin-1") is None
    # a codec whose errors carry no position: the 400 names the charset and the codec's words
    with pytest.raises(json.JSONDecodeError) as e:
        json_of(b'{"ids": [1]}', "application/json; charset=punycode")
    assert e.value.msg.startswith("the body is not valid punycode: ")
