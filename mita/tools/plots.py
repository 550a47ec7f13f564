"""The report files of the profiler sweep, the advisor and the load tester: per-stage time
against N drawn the same way by each, their figures and their CSV files.

Figures are ``matplotlib.figure.Figure`` objects made without pyplot (matplotlib's advice for
code running in servers and threads): no backend to choose, no global figure list, nothing
to close. Every stage keeps its colour and place in the legend (``mita.hooks.STAGE_COLORS``, in
``STAGE_ORDER``), as on the dashboard and in Grafana. Log-log axes: the small routing stages
stay visible next to dense attention at large N (a linear stacked bar hides them).
"""

from __future__ import annotations

import csv
from collections.abc import Iterable, Sequence
from pathlib import Path

from ..hooks import OTHER_STAGE_COLOR, STAGE_COLORS, stage_sorted


def stage_lines(panels: dict[str, list[tuple[int, dict[str, float]]]], path: Path,
                ylabel: str) -> Path:
    """``stage_figure`` written to ``path`` (PNG); returns ``path``."""
    stage_figure(panels, ylabel).savefig(path, dpi=110, bbox_inches="tight")
    return path


def figure(**kwargs):
    """A ``matplotlib.figure.Figure(**kwargs)`` (e.g. ``figsize`` in inches), not registered
    with pyplot."""
    from matplotlib.figure import Figure

    return Figure(**kwargs)


def save(fig, path: Path) -> Path:
    """``fig`` laid out (``tight_layout``) and written to ``path`` (PNG, 110 dpi); returns
    ``path``."""
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def write_csv(path: Path, header: Sequence[str], rows: Iterable[Sequence]) -> Path:
    """``header`` then ``rows`` written to ``path`` as CSV (``csv.writer``'s dialect: commas,
    CRLF line ends, ``None`` as an empty field); returns ``path``."""
    with open(path, "w", newline="") as f:  # newline="": csv writes its own line ends
        w = csv.writer(f)
        w.writerow(header)
        w.writerows(rows)
    return path


def stage_figure(panels: dict[str, list[tuple[int, dict[str, float]]]], ylabel: str):
    """A matplotlib figure: one subplot per panel title, one line per stage (ms against N,
    log-log): ``panels[title]`` is a list of ``(N, {stage: ms})``; the total of each point's
    stages is a dashed black line. One legend, right of the plots, in ``STAGE_ORDER``.
    Raises ValueError without panels."""
    if not panels:
        raise ValueError("no panels to plot")
    fig = figure(figsize=(4.6 * len(panels) + 1.8, 4.2))
    axes = fig.subplots(1, len(panels), squeeze=False, sharey=True)
    handles: dict[str, object] = {}
    for ax, (title, points) in zip(axes[0], panels.items(), strict=True):
        points = sorted(points, key=lambda p: p[0])
        ns = [n for n, _ in points]
        for st in stage_sorted(s for _, ms in points for s in ms):
            sel = [(n, ms[st]) for n, ms in points if ms.get(st, 0) > 0]
            if sel:
                (line,) = ax.plot(*zip(*sel, strict=True), "o-", ms=3, lw=1.4, label=st,
                                  color=STAGE_COLORS.get(st, OTHER_STAGE_COLOR))
                handles.setdefault(st, line)
        (line,) = ax.plot(ns, [sum(ms.values()) for _, ms in points], "k--", lw=1,
                          label="total")
        handles.setdefault("total", line)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("N (tokens)")
        ax.grid(True, which="major", alpha=0.3)
    axes[0][0].set_ylabel(ylabel)
    order = [*stage_sorted(s for s in handles if s != "total"), "total"]
    # Outside the axes, so no legend covers a line.
    fig.legend([handles[s] for s in order], order, loc="center left", fontsize=7,
               bbox_to_anchor=(1.0, 0.5), frameon=False)
    fig.tight_layout()
    return fig
