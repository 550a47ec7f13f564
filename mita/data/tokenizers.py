"""The tokenizers a checkpoint can carry, and their spec in its ``config.json`` (``task``).

- ``listops``: the ListOps tokenizer (``mita.data.listops``): 16 ids, 0 padding.
- ``bytes``: byte-level, as LRA's text and image tasks: the UTF-8 bytes of a text, byte b as
  id b + 1, 0 padding (257 ids). A grey-scale image is the same: pixel value p as id p + 1.
- ``ids``: the user's own token ids, sent as ``ids`` (no text): ids 1 … ``vocab_size`` − 1,
  0 padding.
- ``sentencepiece``: a subword tokenizer learned from the training split (``train_subword``,
  SentencePiece's unigram model, set to round-trip every text exactly: no normalisation, no
  added or removed spaces, bytes for what its pieces do not cover); id 0 padding. Its model
  file lies beside the checkpoint's config.json (``SUBWORD_FILE``).
- ``transformers``: a pretrained transformers model's own fast tokenizer (its folder's
  ``tokenizer.json``, read by the tokenizers library, special tokens added: what
  ``python -m mita.training --model`` trained on); its padding id is the model's. Never in a
  spec: the folder's ``tokenizer.json`` is the spec.

A spec is a small JSON object, ``{"kind": "bytes"}``, ``{"kind": "ids", "vocab_size": V}``,
``{"kind": "listops"}``, ``{"kind": "sentencepiece", "file": "tokenizer.model", "vocab_size":
V}``; ``from_spec`` checks it. No torch: the service's gateway reads it.
"""

from __future__ import annotations

import io
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

from . import listops
from .vocab import Vocabulary

KINDS = ("bytes", "ids", "listops", "sentencepiece")
SUBWORD_FILE = "tokenizer.model"
BYTES_VOCAB_SIZE = 257  # 256 byte values + padding (id 0)
MAX_IDS_VOCAB_SIZE = 1 << 20  # mita.config.LIMITS["vocab_size"]


