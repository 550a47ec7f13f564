"""MiTA inside a pretrained Hugging Face transformers model (the ``pretrained`` extra).

``register()`` adds two attention implementations to transformers' ``AttentionInterface`` and
``AttentionMaskInterface``: ``"mita"`` (``mita.attention.mita_attention``, every backend, with
its backward) and ``"mita_dense"`` (transformers' own SDPA attention, timed as the stage
``attention``). ``use_attention(model, "mita" | "dense", setting)`` switches a loaded model
between them; the MiTA setting is kept in the model's config (``config.mita``), so
``save_pretrained`` writes it and ``from_pretrained`` reads it back. ``stage_hook(hook)`` lets
a ``mita.timer.StageTimer`` time every MiTA stage of every layer inside such a model.

What is done, and why, in ``docs/pretrained.md``.
"""

from .hf_attention import (
    CONFIG_KEY,
    IMPLEMENTATIONS,
    PretrainedSetting,
    register,
    setting_of,
    stage_hook,
    use_attention,
)

__all__ = ["CONFIG_KEY", "IMPLEMENTATIONS", "PretrainedSetting", "register", "setting_of",
           "stage_hook", "use_attention"]
