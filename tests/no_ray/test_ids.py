"""The gateway's input checks (service.inputs), without Ray: token ids against a checkpoint's
vocabulary, and a ListOps text's grammar."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from mita.config import ATTENTIONS
from mita.data.vocab import Vocabulary
from service.inputs import ApiError, binary_ids, check_ids, to_ids
from service.schemas import ClassifyRequest
from service.settings import VARIANTS

ROOT = Path(__file__).resolve().parents[2]
LISTOPS = Vocabulary(16, pad_id=0)


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


MALFORMED = [  # (text, what the 422 says: the fault and its token position)
    ("[MAX 2 3", "unbalanced brackets: '[MAX' at position 0 is never closed"),
    ("[MAX 2 [MIN 4 7 ] 0", "unbalanced brackets: '[MAX' at position 0 is never closed"),
    ("[MAX 2 [MIN 4 7", "'[MAX' at position 0 and '[MIN' at position 2 are never closed"),
    ("[MAX 2 3 ] ]", "unbalanced brackets: ']' at position 4 closes no operator"),
    ("] 2", "unbalanced brackets: ']' at position 0 closes no operator"),
    ("[FOO 2 3 ]", "unknown operator '[FOO' at position 0"),
    ("[MAX ]", "'[MAX' at position 0 has no arguments (closed at position 1)"),
    ("[MAX 2 [SM ] ]", "'[SM' at position 2 has no arguments (closed at position 3)"),
    ("[MAX 1 ] [MIN 2 ]", "'[MIN' at position 3 follows a complete expression (ended at "
                          "position 2)"),
    ("2 3", "'3' at position 1 follows a complete expression"),
]


@pytest.mark.parametrize("text,message", MALFORMED)
def test_malformed_listops_text_is_refused_naming_the_position(text, message):
    """Found by a user: "[MAX 2 3" (never closed) got a confident 200 label."""
    with pytest.raises(ApiError) as e:
        to_ids(ClassifyRequest(text=text), 16384, LISTOPS)
    assert e.value.status == 422 and message in e.value.message, e.value.message


def test_well_formed_text_and_free_form_ids_and_byte_vocabularies_pass():
    # The README's example, a bare digit (LRA's root may be one), LRA's parentheses.
    assert to_ids(ClassifyRequest(text="[MAX 2 [MIN 4 7 ] 0 ]"), 100, LISTOPS).tolist() == [
        12, 3, 11, 5, 8, 15, 1, 15]
    assert to_ids(ClassifyRequest(text="7"), 100, LISTOPS).tolist() == [8]
    assert to_ids(ClassifyRequest(text="( ( [SM 4 ) 7 ) ]"), 100, LISTOPS).tolist() == [
        14, 5, 8, 15]
    # ids are free-form, and so is text for a vocabulary that is not ListOps'.
    assert to_ids(ClassifyRequest(ids=[12, 3, 4]), 100, LISTOPS).tolist() == [12, 3, 4]
    assert to_ids(ClassifyRequest(text="[MAX 2 3"), 100, Vocabulary(257)).tolist() == [12, 3, 4]
    # The length limit is checked first (it bounds the grammar check's work).
    with pytest.raises(ApiError, match="N = 40000 exceeds max_n = 16384"):
        to_ids(ClassifyRequest(text=" ".join(["3"] * 40000)), 16384, LISTOPS)
    # The shipped checkpoint's vocabulary (what the gateway is built with) is ListOps'.
    cfg = json.loads((ROOT / "checkpoints" / "listops-default" / "config.json").read_text())
    assert Vocabulary(cfg["config"]["vocab_size"], cfg["config"]["pad_id"]).listops
    assert not Vocabulary(257).listops and not Vocabulary(16, pad_id=15).listops
