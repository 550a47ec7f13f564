"""The gateway's token-id check against a checkpoint's vocabulary (service.inputs), without Ray."""

from __future__ import annotations

import numpy as np
import pytest

from mita.config import ATTENTIONS
from service.inputs import ApiError, Vocabulary, binary_ids, check_ids
from service.schemas import VARIANTS


def test_ids_are_checked_against_the_checkpoints_vocabulary():
    listops = Vocabulary(16, pad_id=0)
    assert check_ids(np.array([1, 15, 3]), 10, listops).dtype == np.uint8
    with pytest.raises(ApiError, match=r"token id 16 at position 1 is out of range \[1, 15\] "
                                       r"\(0 is padding\)"):
        check_ids(np.array([3, 16]), 10, listops)
    # A byte-level checkpoint whose padding id is 256: 0 is a real byte, 256 is refused.
    text = Vocabulary(257, pad_id=256)
    ids = check_ids(np.array([0, 255, 7]), 10, text)
    assert ids.dtype == np.int32 and ids.tolist() == [0, 255, 7]
    with pytest.raises(ApiError, match=r"token id 256 at position 2 is out of range \[0, 256\] "
                                       r"except the padding id 256"):
        check_ids(np.array([0, 1, 256]), 10, text)
    with pytest.raises(ApiError, match="exceeds max_n = 2"):
        check_ids(np.array([1, 2, 3]), 2, listops)
    assert binary_ids(bytes([0, 255]), "uint8", 10, text).tolist() == [0, 255]


def test_service_variants_are_the_models_attentions():
    assert sorted(VARIANTS) == sorted(ATTENTIONS) == ["dense", "mita"]
