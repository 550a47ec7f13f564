"""Request input: strict JSON bodies, token ids checked against the checkpoint's vocabulary
and cut to its trained length (``Served``), and ``ApiError`` (any answer other than 200). Used
by ``service.gateway`` and ``service.http``; nothing here needs Ray."""

import json
from dataclasses import dataclass

import numpy as np
from fastapi import Request
from fastapi.routing import APIRoute

from mita.data.listops import check_expression
from mita.data.task import Task
from mita.data.tokenizers import LISTOPS, Tokenizer
from mita.data.vocab import Vocabulary

from .schemas import ClassifyRequest


class ApiError(Exception):
    """An answer other than 200. ``rejected``: refused by back-pressure (counted in
    ``rejections_total``, not as an error)."""

    def __init__(self, status: int, message: str, headers: dict | None = None,
                 rejected: bool = False):
        super().__init__(message)
        self.status, self.message, self.headers = status, message, headers or {}
        self.rejected = rejected


def _reject_duplicates(pairs: list[tuple[str, object]]) -> dict:
    out = {}
    for key, value in pairs:
        if key in out:  # parsers disagree on which copy wins: refuse the ambiguity
            raise ValueError(f"duplicate key {key!r}")
        out[key] = value
    return out


def declared_charset(content_type: str) -> str | None:
    """The ``charset`` parameter of a Content-Type header value, lower case, unquoted; None
    when there is none."""
    for param in content_type.split(";")[1:]:
        name, _, value = param.partition("=")
        if name.strip().lower() == "charset":
            return value.strip().strip('"').lower()
    return None


def charset_refusal(charset: str | None) -> str | None:
    """Why a declared charset cannot be honoured (not a text encoding Python knows), or
    None. JSON is UTF-8 (RFC 8259); another declared charset is decoded as declared."""
    if charset is None:
        return None
    try:
        # a round trip of JSON text: b"".decode looks nothing up, and "undefined" or a codec
        # that cannot encode "{}" is no text encoding to read JSON in
        if '{"a": 1}'.encode(charset).decode(charset) != '{"a": 1}':
            raise UnicodeError
    except UnicodeError:
        return (f"charset {charset[:40]!r} cannot encode JSON text; send UTF-8 (JSON's "
                "encoding, RFC 8259) or name a text encoding")
    except LookupError:
        return (f"charset {charset[:40]!r} is not a text encoding this service knows; send "
                "UTF-8 (JSON's encoding, RFC 8259) or name a known charset")
    return None


def _doc(body: bytes | str) -> str:
    return body if isinstance(body, str) else body.decode(errors="replace")


def decode_body(body: bytes, charset: str | None) -> str:
    """``body`` as text: decoded by its declared ``charset``, else by the encoding JSON's
    first bytes show (``json.detect_encoding``: UTF-8 unless a BOM or NUL bytes say UTF-16/32),
    strictly. One rule for every invalid byte sequence — CESU-8 surrogates (``ED A0 80``)
    included, which ``json.loads`` of bytes would let through ("surrogatepass") — a
    ``json.JSONDecodeError`` (→ 400 "malformed JSON body") naming the byte, its line and
    column (1-based, counted in bytes) and, with a declared charset, that charset."""
    # A UTF-8 byte-order mark is skipped whether UTF-8 is declared or detected (RFC 8259 §8.1
    # lets a parser ignore it; detected UTF-8 read it as utf-8-sig, declared UTF-8 refused it).
    encoding = charset or json.detect_encoding(body)
    if encoding.replace("_", "-") in ("utf-8", "utf8"):
        encoding = "utf-8-sig"
    try:
        return body.decode(encoding)
    except UnicodeDecodeError as e:
        line = body.count(b"\n", 0, e.start) + 1
        column = e.start - (body.rfind(b"\n", 0, e.start) + 1) + 1
        name = charset or ("UTF-8" if encoding.startswith("utf-8") else encoding)
        why = (f"the body is not valid {name}: byte 0x{body[e.start]:02x} at line {line}, "
               f"column {column} ({e.reason})")
        if charset is not None:
            why += ", the charset its Content-Type declares"
        raise json.JSONDecodeError(why, _doc(body), 0) from None
    except UnicodeError as e:  # a codec's own error, without a position (punycode, idna)
        raise json.JSONDecodeError(f"the body is not valid {charset or encoding}: {e}"[:300],
                                   _doc(body), 0) from None


