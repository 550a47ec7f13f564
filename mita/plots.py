"""Per-stage time against N, drawn the same way by the profiler sweep and the load tester.

Every stage keeps its colour and place in the legend (``mita.hooks.STAGE_COLORS``, in
``STAGE_ORDER``), as on the dashboard and in Grafana. Log-log axes: the small routing stages
stay visible next to dense attention at large N (a linear stacked bar hides them).
"""

from __future__ import annotations

from pathlib import Path

from .hooks import OTHER_STAGE_COLOR, STAGE_COLORS, stage_sorted


def stage_lines(panels: dict[str, list[tuple[int, dict[str, float]]]], path: Path,
                ylabel: str) -> Path:
    """``stage_figure`` written to ``path`` (PNG); returns ``path``."""
    import matplotlib.pyplot as plt

    fig = stage_figure(panels, ylabel)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


def stage_figure(panels: dict[str, list[tuple[int, dict[str, float]]]], ylabel: str):
    """A matplotlib figure: one subplot per panel title, one line per stage (ms against N,
    log-log): ``panels[title]`` is a list of ``(N, {stage: ms})``; the total of each point's
    stages is a dashed black line. One legend, right of the plots, in ``STAGE_ORDER``.
    Raises ValueError without panels."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not panels:
        raise ValueError("no panels to plot")
    fig, axes = plt.subplots(1, len(panels), figsize=(4.6 * len(panels) + 1.8, 4.2),
                             squeeze=False, sharey=True)
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
