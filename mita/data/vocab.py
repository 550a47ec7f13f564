"""A checkpoint's token vocabulary: which ids are real tokens, which integer type carries them,
and whether it is the ListOps tokenizer's. The service's input check and the advisor's data
reader both ask it."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .listops import PAD_ID, VOCAB


@dataclass(frozen=True)
class Vocabulary:
    """The checkpoint's token ids: ``0 … size - 1`` except ``pad_id`` (read from the
    checkpoint's config.json: ``vocab_size``, ``pad_id``)."""

    size: int
    pad_id: int = 0

    @property
    def listops(self) -> bool:
        """The ListOps tokenizer's vocabulary (``mita.data.listops.VOCAB``): a ``text`` must
        then be one well-formed expression. Any other (e.g. byte-level) is free-form."""
        return self.size == len(VOCAB) and self.pad_id == PAD_ID

    @property
    def dtype(self) -> type:
        """The smallest integer type the ids travel to the classifiers in."""
        return np.uint8 if self.size <= 256 else np.int32

    def first_bad(self, ids) -> int | None:
        """Position of the first id in the 1-D integer sequence ``ids`` that is not a real
        token (negative, ≥ ``size``, or ``pad_id``), or None when every id is one."""
        ids = np.asarray(ids)
        bad = np.flatnonzero((ids < 0) | (ids >= self.size) | (ids == self.pad_id))
        return int(bad[0]) if bad.size else None
