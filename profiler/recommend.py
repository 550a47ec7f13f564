"""The advisor's answer from its finished units (``profiler.advise``): a row per setting —
quality (accuracy, macro-F1, balanced accuracy with their errors and drops from dense), and
latency per N with the speed-up over dense timed side by side — the recommendation at each N
and over the whole range under the user's constraint, and the warnings a reader must not miss
(``mita.tools.scores.score_warnings`` on dense's and the recommended settings' predictions; timings
at an N the served model would cut)."""

from __future__ import annotations

import math
from dataclasses import asdict
from typing import TYPE_CHECKING

from mita.tools.scores import score_warnings

from .advise_config import AdviseConfig, drop_points
from .advise_report import METRIC_NAMES, NOISY, drop_keys, serve_snippet

if TYPE_CHECKING:
    from mita.data.task import Task


def _quality(q: dict) -> dict:
    """A quality unit's fields as a report row holds them: accuracy, agreement, KL and the
    accuracy drop's SE; with the unit's ``scores`` (``mita.tools.scores``), also accuracy's SE,
    macro-F1 and balanced accuracy with their SEs, 95 % intervals and drops' SEs, and the
    scores themselves."""
    row = {k: q[k] for k in ("accuracy", "agreement", "kl", "drop_se_points")}
    sc = q.get("scores")
    if sc is not None:
        row |= {"accuracy_se": sc["accuracy_se"]}
        for name in ("macro_f1", "balanced_accuracy"):
            row |= {name: sc[name], f"{name}_se": sc[f"{name}_se"],
                    f"{name}_ci95": sc[f"{name}_ci95"],
                    f"{name}_drop_se_points": q[f"{name}_drop_se_points"]}
        row |= {"majority_rate": sc["majority_rate"], "scores": sc}
    return row


def report(cfg: AdviseConfig, done: dict, skipped: list, n_data: int | None = None,
           task: Task | None = None) -> dict:
    """Rows per setting (quality and per-N latency, speed-up over dense measured side by side),
    the recommendation at each N and for the whole range, and the warnings, from the finished
    units; ``n_data``: the sequences actually used (a file may hold fewer than ``size``);
    ``task``: the checkpoint's (its trained length and cut), if known."""
    dense_unit = done.get(("quality", "dense"))
    dense = _quality(dense_unit) if dense_unit is not None else None
    rows = []
    for name, setting in [("dense", None)] + [(s.name, s) for s in cfg.grid]:
        unit = done.get(("quality", name))
        row = {"setting": name, **(asdict(setting) if setting else {"m": None, "k": None,
                                                                    "s": None,
                                                                    "shared_scale": None})}
        if unit is not None:
            q = _quality(unit)
            row |= q
            if dense is not None:
                row["retention"] = (q["accuracy"] / dense["accuracy"] if dense["accuracy"]
                                    else None)
                row["accuracy_drop_points"] = drop_points(dense, q)
                for metric in ("macro_f1", "balanced_accuracy"):
                    if metric in q and metric in dense:
                        row[f"{metric}_drop_points"] = drop_points(dense, q, metric)
        row["latency"] = {}
        for n in cfg.ns:
            lat = done.get(("latency", name, n))
            if lat is not None:
                row["latency"][n] = {k: lat[k] for k in ("p50_ms", "min_ms", "max_ms",
                                                         "stages_ms", "peak_memory_bytes",
                                                         "peak_memory_kind")}
                if "dense_p50_ms" in lat:  # dense timed beside this setting, same process
                    row["latency"][n]["dense_p50_ms"] = lat["dense_p50_ms"]
                    row["latency"][n]["speedup"] = lat["dense_p50_ms"] / lat["p50_ms"]
        rows.append(row)
    recs = [_recommend(cfg, rows, n) for n in cfg.ns]
    noisy = sorted({(r["setting"], n) for r in rows for n, x in r["latency"].items()
                    if x["max_ms"] > NOISY * x["min_ms"]})
    config = _config_dict(cfg) | {"sequences": n_data if n_data is not None else cfg.size}
    if task is not None:
        config |= {"trained_length": task.max_length, "truncate": task.truncate}
    overall = _overall(cfg, rows)
    return {"config": config, "constraint": cfg.constraint.describe(),
            "metric": cfg.constraint.metric, "rows": rows, "noisy": [list(x) for x in noisy],
            "recommendations": recs, "overall": overall,
            "warnings": report_warnings(cfg, rows, recs, overall, task),
            "skipped": [list(u) for u in skipped]}


def recommended(rows: list[dict], recs: list[dict], overall: dict) -> list[dict]:
    """The rows of the settings recommended at some N or for the whole range, in grid
    order."""
    names = {x["setting"] for x in [*recs, overall] if x.get("setting")}
    return [r for r in rows[1:] if r["setting"] in names]


def report_warnings(cfg: AdviseConfig, rows: list[dict], recs: list[dict], overall: dict,
             task: Task | None = None) -> list[str]:
    """What a reader must not miss: timings at an N longer than the trained length (the
    served model cuts such a sequence, so the service never runs that forward), and
    ``mita.tools.scores.score_warnings`` on dense's predictions and on each recommended setting's,
    each prefixed with the setting's name."""
    out = []
    if task is not None and task.max_length is not None:
        longer = [n for n in cfg.ns if n > task.max_length]
        if longer:
            kept = "first" if task.truncate == "tail" else "last"
            out.append(f"N = {', '.join(map(str, longer))}: longer than the checkpoint's trained "
                       f"length {task.max_length}; the served model cuts a sequence to its "
                       f"{kept} {task.max_length} tokens (truncate {task.truncate}), so the "
                       f"timings at {'this N' if len(longer) == 1 else 'these N'} measure a "
                       "forward the service never runs")
    what = "generated" if cfg.data == "generated" else cfg.data
    for row in [rows[0], *recommended(rows, recs, overall)]:
        if "scores" in row:
            out += [f"{row['setting']}: {w}" for w in score_warnings(row["scores"], what)]
    return out