@dataclass(frozen=True)
class Tokenizer:
    """``kind`` in ``KINDS`` or ``"transformers"``; ``vocab_size``: ids 0 … vocab_size − 1, 0
    padding (``transformers``: the model's padding id); ``model``: a sentencepiece tokenizer's
    model file or a transformers ``tokenizer.json`` (bytes)."""

    kind: str
    vocab_size: int
    model: bytes | None = field(default=None, repr=False)

    @cached_property
    def _subword(self):
        import sentencepiece

        return sentencepiece.SentencePieceProcessor(model_proto=self.model)

    @cached_property
    def _transformers(self):
        import tokenizers

        tok = tokenizers.Tokenizer.from_str(self.model.decode("utf-8"))
        tok.no_truncation()  # a sequence past the positions is refused, not cut
        tok.no_padding()
        return tok

    def warm(self) -> None:
        """Load what ``encode`` needs now (a pretrained model's tokenizer: seconds, with
        transformers' import), not in the first request."""
        if self.kind == "transformers":
            self._transformers  # noqa: B018 (a cached property: loaded once)

    def __getstate__(self):  # pickled to the gateway's replica without the processor
        return {k: v for k, v in self.__dict__.items()
                if k not in ("_subword", "_transformers")}

    @property
    def vocab(self) -> Vocabulary:
        """The ids this tokenizer gives: 0 … ``vocab_size`` − 1, 0 padding."""
        return Vocabulary(self.vocab_size, 0)

    @property
    def takes_text(self) -> bool:
        """Whether a ``text`` can be tokenized (an ``ids`` tokenizer takes ids only)."""
        return self.kind != "ids"

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (not padded, not truncated). Raises ValueError when the text
        cannot be tokenized: an unknown ListOps token (named, with its position), any text
        for an ``ids`` tokenizer, a text that gives a ``transformers`` tokenizer only its
        special tokens (empty, or only spaces)."""
        if self.kind == "bytes":
            return [b + 1 for b in text.encode("utf-8")]
        if self.kind == "listops":
            return listops.encode(text)
        if self.kind == "sentencepiece":
            return list(self._subword.encode(text))
        if self.kind == "transformers":  # not cut: a sequence over the positions is refused
            encoding = self._transformers.encode(text)
            if all(encoding.special_tokens_mask):  # [CLS] [SEP] of an empty text: no token
                raise ValueError("empty sequence: the text has no tokens to classify (only "
                                 "the model's special tokens)")
            return encoding.ids
        raise ValueError("this model takes token ids ('ids'), not text: it was trained on "
                         "ids, so it has no tokenizer for text")

    def spec(self) -> dict:
        """The JSON object ``from_spec`` reads back."""
        if self.kind == "sentencepiece":
            return {"kind": self.kind, "file": SUBWORD_FILE, "vocab_size": self.vocab_size}
        if self.kind == "transformers":
            return {"kind": self.kind, "file": "tokenizer.json"}
        return {"kind": self.kind} | ({"vocab_size": self.vocab_size}
                                      if self.kind == "ids" else {})

    def decode(self, ids) -> str:
        """The text of ``ids`` (bytes and sentencepiece tokenizers: exact round trips)."""
        if self.kind == "bytes":
            return bytes(i - 1 for i in ids).decode("utf-8")
        if self.kind == "sentencepiece":
            return self._subword.decode([int(i) for i in ids])
        if self.kind == "transformers":
            return self._transformers.decode([int(i) for i in ids], skip_special_tokens=False)
        raise ValueError(f"a {self.kind} tokenizer does not decode here")


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


def train_subword(texts, vocab_size: int) -> Tokenizer:
    """A sentencepiece tokenizer of ``vocab_size`` pieces learned from ``texts`` (unigram
    model; id 0 padding, 1 unknown, no sentence markers; byte fallback, identity
    normalisation, spaces kept as written: ``decode(encode(t)) == t`` for every text).
    Raises ValueError when sentencepiece cannot reach ``vocab_size`` on these texts."""
    import sentencepiece

    model = io.BytesIO()
    try:
        sentencepiece.SentencePieceTrainer.train(
            sentence_iterator=iter(texts), model_writer=model, vocab_size=vocab_size,
            model_type="unigram", pad_id=0, unk_id=1, bos_id=-1, eos_id=-1, byte_fallback=True,
            normalization_rule_name="identity", add_dummy_prefix=False,
            remove_extra_whitespaces=False, allow_whitespace_only_pieces=True,
            split_digits=True, character_coverage=1.0, max_sentence_length=1 << 20,
            num_threads=1, minloglevel=2)  # one thread: the same pieces every run
    except RuntimeError as e:
        raise ValueError(f"--subword-vocab {vocab_size}: {e}") from None
    return Tokenizer("sentencepiece", vocab_size, model.getvalue())


def from_spec(spec, folder: str | Path | None = None) -> Tokenizer:
    """The tokenizer of a checkpoint's ``task.tokenizer`` object (``folder``: the checkpoint,
    where a sentencepiece model file lies). Raises ValueError naming what is wrong."""
    if not isinstance(spec, dict) or spec.get("kind") not in KINDS:
        raise ValueError(f"tokenizer must be an object with 'kind' one of {KINDS}, got "
                         f"{spec!r:.80}")
    allowed = {"ids": {"kind", "vocab_size"}, "sentencepiece": {"kind", "file", "vocab_size"}
               }.get(spec["kind"], {"kind"})
    if set(spec) - allowed:
        raise ValueError(f"tokenizer {spec['kind']!r} takes only {sorted(allowed)}, got "
                         f"{sorted(spec)}")
    if spec["kind"] == "ids":
        return ids_tokenizer(spec.get("vocab_size"))
    if spec["kind"] == "sentencepiece":
        if spec.get("file") != SUBWORD_FILE or folder is None:
            raise ValueError(f"tokenizer 'sentencepiece' needs file {SUBWORD_FILE!r} beside "
                             "config.json")
        model = (Path(folder) / SUBWORD_FILE).read_bytes()
        tok = Tokenizer("sentencepiece", spec.get("vocab_size"), model)
        if tok._subword.get_piece_size() != tok.vocab_size:
            raise ValueError(f"{Path(folder) / SUBWORD_FILE} has {tok._subword.get_piece_size()} "
                             f"pieces, the spec says {tok.vocab_size}")
        return tok
    return BYTES if spec["kind"] == "bytes" else LISTOPS
