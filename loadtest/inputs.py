"""What the load tester sends, and whether the target can take it.

By default, generated ListOps expressions of exactly N tokens (``generate_long``, made in
``engine.run_load``). With ``--data FILE``, the rows of a labelled file in the training formats
(``mita.data.labelled.read_file``), in file order, joined and cut to each N:

- ids rows: the rows' ids back to back, the last row cut: exactly N ids;
- text rows for a byte-level target (one token per UTF-8 byte): the texts joined with one
  space, cut to N bytes and then back to the last whole character, so that no multi-byte
  character is split: N − 3 … N bytes, i.e. tokens;
- text rows for a sentencepiece target: how many tokens a text makes is the model's to know, so
  N characters (code points) are sent, and the answers' ``n`` says how many tokens were read.

Each N gets ``count`` sequences; each starts at the row after the last row the one before it
used (the cut row's rest is skipped), and the rows start again from the first when the file
runs out. ``refusal`` says, from the target's ``/v1/models`` answer alone, why it cannot take
what would be sent (``python -m loadtest`` then refuses before sending anything);
``warnings`` what it takes but changes (its ``max_length`` cut).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain

from mita.data.labelled import DataFile

SEPARATOR = " "  # between two text rows; ids rows have no separator id, so none
# Target tokenizers whose token count of a text only the model knows (N counts characters):
# the product's sentencepiece and a pretrained model's own (transformers).
SUBWORD = ("sentencepiece", "transformers")
GENERATED = {"source": "generated", "text": "real ListOps (generate_long)", "unit": "tokens"}
# What N counts, per unit, in the report's words.
UNIT_NOTES = {
    "ids": "N ids, each a token",
    "bytes": "N UTF-8 bytes, each a token of the byte-level tokenizer; a cut never splits a "
             "character, so a sequence may be up to 3 bytes short of N",
    "characters": "N characters: the target's subword tokenizer makes its tokens of "
                  "them and only the model knows how many, so N counts characters sent and "
                  "the served n column the tokens the model read, from the answers' n",
}


@dataclass(frozen=True)
class Joined:
    """One sequence made of rows: ``payload`` the request's ``{"ids": [...]}`` or ``{"text":
    "..."}``; ``start`` the index of its first row (0-based, counted on past the file's end
    when rows repeat); ``rows`` the rows it holds at least one token of; ``last_cut`` whether
    the last of them was cut short; ``sent`` its length in its unit (ids, bytes or
    characters)."""

    payload: dict
    start: int
    rows: int
    last_cut: bool
    sent: int


def input_unit(models: dict, data: DataFile | None) -> str:
    """What N counts for this target and data: ``"tokens"`` (generated ListOps), ``"ids"``
    (ids rows), ``"bytes"`` (text rows, any target tokenizer but sentencepiece) or
    ``"characters"`` (text rows, a sentencepiece target). ``models``: the target's
    ``/v1/models`` JSON."""
    if data is None:
        return "tokens"
    if data.kind == "ids":
        return "ids"
    return "characters" if models["task"]["tokenizer"]["kind"] in SUBWORD else "bytes"


def join_rows(rows: list, n: int, start: int, unit: str) -> Joined:
    """Rows ``start``, ``start + 1``, … (wrapping round ``rows``) joined until they reach ``n``
    of ``unit``, then cut to ``n``. ``rows``: id sequences (``unit="ids"``, joined back to
    back) or texts (``"bytes"``: cut on a UTF-8 character boundary, ``"characters"``; joined
    with ``SEPARATOR``). Raises ValueError when ``rows`` is empty, ``n`` < 1, or the cut leaves
    nothing (``n`` bytes short of the first character)."""
    if not rows or n < 1:
        raise ValueError(f"cannot join {len(rows)} rows to N = {n}")
    if unit == "ids":
        items, sep, empty = [list(r) for r in rows], [], []
    elif unit == "bytes":
        items, sep, empty = [r.encode("utf-8") for r in rows], SEPARATOR.encode(), b""
    elif unit == "characters":
        items, sep, empty = list(rows), SEPARATOR, ""
    else:
        raise ValueError(f"unit must be ids, bytes or characters, got {unit!r}")
    parts, spans, length, i = [], [], 0, start
    while length < n:
        if parts:
            parts.append(sep)
            length += len(sep)
        item = items[i % len(items)]
        parts.append(item)
        spans.append((length, length + len(item)))
        length += len(item)
        i += 1
    whole = list(chain.from_iterable(parts)) if unit == "ids" else empty.join(parts)
    cut = n
    if unit == "bytes":  # back off out of a character's continuation bytes (10xxxxxx)
        while 0 < cut < len(whole) and whole[cut] & 0xC0 == 0x80:
            cut -= 1
    if cut == 0:
        raise ValueError(f"N = {n} bytes cannot hold the first character of row "
                         f"{start % len(rows) + 1} of the file: nothing to send")
    used = [(a, b) for a, b in spans if a < cut]
    seq = whole[:cut]
    payload = ({"ids": seq} if unit == "ids"
               else {"text": seq.decode("utf-8") if unit == "bytes" else seq})
    return Joined(payload, start, len(used), used[-1][1] > cut, cut)


def _span(lo: int, hi: int) -> str:
    return f"{lo}" if lo == hi else f"{lo}–{hi}"


def describe(n: int, joined: list[Joined], total_rows: int, unit: str) -> dict:
    """What was sent at ``n``: every sequence (its first row, 1-based in the file; rows; whether
    the last was cut; length sent), the rows used and whether they repeated, and a line saying
    so, e.g. ``"N = 1024: 4 sequences of 3–4 rows joined (rows 1–14 of 100), the last row of
    each cut; 1022–1024 bytes sent"``."""
    uses = joined[-1].start + joined[-1].rows - joined[0].start
    rows = [j.rows for j in joined]
    sent = [j.sent for j in joined]
    cut = sum(j.last_cut for j in joined)
    where = (f"rows 1–{uses} of {total_rows}" if uses <= total_rows
             else f"all {total_rows} rows, repeated: {uses} row uses")
    cuts = ("none cut" if cut == 0 else "the last row of each cut" if cut == len(joined)
            else f"the last row of {cut} of them cut")
    text = (f"N = {n}: {len(joined)} sequence{'s' * (len(joined) > 1)} of "
            f"{_span(min(rows), max(rows))} row{'s joined' * (max(rows) > 1)} ({where}), "
            f"{cuts}; {_span(min(sent), max(sent))} {unit} sent")
    return {"n": n, "unit": unit, "rows_used": min(uses, total_rows),
            "repeated": uses > total_rows,
            "sequences": [{"first_row": j.start % total_rows + 1, "rows": j.rows,
                           "last_cut": j.last_cut, "sent": j.sent} for j in joined],
            "text": text}