def _eligible(cfg: AdviseConfig, rows: list[dict]) -> tuple[dict | None, list[dict]]:
    dense = rows[0] if "accuracy" in rows[0] else None
    if dense is None:
        return None, []
    return dense, [r for r in rows[1:] if "accuracy" in r and cfg.constraint.met(r, dense)]


def _recommend(cfg: AdviseConfig, rows: list[dict], n: int) -> dict:
    dense, ok = _eligible(cfg, rows)
    timed = [r for r in ok if n in r["latency"] and "speedup" in r["latency"][n]]
    faster = [r for r in timed if r["latency"][n]["speedup"] > 1]
    if timed and not faster:
        best = max(timed, key=lambda r: r["latency"][n]["speedup"])
        return {"n": n, "setting": None,
                "answer": f"N = {n}: dense is faster — MiTA does not pay off here (the fastest "
                          f"setting meeting {cfg.constraint.describe()}, {best['setting']}, "
                          f"runs at {best['latency'][n]['speedup']:.2f}× dense's speed)"}
    timed = faster
    if not timed:
        measured = [r for r in rows[1:] if "agreement" in r]
        best = (min(measured, key=lambda r: cfg.constraint.shortfall(r, dense), default=None)
                if dense else None)
        metric = cfg.constraint.metric
        name, key = METRIC_NAMES[metric], drop_keys(metric)[0]
        if best is None:
            why = "no setting finished"
        elif cfg.constraint.kind == "agreement":
            why = (f"best agreement {100 * best['agreement']:.1f} %, {name} drop "
                   f"{best[key]:.1f} points ({best['setting']})")
        else:
            why = (f"smallest {name} drop {best[key]:g} points, agreement "
                   f"{100 * best['agreement']:.1f} % ({best['setting']})")
        if ok and not timed:
            why = f"{len(ok)} setting(s) meet it but none was timed at N = {n} within the budget"
        return {"n": n, "setting": None,
                "answer": f"no setting meets {cfg.constraint.describe()} at N = {n} ({why})"}
    best = max(timed, key=lambda r: r["latency"][n]["speedup"])
    lat = best["latency"][n]
    retention = ("-" if best["retention"] is None else f"{100 * best['retention']:.1f} %")
    out = {"n": n, "setting": best["setting"], "p50_ms": lat["p50_ms"],
           "dense_p50_ms": lat["dense_p50_ms"], "speedup": lat["speedup"],
           "accuracy": best["accuracy"], "agreement": best["agreement"], "kl": best["kl"],
           "accuracy_drop_points": best["accuracy_drop_points"],
           "retention": best["retention"]}
    answer = (f"N = {n}: {best['setting']} — {lat['speedup']:.2f}× dense's speed "
              f"({lat['p50_ms']:.1f} ms vs {lat['dense_p50_ms']:.1f} ms, timed side "
              f"by side), agreement {100 * best['agreement']:.1f} %, accuracy "
              f"{100 * best['accuracy']:.1f} % (dense {100 * dense['accuracy']:.1f} %, "
              f"retention {retention})")
    metric = cfg.constraint.metric
    if metric != "accuracy":  # the score the constraint read, and its drop
        drop, se = drop_keys(metric)
        out |= {metric: best[metric], drop: best[drop], se: best[se]}
        answer += (f", {METRIC_NAMES[metric]} {_score(metric, best[metric])} (dense "
                   f"{_score(metric, dense[metric])}, drop {best[drop]:+.1f} ± {best[se]:.1f} "
                   "points)")
    return out | {"answer": answer}


def _score(metric: str, x: float) -> str:
    """A score as the report prints it: macro-F1 as a fraction (0.712), the others in %."""
    return f"{x:.3f}" if metric == "macro_f1" else f"{100 * x:.1f} %"


def _overall(cfg: AdviseConfig, rows: list[dict]) -> dict:
    """One setting for every N: among those meeting the constraint and timed at every N, the
    lowest geometric mean of MiTA/dense time over the N values."""
    dense, ok = _eligible(cfg, rows)
    full = [r for r in ok if all(n in r["latency"] and r["latency"][n].get("speedup", 0) > 1
                                 for n in cfg.ns)]
    if not full:
        return {"setting": None, "answer": f"no setting meets {cfg.constraint.describe()} and "
                                           f"beats dense at every N in {cfg.ns}"}
    best = min(full, key=lambda r: sum(-math.log(r["latency"][n]["speedup"]) for n in cfg.ns))
    snippet = serve_snippet(best, cfg.checkpoint)
    return {"setting": best["setting"], "snippet": snippet,
            "speedups": {n: best["latency"][n]["speedup"] for n in cfg.ns},
            "answer": f"for N in {cfg.ns}: {best['setting']}"}


def _config_dict(cfg: AdviseConfig) -> dict:
    d = asdict(cfg)
    d["out"] = str(cfg.out)
    d["grid"] = [s.name for s in cfg.grid]
    d["constraint"] = cfg.constraint.describe()
    d["metric"] = cfg.constraint.metric
    return d
