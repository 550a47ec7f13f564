"""A fine-tuned transformers model folder as a checkpoint of this product: what the service
serves and the advisor profiles (``args.checkpoint: DIR``, ``python -m profiler advise DIR``).

``mita.config.checkpoint_metadata``, ``mita.data.task.checkpoint_task`` and
``mita.model.load_checkpoint`` hand such a folder (a ``config.json`` with ``model_type``) to
this module, so everything downstream of them — the service's classifiers and gateway, its
pre-start checks, the advisor — takes it as it takes the product's own checkpoints:

- ``folder_metadata``: the ``checkpoint_metadata`` of the folder: ``config`` is the
  ``ModelConfig`` the model is measured as (hidden size, layers, heads, FFN width, classes,
  positions and its MiTA setting: the analytic FLOPs and the top-k choice read it),
  ``weights_sha256`` its safetensors' hash, ``training`` its ``training.json`` and
  ``pretrained`` what ``/v1/models`` shows (architecture, text or image, the setting).
- ``folder_task``: its ``Task``: labels from ``id2label``, text through the model's own
  tokenizer (special tokens added, as training tokenized it), ids checked against its
  vocabulary, at most its positions (longer: refused, never cut); an image model's rows are
  its image_size² pixel ids.
- ``PretrainedClassifier``: the model behind the product's forward interface
  (``model(ids, key_padding_mask, hook=)``), every MiTA stage of every layer timed by the
  hook (``stage_hook``).

Only a trained head is served: transformers' default labels (``LABEL_0``, …) mean an
untrained head, whose answers would be noise.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch
from torch import Tensor, nn

from ..config import ModelConfig
from ..hooks import NULL_HOOK, StageHook
from .folder import (
    WEIGHTS,
    default_setting,
    folder_kind,
    load_classifier,
    max_tokens,
    trained_labels,
)
from .hf_attention import CONFIG_KEY, PretrainedSetting, setting_of, stage_hook

TRAINING_FILE = "training.json"  # written by python -m mita.training --model


def _weights_sha256(folder: Path) -> str:
    """SHA-256 over the folder's safetensors files in name order (one file, or the shards of
    an index)."""
    h = hashlib.sha256()
    files = sorted(folder.glob("*.safetensors")) or [folder / WEIGHTS[0]]
    for path in files:
        with open(path, "rb") as f:
            for chunk in iter(lambda f=f: f.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()


def _hf_config(folder: Path):
    from transformers import AutoConfig

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        return AutoConfig.from_pretrained(folder, local_files_only=True)
    except Exception as e:  # transformers' own errors for a config it cannot read
        raise ValueError(f"{folder}/config.json: not a transformers config it can read "
                         f"({type(e).__name__}: {e})"[:400]) from None


def measured_config(config, setting: PretrainedSetting, attention: str = "mita") -> dict:
    """The ``ModelConfig`` fields a transformers model (its ``config``) is measured as: the
    analytic FLOPs, activation memory and the top-k choice read hidden size, layers, heads,
    FFN width, classes and the MiTA ``setting``. Text: its vocabulary, padding id and
    positions; image: pixel ids 1 … 256 (257 ids, never padded) and image_size² of them."""
    image = hasattr(config, "image_size")
    dim = config.hidden_size
    ffn = getattr(config, "intermediate_size", None) or getattr(config, "hidden_dim", None)
    return {"vocab_size": 257 if image else int(config.vocab_size),
            "num_classes": int(config.num_labels),
            "pad_id": 0 if image else int(config.pad_token_id or 0),
            "dim": int(dim), "depth": int(config.num_hidden_layers),
            "num_heads": int(config.num_attention_heads), "ffn_dim": int(ffn or 4 * dim),
            "max_len": config.image_size ** 2 if image else max_tokens(config),
            "attention": attention, "num_landmarks": setting.num_landmarks,
            "topk": setting.topk, "route_topk": setting.route_topk,
            "shared_scale": setting.shared_scale, "landmark_grid": setting.landmark_grid}


def folder_metadata(folder: str | Path) -> dict:
    """The ``checkpoint_metadata`` of a transformers model folder (module docstring).
    Raises ValueError naming the folder: ``folder_kind``'s refusals, an untrained head, a
    bad saved MiTA setting, a config transformers cannot read."""
    folder = Path(folder)
    kind = folder_kind(folder)
    config = _hf_config(folder)
    labels = trained_labels(config)
    if labels is None:
        raise ValueError(f"{folder}: its classification head is untrained (transformers' "
                         "default labels LABEL_0 …): fine-tune it on your labelled file first, "
                         f"python -m mita.training --model {folder} --train FILE --out DIR, "
                         "and serve DIR")
    saved = getattr(config, CONFIG_KEY, None)
    setting = setting_of(config) if saved is not None else default_setting(config, kind)
    positions = max_tokens(config)
    side = config.image_size if kind == "image" else None
    cfg = measured_config(config, setting)
    ModelConfig.from_dict(cfg)  # refused here, naming the field, not in a replica
    training = {}
    if (folder / TRAINING_FILE).is_file():
        try:
            training = json.loads((folder / TRAINING_FILE).read_text(encoding="utf-8"))
        except ValueError as e:
            raise ValueError(f"{folder / TRAINING_FILE}: not valid JSON ({e})") from None
    architecture = (config.architectures or [None])[0] or type(config).__name__
    return {"config": cfg, "weights_sha256": _weights_sha256(folder),
            "training": training if isinstance(training, dict) else {},
            "pretrained": {"architecture": architecture, "model_type": config.model_type,
                           "kind": kind, "labels": labels, "positions": positions,
                           "image_size": side,
                           # the folder's own MiTA setting (None: it has none, the default
                           # was taken); what is served is ``config`` (mita_setting applied)
                           "saved_setting": None if saved is None else setting.to_dict()}}


def folder_task(meta: dict, cfg: ModelConfig, folder: str | Path):
    """The ``Task`` of a transformers folder from its ``folder_metadata`` ``meta`` and
    ``ModelConfig`` ``cfg``: text tokenized by the folder's own tokenizer (loaded here, so a
    broken one is refused now, naming the folder), image rows of exactly image_size² pixel
    ids. Raises ValueError naming the folder."""
    from ..data.task import Task
    from ..data.tokenizers import Tokenizer
    from ..data.vocab import Vocabulary

    p = meta["pretrained"]
    if p["kind"] == "image":
        side = p["image_size"]
        return Task("pretrained-image", tuple(p["labels"]), Tokenizer("ids", 257),
                    Vocabulary(257, 0), grid=(side, side), architecture=p["architecture"])
    tok = Tokenizer("transformers", cfg.vocab_size, folder=str(Path(folder).resolve()))
    try:
        tok.encode("a")
    except Exception as e:  # the tokenizer files' own errors
        raise ValueError(f"{folder}: its tokenizer does not load ({type(e).__name__}: {e})"
                         [:400]) from None
    return Task("pretrained-text", tuple(p["labels"]), tok, Vocabulary(cfg.vocab_size,
                cfg.pad_id), architecture=p["architecture"], positions=p["positions"])


class PretrainedClassifier(nn.Module):
    """A transformers classifier behind the product's forward interface.

    ``forward(ids, key_padding_mask=None, hook=NULL_HOOK)``: ``ids`` ``(B, N)`` int64 token
    ids (text) or pixel ids 1 … 256 of ``image_size``² pixels row by row (image; the grey
    value on every channel, scaled to [0, 1] as training did, ``folder.pixel_batch``);
    ``key_padding_mask`` ``(B, N)`` bool, True = padding (text only). Returns the logits
    ``(B, classes)`` in the weights' dtype. ``config`` is the ``ModelConfig`` it is measured
    as (``folder_metadata``)."""

    cuda_graph_safe = False  # transformers' forward branches on the mask in Python

    def __init__(self, model, config: ModelConfig, kind: str):
        super().__init__()
        self.hf, self.config, self.kind = model, config, kind

    def forward(self, ids: Tensor, key_padding_mask: Tensor | None = None,
                hook: StageHook = NULL_HOOK) -> Tensor:
        with stage_hook(hook):
            if self.kind == "image":
                c = self.hf.config
                dtype = next(self.hf.parameters()).dtype
                x = ((ids.to(torch.float32) - 1).clamp(0, 255) / 255).to(dtype)
                x = x.view(-1, 1, c.image_size, c.image_size).expand(-1, c.num_channels, -1, -1)
                return self.hf(pixel_values=x).logits
            mask = None if key_padding_mask is None else (~key_padding_mask).long()
            return self.hf(input_ids=ids, attention_mask=mask).logits

    def model_tokens(self, n: int) -> int:
        """The tokens the transformer sees for an input of ``n`` ids (an image: its patches
        and prefix tokens): what the analytic FLOPs count."""
        if self.kind != "image":
            return n
        return max_tokens(self.hf.config)

    def set_mita_backend(self, backend: str) -> None:
        """``mita_attention``'s backend for every layer (``mita.model.set_mita_backend``)."""
        s = setting_of(self.hf.config)
        setattr(self.hf.config, CONFIG_KEY, PretrainedSetting.from_dict(
            s.to_dict() | {"backend": backend}).to_dict())


def load_served(folder: str | Path, meta: dict, cfg: ModelConfig,
                device: str | torch.device = "cpu") -> PretrainedClassifier:
    """The folder's model in eval mode on ``device`` with ``cfg.attention`` and ``cfg``'s MiTA
    setting (the folder's, with the service's ``mita_setting`` applied), float32 (the engine
    casts it). Raises ValueError as ``load_classifier``."""
    kind = meta["pretrained"]["kind"]
    setting = PretrainedSetting(cfg.num_landmarks, cfg.topk, cfg.route_topk, cfg.shared_scale,
                                cfg.landmark_grid)
    model, _ = load_classifier(folder, cfg.attention, meta["pretrained"]["labels"], setting,
                               device=device)
    return PretrainedClassifier(model, cfg, kind).eval()