def build(data: DataFile, ns: list[int], count: int, unit: str
          ) -> tuple[dict[int, list[dict]], dict]:
    """``count`` sequences of ``data``'s rows per N in ``ns`` (``join_rows``, each from the row
    after the previous one's last): the request payloads by N, and the report's ``input``
    (file, SHA-256, rows, unit, what was sent at each N: ``describe``). Raises ValueError as
    ``join_rows``."""
    rows = [ex.ids if data.kind == "ids" else ex.text for ex in data.examples]
    payloads, per_n = {}, []
    for n in sorted(set(ns)):
        joined, start = [], 0
        for _ in range(count):
            joined.append(join_rows(rows, n, start, unit))
            start += joined[-1].rows
        payloads[n] = [j.payload for j in joined]
        per_n.append(describe(n, joined, len(rows), unit))
    return payloads, {"source": "file", "path": data.path, "sha256": data.sha256,
                      "kind": data.kind, "rows": len(rows), "unit": unit,
                      "joined_by": "one space" if data.kind == "text" else "nothing",
                      "per_n": per_n}


def _serves(task: dict) -> str:
    tok = task["tokenizer"]
    what = {"listops": "ListOps", "bytes": "byte-level text",
            "sentencepiece": "sentencepiece text",
            "ids": f"ids only, vocabulary {tok.get('vocab_size')}"}.get(tok["kind"], tok["kind"])
    return f"the target serves task {task['name']!r} ({what})"


