"""The stage hook: how attention and the model let a profiler time each stage.

A hook is any object with ``stage(name)`` and ``layer(index)``, each returning a context
manager. The stage names are the
profiler's contract (``../shared/mita-spec.md``, "Stage names"): ``pool``, ``landmark_scores``,
``topk``, ``shared_compress``, ``route``, ``gather``, ``attention`` for MiTA, plus the model
stages ``embed``, ``qkv_proj``, ``out_proj``, ``ffn``, ``head``. Dense attention reports
``attention`` for its whole SDPA call.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Protocol

MITA_STAGES = ("pool", "landmark_scores", "topk", "shared_compress", "route", "gather", "attention")
MODEL_STAGES = ("embed", "qkv_proj", "out_proj", "ffn", "head")


class StageHook(Protocol):
    def stage(self, name: str) -> AbstractContextManager:
        """Context manager around one stage of the current layer."""

    def layer(self, index: int) -> AbstractContextManager:
        """Context manager around encoder block ``index``; stages inside belong to it."""


class NullHook:
    """The default hook: times nothing and costs one ``nullcontext`` per stage."""

    _ctx = nullcontext()

    def stage(self, name: str) -> AbstractContextManager:
        return self._ctx

    def layer(self, index: int) -> AbstractContextManager:
        return self._ctx


NULL_HOOK = NullHook()
