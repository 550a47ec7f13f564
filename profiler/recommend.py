"""The advisor's answer from its finished units (``profiler.advise``): a row per setting —
quality, and latency per N with the speed-up over dense timed side by side — and the
recommendation at each N and over the whole range under the user's constraint."""

from __future__ import annotations

import math
from dataclasses import asdict
from typing import TYPE_CHECKING

from .advise_report import NOISY, serve_snippet

if TYPE_CHECKING:
    from .advise import AdviseConfig


# Accuracies and agreements are k / n for n sequences (n far below 10⁹): rounding at 9 digits
# removes float noise of a subtraction and can never merge two distinct values.
DROP_DIGITS = 9


def drop_points(dense: dict, row: dict) -> float:
    """Dense's accuracy minus ``row``'s, in points (100 × the fraction difference), rounded at
    ``DROP_DIGITS``: exact for accuracies that are counts over the same sequences."""
    return round(100 * (dense["accuracy"] - row["accuracy"]), DROP_DIGITS) + 0.0


def report(cfg: AdviseConfig, done: dict, skipped: list, n_data: int | None = None) -> dict:
    """Rows per setting (quality and per-N latency, speed-up over dense measured side by side),
    the recommendation at each N and for the whole range, from the finished units;
    ``n_data``: the sequences actually used (a file may hold fewer than ``size``)."""
    dense = done.get(("quality", "dense"))
    rows = []
    for name, setting in [("dense", None)] + [(s.name, s) for s in cfg.grid]:
        q = done.get(("quality", name))
        row = {"setting": name, **(asdict(setting) if setting else {"m": None, "k": None,
                                                                    "s": None,
                                                                    "shared_scale": None})}
        if q is not None:
            row |= {k: q[k] for k in ("accuracy", "agreement", "kl", "drop_se_points")}
            if dense is not None:
                row["retention"] = (q["accuracy"] / dense["accuracy"] if dense["accuracy"]
                                    else None)
                row["accuracy_drop_points"] = drop_points(dense, q)
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
    return {"config": config, "constraint": cfg.constraint.describe(), "rows": rows,
            "noisy": [list(x) for x in noisy],
            "recommendations": recs, "overall": _overall(cfg, rows),
            "skipped": [list(u) for u in skipped]}


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
        if best is None:
            why = "no setting finished"
        elif cfg.constraint.kind == "agreement":
            why = (f"best agreement {100 * best['agreement']:.1f} %, accuracy drop "
                   f"{best['accuracy_drop_points']:.1f} points ({best['setting']})")
        else:
            why = (f"smallest accuracy drop {best['accuracy_drop_points']:g} points, agreement "
                   f"{100 * best['agreement']:.1f} % ({best['setting']})")
        if ok and not timed:
            why = f"{len(ok)} setting(s) meet it but none was timed at N = {n} within the budget"
        return {"n": n, "setting": None,
                "answer": f"no setting meets {cfg.constraint.describe()} at N = {n} ({why})"}
    best = max(timed, key=lambda r: r["latency"][n]["speedup"])
    lat = best["latency"][n]
    retention = ("-" if best["retention"] is None else f"{100 * best['retention']:.1f} %")
    return {"n": n, "setting": best["setting"], "p50_ms": lat["p50_ms"],
            "dense_p50_ms": lat["dense_p50_ms"], "speedup": lat["speedup"],
            "accuracy": best["accuracy"], "agreement": best["agreement"], "kl": best["kl"],
            "accuracy_drop_points": best["accuracy_drop_points"],
            "retention": best["retention"],
            "answer": (f"N = {n}: {best['setting']} — {lat['speedup']:.2f}× dense's speed "
                       f"({lat['p50_ms']:.1f} ms vs {lat['dense_p50_ms']:.1f} ms, timed side "
                       f"by side), agreement {100 * best['agreement']:.1f} %, accuracy "
                       f"{100 * best['accuracy']:.1f} % (dense {100 * dense['accuracy']:.1f} %, "
                       f"retention {retention})")}


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
    return d