def refusal(models: dict, ns: list[int], data: DataFile | None) -> str | None:
    """Why the target (``models``: its ``/v1/models`` JSON) cannot take the load test's
    sequences at lengths ``ns`` — generated ListOps (``data`` None) or ``data``'s rows — as a
    one-line message naming the cause and the fix, or None when it can. Refused: a JSON
    without ``task``; generated ListOps for a task whose tokenizer is not ListOps'; text rows
    for a task that takes no text, or for ListOps (whose text must be one well-formed
    expression); ids rows with an id outside the task's vocabulary (1 … vocab_size − 1); an N
    other than H·W for a grid task, or above the gateway's ``max_n`` (``ab_policy``), once cut
    to the task's ``max_length`` as the service cuts it (not checked against ``max_n``: N
    characters for a sentencepiece task, whose token count only the model knows)."""
    task = models.get("task") if isinstance(models, dict) else None
    if not isinstance(task, dict):
        return ("the target's /v1/models has no 'task': is --url a mita-serve service (and "
                "its route prefix, e.g. http://127.0.0.1:8000/own)?")
    tok = task["tokenizer"]
    if data is None:
        if tok["kind"] != "listops":
            return (f"{_serves(task)}; generated ListOps expressions are not its input: pass "
                    "--data FILE with its rows (a file in the format it was trained on)")
    elif data.kind == "text":
        if not task["takes_text"]:
            return (f"{_serves(task)}: it takes no text, and {data.path} has text rows: pass "
                    "--data with ids rows (.jsonl, 'ids' and 'label')")
        if tok["kind"] == "listops":
            return (f"{_serves(task)}, whose text must be one well-formed expression: the "
                    f"joined rows of {data.path} would be refused; run without --data "
                    "(generated ListOps)")
    else:
        size = tok["vocab_size"]
        for ex in data.examples:
            bad = next((x for x in ex.ids if not 1 <= x < size), None)
            if bad is not None:
                return (f"{ex.path}:{ex.line}: id {bad} is outside the target's vocabulary "
                        f"[1, {size - 1}] ({_serves(task)}): pass --data with the rows of the "
                        "file it was trained on")
    # The service cuts a sequence to the trained length first, then checks what it serves
    # against the grid and max_n.
    top = task.get("max_length")
    served = {n: min(n, top) if top else n for n in ns}
    grid = task.get("grid")
    if grid:
        h, w = grid
        wrong = " ".join(str(n) for n in sorted(served) if served[n] != h * w)
        if wrong:
            return (f"{_serves(task)}, whose model classifies {h}×{w} grids: every sequence "
                    f"must have exactly {h * w} tokens, and --n {wrong} would be refused: pass "
                    f"--n {h * w}")
    max_n = (models.get("ab_policy") or {}).get("max_n")
    characters = data is not None and data.kind == "text" and tok["kind"] in SUBWORD
    positions = task.get("positions")  # a pretrained model's
    if positions is not None and not characters:
        over = " ".join(str(n) for n in sorted(served) if served[n] > positions)
        if over:
            return (f"--n {over} is above the target model's {positions} positions (its "
                    f"gateway refuses longer sequences): pass --n up to {positions}")
    if max_n is not None and not characters:  # N characters: the token count is not known
        over = " ".join(str(n) for n in sorted(served) if served[n] > max_n)
        if over:
            return (f"--n {over} is above the target's max_n = {max_n} (its gateway refuses "
                    f"longer sequences): pass --n up to {max_n}, or raise the Gateway's max_n "
                    "in its Serve config")
    return None


def warnings(models: dict, ns: list[int], unit: str) -> list[str]:
    """What the target takes but changes or may refuse (``models``: its ``/v1/models`` JSON;
    ``unit`` as ``input_unit``): with a ``max_length`` L (its training length) the service cuts
    every longer sequence to L tokens (the end ``truncate`` names), so at N > L the model reads
    only L of them; N characters (``"characters"``) may make more tokens than L, or, without
    L, more than the gateway's ``max_n`` (then refused with 422, counted as errors). One line
    per fact; [] when none."""
    task = models["task"]
    top = task.get("max_length")
    cuts = f"max_length; the {task.get('truncate')} of a longer sequence is cut off"
    out = []
    over = ", ".join(str(n) for n in sorted(set(ns)) if top is not None and n > top)
    if over and unit == "characters":
        out.append(f"the target's model reads at most {top} tokens ({cuts}): N = {over} "
                   f"characters may make more tokens than that, and then the model reads only "
                   f"{top} of them (the served n column)")
    elif over:
        out.append(f"the target's model reads at most {top} tokens ({cuts}): at N = {over} the "
                   f"service cuts each sequence to {top} tokens, so those rows time "
                   f"{top}-token forwards")
    max_n = (models.get("ab_policy") or {}).get("max_n")
    beyond = ", ".join(str(n) for n in sorted(set(ns)) if max_n is not None and n > max_n)
    if unit == "characters" and top is None and beyond:
        out.append(f"N = {beyond} characters may make more tokens than the target's max_n = "
                   f"{max_n}: such requests are refused (422) and count as errors")
    positions = task.get("positions")
    longer = ", ".join(str(n) for n in sorted(set(ns)) if positions is not None
                       and n > positions)
    if unit == "characters" and longer:
        out.append(f"N = {longer} characters may make more tokens than the target model's "
                   f"{positions} positions: such requests are refused (422) and count as "
                   "errors")
    return out


def error_gate(samples, max_error_rate: float) -> str | None:
    """Why the run fails its error budget, or None: the share of timed requests not answered
    200 — every other status, back-pressure refusals (429, 503) and transport errors (status
    0) included, since a refused request measured nothing — above ``max_error_rate`` (0 … 1),
    or no timed request at all. ``samples``: the run's ``engine.Sample`` list (warm-ups are not
    in it)."""
    if not samples:
        return "no timed request was sent: nothing was measured"
    failed: dict[int, int] = {}
    for s in samples:
        if s.status != 200:
            failed[s.status] = failed.get(s.status, 0) + 1
    bad = sum(failed.values())
    if bad / len(samples) <= max_error_rate:
        return None
    by = ", ".join(f"{count} × {status or 'no answer (transport error)'}"
                   for status, count in sorted(failed.items()))
    return (f"{bad} of {len(samples)} timed requests were not answered 200 "
            f"({100 * bad / len(samples):.1f} % > --max-error-rate {max_error_rate:g}): {by}")