class StrictJSONRequest(Request):
    """``json()`` that refuses duplicate keys and too-deep nesting with a JSON decode error
    (→ 400 "malformed JSON body") instead of taking the last copy or a RecursionError (500);
    a body is decoded by its declared ``charset`` (``CheckBody`` refused an unknown one), not
    taken for UTF-8."""

    async def json(self):
        if not hasattr(self, "_json"):
            body = decode_body(await self.body(),
                               declared_charset(self.headers.get("content-type", "")))
            try:
                self._json = json.loads(body, object_pairs_hook=_reject_duplicates)
            except RecursionError:
                raise json.JSONDecodeError("nesting too deep", _doc(body), 0) from None
            except ValueError as e:
                if isinstance(e, json.JSONDecodeError):
                    raise
                why = ("an integer with too many digits" if "int_max_str_digits" in str(e)
                       else str(e))
                raise json.JSONDecodeError(why, _doc(body), 0) from None
        return self._json


class StrictJSONRoute(APIRoute):
    def get_route_handler(self):
        handler = super().get_route_handler()

        async def strict_handler(request: Request):
            return await handler(StrictJSONRequest(request.scope, request.receive))
        return strict_handler


def _out_of_range(value, position: int, vocab: Vocabulary) -> ApiError:
    shown = str(value)
    shown = shown if len(shown) <= 30 else shown[:30] + "…"
    if vocab.pad_id == 0:
        allowed = f"[1, {vocab.size - 1}] (0 is padding)"
    else:
        allowed = f"[0, {vocab.size - 1}] except the padding id {vocab.pad_id}"
    return ApiError(422, f"token id {shown} at position {position} is out of range {allowed}")


@dataclass(frozen=True)
class Served:
    """A request's sequence as the model reads it: ``ids`` (checked, cut to the task's trained
    length, in ``vocab.dtype``), ``original_n`` the number of tokens sent (after tokenizing a
    text) and ``truncated`` the end cut off (``"tail"`` or ``"head"``, the task's
    ``truncate``), or None when nothing was cut."""

    ids: np.ndarray
    original_n: int
    truncated: str | None = None

    def report(self) -> dict:
        """The answer's fields about the cut: ``original_n`` and ``truncated`` when the
        sequence was cut, else nothing (``ClassifyResponse`` leaves them out)."""
        if self.truncated is None:
            return {}
        return {"original_n": self.original_n, "truncated": self.truncated}


def checked(ids: np.ndarray, max_n: int, vocab: Vocabulary, hint: str = "",
            task: Task | None = None) -> Served:
    """Validate a 1-D integer array of token ids and cut it as training did, in this order:
    every id sent against the checkpoint's vocabulary (an id past the cut too: it was sent),
    emptiness, the cut to the trained length (``task.cut``; none without a ``task`` or its
    ``max_length``), then ``max_n`` on the length served. Returns the ``Served`` sequence in
    ``vocab.dtype`` (what travels to the classifier). Raises ApiError(422) saying what is
    wrong (``hint`` appended to an out-of-range message); nothing is allocated for the model
    before this passes."""
    bad = vocab.first_bad(ids)
    if bad is not None:
        error = _out_of_range(ids[bad], bad, vocab)
        error.message += hint
        raise error
    if not ids.size:
        raise ApiError(422, "empty sequence: no tokens to classify")
    sent = int(ids.size)
    if task is not None:
        ids = task.cut(ids)
    if ids.size > max_n:
        raise ApiError(422, f"sequence length N = {ids.size} exceeds max_n = {max_n}")
    return Served(ids.astype(vocab.dtype, copy=False), sent,
                  task.truncate if ids.size < sent else None)


