"""The stage hook: how attention and the model let a profiler time each stage.

A hook is any object with ``stage(name)`` and ``layer(index)``, each returning a context
manager. The stage names are the
profiler's contract (docs/kernels.md, "MiTA in this repository"): ``pool``, ``landmark_scores``,
``topk``, ``shared_compress``, ``route``, ``gather``, ``attention`` for MiTA, plus the model
stages ``embed``, ``qkv_proj``, ``out_proj``, ``ffn``, ``head``. Dense attention reports
``attention`` for its whole SDPA call.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Protocol

MITA_STAGES = ("pool", "landmark_scores", "topk", "shared_compress", "route", "gather", "attention")
MODEL_STAGES = ("embed", "qkv_proj", "out_proj", "ffn", "head")
# Every stage in the order a forward runs it: tables, plots, the dashboard and Grafana list
# stages in this order and draw each in its colour below, the same everywhere.
STAGE_ORDER = ("embed", "qkv_proj", *MITA_STAGES, "out_proj", "ffn", "head")
# Twelve colours that stay apart (tab20 picks); MiTA's routing stages are cool, its attention
# and the model's own stages warm or neutral.
STAGE_COLORS = {
    "embed": "#7f7f7f", "qkv_proj": "#8c564b", "pool": "#17becf",
    "landmark_scores": "#1f77b4", "topk": "#aec7e8", "shared_compress": "#2ca02c",
    "route": "#bcbd22", "gather": "#ff9896", "attention": "#d62728", "out_proj": "#9467bd",
    "ffn": "#ff7f0e", "head": "#e377c2",
}
OTHER_STAGE_COLOR = "#c7c7c7"
# The two variants' colours wherever both are drawn: the dashboard (served in /v1/stats) and
# the load tester's plots.
VARIANT_COLORS = {"mita": "#1f6fb4", "dense": "#e07b10"}
# A stage figure from fewer staged forwards than this is shown with its count and greyed out:
# one or two samples (a first call, a cold cache) are no basis for comparing variants.
MIN_STAGE_SAMPLES = 5


def stage_sorted(names) -> list[str]:
    """``names`` in ``STAGE_ORDER`` (names outside it last, alphabetically), duplicates dropped."""
    names = set(names)
    return ([s for s in STAGE_ORDER if s in names]
            + sorted(n for n in names if n not in STAGE_ORDER))


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


class Cancelled(Exception):
    """Raised inside a forward by ``check_cancelled`` once its callers have gone."""


_cancel = threading.local()


@contextmanager
def cancellable(gone: Callable[[], bool]) -> Iterator[None]:
    """Within (in this thread): ``check_cancelled`` raises ``Cancelled`` once ``gone()`` is
    True. The model asks before each block and dense attention before each query chunk of a
    long sequence on the CPU, so a forward whose callers left (a client gone, a gateway
    timeout) frees its replica within a chunk instead of running to the end (dense at
    N = 262,144 on 2 CPU cores: minutes)."""
    previous = getattr(_cancel, "gone", None)
    _cancel.gone = gone
    try:
        yield
    finally:
        _cancel.gone = previous


def check_cancelled() -> None:
    """Raises ``Cancelled`` when the innermost ``cancellable`` of this thread says its
    callers have gone; nothing outside one."""
    gone = getattr(_cancel, "gone", None)
    if gone is not None and gone():
        raise Cancelled("the forward's callers have gone")
