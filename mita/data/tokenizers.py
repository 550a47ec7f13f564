"""The tokenizers a checkpoint can carry, and their spec in its ``config.json`` (``task``).

- ``listops``: the ListOps tokenizer (``mita.data.listops``): 16 ids, 0 padding.
- ``bytes``: byte-level, as LRA's text and image tasks: the UTF-8 bytes of a text, byte b as
  id b + 1, 0 padding (257 ids). A grey-scale image is the same: pixel value p as id p + 1.
- ``ids``: the user's own token ids, sent as ``ids`` (no text): ids 1 … ``vocab_size`` − 1,
  0 padding.

A spec is a small JSON object, ``{"kind": "bytes"}``, ``{"kind": "ids", "vocab_size": V}``,
``{"kind": "listops"}``; ``from_spec`` checks it. No torch: the service's gateway reads it.
"""

from __future__ import annotations

from dataclasses import dataclass

from . import listops
from .vocab import Vocabulary

KINDS = ("bytes", "ids", "listops")
BYTES_VOCAB_SIZE = 257  # 256 byte values + padding (id 0)
MAX_IDS_VOCAB_SIZE = 1 << 20  # mita.config.LIMITS["vocab_size"]


@dataclass(frozen=True)
class Tokenizer:
    """``kind`` in ``KINDS``; ``vocab_size``: ids 0 … vocab_size − 1, 0 padding."""

    kind: str
    vocab_size: int

    @property
    def vocab(self) -> Vocabulary:
        return Vocabulary(self.vocab_size, 0)

    @property
    def takes_text(self) -> bool:
        """Whether a ``text`` can be tokenized (an ``ids`` tokenizer takes ids only)."""
        return self.kind != "ids"

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (not padded, not truncated). Raises ValueError when the text
        cannot be tokenized: an unknown ListOps token (named, with its position), or any text
        for an ``ids`` tokenizer."""
        if self.kind == "bytes":
            return [b + 1 for b in text.encode("utf-8")]
        if self.kind == "listops":
            return listops.encode(text)
        raise ValueError("this model takes token ids ('ids'), not text: it was trained on "
                         "ids, so it has no tokenizer for text")

    def spec(self) -> dict:
        """The JSON object ``from_spec`` reads back."""
        return {"kind": self.kind} | ({"vocab_size": self.vocab_size}
                                      if self.kind == "ids" else {})


BYTES = Tokenizer("bytes", BYTES_VOCAB_SIZE)
LISTOPS = Tokenizer("listops", len(listops.VOCAB))


def ids_tokenizer(vocab_size: int) -> Tokenizer:
    """The tokenizer of a user's own ids 1 … vocab_size − 1. Raises ValueError outside
    [2, MAX_IDS_VOCAB_SIZE]."""
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or not (
            2 <= vocab_size <= MAX_IDS_VOCAB_SIZE):
        raise ValueError(f"an ids vocabulary size must be an int in [2, {MAX_IDS_VOCAB_SIZE}] "
                         f"(ids 1 … size − 1, 0 is padding), got {vocab_size!r}")
    return Tokenizer("ids", vocab_size)


def from_spec(spec) -> Tokenizer:
    """The tokenizer of a checkpoint's ``task.tokenizer`` object. Raises ValueError naming
    what is wrong."""
    if not isinstance(spec, dict) or spec.get("kind") not in KINDS:
        raise ValueError(f"tokenizer must be an object with 'kind' one of {KINDS}, got "
                         f"{spec!r:.80}")
    allowed = {"kind", "vocab_size"} if spec["kind"] == "ids" else {"kind"}
    if set(spec) - allowed:
        raise ValueError(f"tokenizer {spec['kind']!r} takes only {sorted(allowed)}, got "
                         f"{sorted(spec)}")
    if spec["kind"] == "ids":
        return ids_tokenizer(spec.get("vocab_size"))
    return BYTES if spec["kind"] == "bytes" else LISTOPS
