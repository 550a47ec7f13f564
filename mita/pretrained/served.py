"""A fine-tuned transformers model folder as a checkpoint of this product: what the service
serves and the advisor profiles (``args.checkpoint: DIR``, ``python -m profiler advise DIR``).

``mita.config.checkpoint_metadata`` reads such a folder (a ``config.json`` with
``model_type``) without torch (``pretrained_metadata``: the ``ModelConfig`` it is measured as,
its labels, positions and MiTA setting), ``mita.data.task.checkpoint_task`` gives its task
(its own tokenizer, at most its positions) and ``service.engine.load_served`` loads it with
this module's ``load_served``, as a ``PretrainedClassifier``: the model behind the product's
forward interface (``model(ids, key_padding_mask, hook=)``), every MiTA stage of every layer
timed by the hook (``stage_hook``). Everything downstream — the service's classifiers and
gateway, its pre-start checks, the advisor — takes it as it takes the product's own
checkpoints.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor, nn

from ..config import ModelConfig
from ..hooks import NULL_HOOK, StageHook
from .folder import load_classifier, max_tokens
from .hf_attention import CONFIG_KEY, PretrainedSetting, setting_of, stage_hook


class PretrainedClassifier(nn.Module):
    """A transformers classifier behind the product's forward interface.

    ``forward(ids, key_padding_mask=None, hook=NULL_HOOK)``: ``ids`` ``(B, N)`` int64 token
    ids (text) or pixel ids 1 … 256 of ``image_size``² pixels row by row (image; the grey
    value on every channel, scaled to [0, 1] as training did, ``folder.pixel_batch``);
    ``key_padding_mask`` ``(B, N)`` bool, True = padding (text only). Returns the logits
    ``(B, classes)`` in the weights' dtype. ``config`` is the ``ModelConfig`` it is measured
    as (``mita.config.pretrained_metadata``)."""

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