def check_ids(ids: np.ndarray, max_n: int, vocab: Vocabulary, hint: str = "") -> np.ndarray:
    """``checked`` without a task (no cut): the ids in ``vocab.dtype``. Raises as ``checked``."""
    return checked(ids, max_n, vocab, hint).ids


def served_ids(req: ClassifyRequest, max_n: int, vocab: Vocabulary,
               tokenizer: Tokenizer = LISTOPS, task: Task | None = None) -> Served:
    """The ``Served`` sequence of a JSON request (``checked``): a ``text`` tokenized by the
    checkpoint's ``tokenizer`` (``mita.data.task``; an ids-only one refuses text), or the ``ids``,
    cut as ``task`` says. A ``text`` for a ListOps checkpoint must also be one well-formed
    expression (``check_expression``: after the length check, which bounds its work); ``ids``
    stay free-form. Raises ApiError(422) naming the fault and its token position."""
    if req.text is not None:  # the body-size limit bounds the tokenising work
        try:
            ids = tokenizer.encode(req.text)
        except ValueError as e:
            raise ApiError(422, str(e)) from None
    else:
        ids = req.ids
    try:
        arr = np.array(ids, dtype=np.int64)
    except OverflowError:  # an integer beyond int64 is out of range too: name the first
        bad = next(i for i, x in enumerate(ids) if not -(2**63) <= x < 2**63)
        raise _out_of_range(ids[bad], bad, vocab) from None
    served = checked(arr, max_n, vocab, task=task)
    if req.text is not None and vocab.listops and tokenizer.kind == "listops":
        # A malformed expression has no ListOps value: refuse it rather than answer a label.
        try:
            check_expression(req.text)
        except ValueError as e:
            raise ApiError(422, f"text is not a well-formed ListOps expression: {e}") from None
    return served


def to_ids(req: ClassifyRequest, max_n: int, vocab: Vocabulary,
           tokenizer: Tokenizer = LISTOPS) -> np.ndarray:
    """``served_ids`` without a task (no cut): the ids. Raises as ``served_ids``."""
    return served_ids(req, max_n, vocab, tokenizer).ids


BINARY_DTYPES = {"uint8": np.dtype("<u1"), "int32": np.dtype("<i4")}


def served_binary(body: bytes, dtype: str, max_n: int, vocab: Vocabulary,
                  task: Task | None = None) -> Served:
    """The ``Served`` sequence of an ``application/octet-stream`` body: little-endian
    ``uint8`` (one byte per token) or ``int32`` (four) ids, cut as ``task`` says. Raises
    ApiError: 400 for an empty body or a length that is not a whole number of ids, 422 as
    ``checked``."""
    width = BINARY_DTYPES[dtype].itemsize
    if not body:
        raise ApiError(400, "empty request body: send the token ids as bytes "
                            f"({dtype}, little-endian)")
    if len(body) % width:
        raise ApiError(400, f"a body of {len(body)} bytes is not a whole number of {dtype} ids "
                            f"({width} bytes each)")
    other = "int32" if dtype == "uint8" else "uint8"
    return checked(np.frombuffer(body, dtype=BINARY_DTYPES[dtype]), max_n, vocab,
                   f"; the body was read as {dtype} little-endian (?dtype={dtype}): "
                   f"{other} ids need ?dtype={other}", task)


def binary_ids(body: bytes, dtype: str, max_n: int, vocab: Vocabulary) -> np.ndarray:
    """``served_binary`` without a task (no cut): the ids. Raises as ``served_binary``."""
    return served_binary(body, dtype, max_n, vocab).ids
