"""Small random-initialised transformers model folders, written by ``save_pretrained`` (the
real saving and loading code), for the tests of ``mita.pretrained``: nothing is downloaded.
Text models get a WordPiece tokenizer over single characters, so any English text encodes."""

from __future__ import annotations

import string
from pathlib import Path

import torch

CHARS = string.ascii_lowercase + string.digits + ".,;:!?'\"-()&"
SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def tokenizer(folder: Path):
    from transformers import BertTokenizerFast

    folder.mkdir(parents=True, exist_ok=True)
    pieces = SPECIAL + list(CHARS) + [f"##{c}" for c in CHARS]
    tok = BertTokenizerFast(vocab={p: i for i, p in enumerate(pieces)}, do_lower_case=True)
    tok.save_pretrained(folder)
    return tok


def head(labels) -> dict:
    """Config fields of a head trained on ``labels`` (None: transformers' untrained default)."""
    return {} if labels is None else {"id2label": dict(enumerate(labels)),
                                      "label2id": {n: i for i, n in enumerate(labels)}}


def bert(folder: Path, labels=None, seed: int = 0, max_positions: int = 512, **config):
    """A 2-layer BERT (hidden 32, 4 heads) with its tokenizer; ``labels``: a trained head's."""
    from transformers import BertConfig, BertForSequenceClassification

    tok = tokenizer(folder)
    torch.manual_seed(seed)
    cfg = BertConfig(vocab_size=len(tok), hidden_size=32, num_hidden_layers=2,
                     num_attention_heads=4, intermediate_size=64,
                     max_position_embeddings=max_positions, **head(labels), **config)
    BertForSequenceClassification(cfg).save_pretrained(folder)
    return folder


def modernbert(folder: Path, seed: int = 0, max_positions: int = 4096, labels=None):
    """A 3-layer ModernBERT (global attention every 3rd layer, local window 16) with 8K-style
    long positions, and the character tokenizer."""
    from transformers import ModernBertConfig, ModernBertForSequenceClassification

    tok = tokenizer(folder)
    torch.manual_seed(seed)
    cfg = ModernBertConfig(vocab_size=len(tok), hidden_size=32, num_hidden_layers=3,
                           num_attention_heads=4, intermediate_size=64,
                           max_position_embeddings=max_positions, global_attn_every_n_layers=3,
                           local_attention=16, pad_token_id=tok.pad_token_id,
                           cls_token_id=tok.cls_token_id, sep_token_id=tok.sep_token_id,
                           bos_token_id=tok.cls_token_id, eos_token_id=tok.sep_token_id,
                           **head(labels))
    ModernBertForSequenceClassification(cfg).save_pretrained(folder)
    return folder


def vit(folder: Path, seed: int = 0, deit: bool = False, image_size: int = 14,
        patch_size: int = 2, labels=None):
    """A 2-layer ViT (or DeiT with its distillation token) over ``image_size``² grey images in
    ``patch_size``² patches: a 7 × 7 patch grid by default, grey values on 3 channels."""
    from transformers import (
        DeiTConfig,
        DeiTForImageClassification,
        ViTConfig,
        ViTForImageClassification,
    )

    torch.manual_seed(seed)
    config, model = (DeiTConfig, DeiTForImageClassification) if deit else (
        ViTConfig, ViTForImageClassification)
    cfg = config(image_size=image_size, patch_size=patch_size, hidden_size=32,
                 num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                 **head(labels))
    folder.mkdir(parents=True, exist_ok=True)
    model(cfg).save_pretrained(folder)
    return folder


def deberta(folder: Path):
    """A DeBERTa-v2 folder: an architecture whose attention transformers does not dispatch
    through AttentionInterface."""
    from transformers import DebertaV2Config, DebertaV2ForSequenceClassification

    tok = tokenizer(folder)
    cfg = DebertaV2Config(vocab_size=len(tok), hidden_size=32, num_hidden_layers=1,
                          num_attention_heads=4, intermediate_size=64)
    DebertaV2ForSequenceClassification(cfg).save_pretrained(folder)
    return folder


class Capture:
    """An attention implementation that records each call's q, k, v and mask, then runs
    ``"mita"``'s own function: what the model hands MiTA, and what MiTA gives back."""

    def __init__(self):
        self.calls = []

    def __call__(self, module, query, key, value, attention_mask, **kw):
        from mita.pretrained import hf_attention

        out, _ = hf_attention.mita_attention_forward(module, query, key, value, attention_mask,
                                                     **kw)
        self.calls.append((query, key, value, attention_mask, kw, out))
        return out, None


def capture(model):
    """Switch ``model`` to ``Capture``'s implementation (the ``"mita"`` masks); returns it."""
    from transformers import AttentionInterface, AttentionMaskInterface

    from mita.pretrained import hf_attention, register

    seen = Capture()
    register()
    AttentionInterface.register("mita_capture", seen)
    AttentionMaskInterface.register("mita_capture", hf_attention._mask)
    model.set_attn_implementation("mita_capture")
    return seen
