"""MiTA attention, the long-sequence classifier, its data and training.

The names below are imported on first use (PEP 562): ``import mita.tools.argtypes`` or
``mita.data`` (the load tester's, every CLI's argument checks) must not import torch, which
takes 1.5-2 s on 2 cores before a command can even refuse a bad flag."""

from __future__ import annotations

import importlib

# name → the module that defines it
_EXPORTS = {
    "dense_attention": "attention", "mita_attention": "attention",
    "ModelConfig": "config",
    "dense_flops": "cost", "mita_flops": "cost", "mita_stage_flops": "cost",
    "MITA_STAGES": "hooks", "MODEL_STAGES": "hooks", "NULL_HOOK": "hooks", "StageHook": "hooks",
    "DenseAttention": "layers", "MiTAAttention": "layers",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
