"""A transformers model folder (``config.json``, ``model.safetensors``, tokenizer files) as a
classifier: checked, loaded offline with MiTA or dense attention, its inputs made.

A folder is text (a tokenizer beside the weights: BERT, RoBERTa, ModernBERT, …) or image
(``image_size`` and ``patch_size`` in its config: ViT, DeiT, …). Its classification head's
labels are transformers' ``id2label`` / ``label2id``; a head whose labels are transformers'
defaults (``LABEL_0``, …) is untrained and takes the data's labels.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from torch import Tensor

from ..config import default_pretrained_setting, pretrained_labels, pretrained_positions
from .hf_attention import PretrainedSetting, setting_of, use_attention

WEIGHTS = ("model.safetensors", "model.safetensors.index.json")
TOKENIZER_FILES = ("tokenizer.json", "vocab.txt", "tokenizer.model", "vocab.json")


def is_model_folder(path: str | Path) -> bool:
    """Whether ``path`` is a transformers model folder: a ``config.json`` with ``model_type``
    (this product's own checkpoints have a ``config`` object instead)."""
    try:
        meta = json.loads((Path(path) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(meta, dict) and "model_type" in meta and "config" not in meta


def folder_kind(path: str | Path) -> str:
    """``"text"`` or ``"image"`` for a transformers model folder that has what a classifier
    needs. Raises ValueError naming the folder and what is missing: not a folder, no
    ``config.json`` or one without ``model_type``, no safetensors weights (no pickle is
    loaded), a text model without tokenizer files."""
    path = Path(path)
    if not path.is_dir():
        raise ValueError(f"{path}: not a folder (a transformers model folder holds "
                         "config.json, model.safetensors and the tokenizer's files)")
    if not is_model_folder(path):
        raise ValueError(f"{path}/config.json: missing or not a transformers config (no "
                         "'model_type')")
    if not any((path / w).is_file() for w in WEIGHTS):
        raise ValueError(f"{path}: no weights ({' or '.join(WEIGHTS)}; save_pretrained "
                         "writes them)")
    config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    if "image_size" in config and "patch_size" in config:
        return "image"
    if not any((path / t).is_file() for t in TOKENIZER_FILES):
        raise ValueError(f"{path}: a text model without its tokenizer (none of "
                         f"{', '.join(TOKENIZER_FILES)})")
    return "text"


def trained_labels(config) -> list[str] | None:
    """The head's label names in index order, or None for transformers' defaults
    (``LABEL_i``: an untrained head); ``mita.config.pretrained_labels``."""
    return pretrained_labels(config.to_dict())


def _model_class(config, kind: str):
    from transformers import AutoModelForImageClassification, AutoModelForSequenceClassification

    auto = AutoModelForImageClassification if kind == "image" else \
        AutoModelForSequenceClassification
    try:
        cls = auto._model_mapping[type(config)]
    except KeyError:
        raise ValueError(f"{config.model_type}: transformers has no "
                         f"{'image' if kind == 'image' else 'sequence'}-classification model "
                         "for this architecture") from None
    if isinstance(cls, tuple):  # DeiT: (the classifier, the one with a distillation head)
        cls = cls[0]
    if not getattr(cls, "_supports_attention_backend", False):
        raise ValueError(f"{cls.__name__} ({config.model_type}) does not dispatch its attention "
                         "through transformers' AttentionInterface, so MiTA cannot be put into "
                         "it (DeBERTa, Longformer and BigBird do not; BERT, RoBERTa, "
                         "DistilBERT, ELECTRA, ModernBERT, ViT, DeiT, BEiT and DINOv2 do)")
    return cls


def load_classifier(path: str | Path, attention: str, labels: list[str] | None = None,
                    setting: PretrainedSetting | None = None, device="cpu", seed: int = 0):
    """The folder's model with a classification head, offline, in eval mode, attention
    ``"mita"`` or ``"dense"`` (``use_attention``), and its tokenizer (None for an image model).

    ``labels``: the data's label names; a head trained on other labels is refused, an
    untrained one is sized to them (``id2label`` / ``label2id`` written the transformers way).
    ``setting``: the MiTA setting (default: the folder's ``config.mita``, else
    ``default_setting``). ``seed``: a new head's initial weights (the same head for every
    way of a comparison). The weights are loaded in float32 whatever the folder's dtype (a
    float16 model fine-tuned in float16 overflows to NaN). Raises ValueError
    (``folder_kind``'s, an architecture without AttentionInterface, a decoder, a head/label
    mismatch, a bad ``mita`` setting in its config, weights that do not read)."""
    from transformers import AutoConfig, AutoTokenizer

    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is downloaded
    kind = folder_kind(path)
    config = AutoConfig.from_pretrained(path, local_files_only=True)
    cls = _model_class(config, kind)
    if getattr(config, "is_decoder", False) or getattr(config, "add_cross_attention", False):
        raise ValueError(f"{path}: a decoder or cross-attention config (is_decoder / "
                         "add_cross_attention): MiTA here is bidirectional self-attention")
    if getattr(config, "mita", None) is not None:
        setting_of(config)  # a bad saved setting, refused by name before loading
    have = trained_labels(config)
    if labels is not None:
        if have is not None and sorted(have) != sorted(labels):
            raise ValueError(f"{path}: its head was trained on labels {have}, the data has "
                             f"{sorted(labels)}")
        if have is None:
            config.id2label = dict(enumerate(labels))
            config.label2id = {name: i for i, name in enumerate(labels)}
            config.num_labels = len(labels)
    if setting is None and getattr(config, "mita", None) is None:
        setting = default_setting(config, kind)
    # an untrained head sized to the data's labels: its saved (default, 2-label) weights
    # are replaced, as transformers does for a new head
    torch.manual_seed(seed)
    try:
        model = cls.from_pretrained(path, config=config, local_files_only=True,
                                    attn_implementation="sdpa", dtype=torch.float32,
                                    ignore_mismatched_sizes=have is None and labels is not None)
    except Exception as e:  # safetensors' and transformers' own errors on bad weights
        if isinstance(e, ValueError):
            raise
        raise ValueError(f"{path}: its weights do not load ({type(e).__name__}: {e})") from None
    use_attention(model, attention, setting)
    tokenizer = None if kind == "image" else AutoTokenizer.from_pretrained(
        path, local_files_only=True)
    return model.to(device).eval(), tokenizer


def default_setting(config, kind: str | None = None) -> PretrainedSetting:
    """A model's MiTA setting when none is given (``mita.config.default_pretrained_setting``):
    images, m = k = 25 (the paper's DeiT, §4.1) over the patch grid (m = 4 for grids under
    10 × 10); text, m = k = 16, 1-D pooling."""
    return PretrainedSetting.from_dict(default_pretrained_setting(config.to_dict()))


def max_tokens(model) -> int:
    """The longest sequence the model's positions allow (``mita.config.pretrained_positions``:
    ``max_position_embeddings``, RoBERTa's offset taken off; image models: their patches and
    prefix tokens). ``model``: a transformers model or its config."""
    return pretrained_positions(getattr(model, "config", model).to_dict())


def pixel_batch(rows: list[list[int]], config) -> Tensor:
    """Image rows (pixel value p as id p + 1, row by row, ``mita.data.images``) →
    ``pixel_values`` ``(B, C, S, S)`` float32 in [0, 1] with S = ``config.image_size``, the
    grey value on every channel. Raises ValueError for a row of another size than S²."""
    size = config.image_size
    for r in rows:
        if len(r) != size * size:
            raise ValueError(f"an image row of {len(r)} pixels for a model of "
                             f"{size}×{size} images")
    x = (torch.tensor(rows, dtype=torch.float32) - 1).clamp(0, 255) / 255
    return x.view(-1, 1, size, size).expand(-1, config.num_channels, -1, -1).contiguous()


def text_batch(rows: list[list[int]], pad_id: int) -> tuple[Tensor, Tensor]:
    """Token-id rows → right-padded ``input_ids`` and ``attention_mask`` (1 = token), int64."""
    n = max(len(r) for r in rows)
    ids = torch.full((len(rows), n), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), n), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, :len(r)] = torch.tensor(r, dtype=torch.long)
        mask[i, :len(r)] = 1
    return ids, mask


def logits(model, rows: list[list[int]], pad_id: int | None = None) -> Tensor:
    """The model's logits ``(B, classes)`` float32 for token-id rows (text, ``pad_id`` the
    tokenizer's) or pixel rows (image models)."""
    if hasattr(model.config, "image_size"):
        x = pixel_batch(rows, model.config).to(model.device)
        return model(pixel_values=x).logits.float()
    ids, mask = text_batch(rows, pad_id)
    return model(input_ids=ids.to(model.device), attention_mask=mask.to(model.device)
                 ).logits.float()
