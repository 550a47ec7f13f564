"""Offline cost sweep: per-stage time of the classifier vs N for MiTA and dense attention.

Model: random weights (the cost does not depend on training), default 3 layers × dim 128 as
the paper's Fig. 5; input: random ListOps token ids, no padding. For each N, variant and (m, k)
setting: ``warmup`` untimed forwards, then ``repeats`` profiled forwards; medians are reported.
A point whose predicted time (the variant's previous point scaled by analytic FLOPs) exceeds
the per-point budget is skipped with a message instead of hanging.

Settings: ``fig5`` takes m = k = the power of two nearest √(N/4), so m·k ≈ N/4 as in Fig. 5;
``MxK`` (e.g. ``64x64``) fixes m and k.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from mita.config import clamp_topk, parse_setting
from mita.cost import fig5_setting, model_stage_flops
from mita.hooks import MITA_STAGES, stage_sorted
from mita.model import EncoderClassifier, ModelConfig, set_mita_backend
from mita.timer import profile_forward
from mita.tools.plots import figure, save, stage_lines, write_csv
from mita.tools.progress import Progress
from service.engine import pick_device


def landmarks_for(n: int, setting: str) -> tuple[int, int]:
    """(m, k) for sequence length n under ``fig5`` (``mita.cost.fig5_setting``) or ``MxK``
    (``mita.config.parse_setting``; s comes from ``--route-topk``). Raises ValueError."""
    if setting == "fig5":
        return fig5_setting(n)
    m, k, _ = parse_setting(setting, route_topk=False, forms="'fig5' or MxK (e.g. 32x128)")
    return m, k


@dataclass
class SweepConfig:
    ns: list[int]
    variants: list[str]
    settings: list[str]
    depth: int = 3
    dim: int = 128
    num_heads: int = 2
    ffn_dim: int = 256
    route_topk: int = 1
    batch: int = 1
    device: str = "cpu"
    dtype: str = "float32"
    warmup: int = 1
    repeats: int = 3
    budget_s: float = 60.0
    seed: int = 0
    mita_backend: str = "auto"  # "torch": every stage apart; "cpu"/"triton": fused kernels

    def __post_init__(self):
        """Refuse (ValueError) what would fail only at the first point: a setting that is
        neither fig5 nor MxK, a device torch cannot use here, model sizes ModelConfig
        refuses."""
        for n in self.ns:
            for variant in self.variants:
                for setting in self.settings if variant == "mita" else ["-"]:
                    self.model_config(n, variant, setting)
        device = pick_device(self.device, "the sweep", auto=False)
        if self.mita_backend == "triton" and device.type != "cuda":
            raise ValueError("mita_backend 'triton' needs a CUDA device")

    def model_config(self, n: int, variant: str, setting: str) -> tuple[ModelConfig, int, int]:
        """The model of one point and its (m, k) ((0, 0) for dense). Raises ValueError as
        ``landmarks_for`` and ``ModelConfig``."""
        m, k = landmarks_for(n, setting) if variant == "mita" else (0, 0)
        cfg = ModelConfig(dim=self.dim, depth=self.depth, num_heads=self.num_heads,
                          ffn_dim=self.ffn_dim, attention=variant,
                          num_landmarks=max(m, self.route_topk), topk=max(k, 1),
                          route_topk=self.route_topk)
        return cfg, m, k


def _run_point(model: EncoderClassifier, ids: torch.Tensor, warmup: int, repeats: int,
               budget_s: float) -> dict:
    start = time.perf_counter()
    with torch.no_grad():
        for _ in range(warmup):
            model(ids)
    profiles = []
    for _ in range(repeats):
        profiles.append(profile_forward(model, ids)[1])
        if time.perf_counter() - start > budget_s:
            break
    stage_names = list(profiles[0].stages_ms)
    return {
        "e2e_ms": float(np.median([p.total_ms for p in profiles])),
        "stages_ms": {s: float(np.median([p.stages_ms[s] for p in profiles]))
                      for s in stage_names},
        "repeats_done": len(profiles),
        "peak_memory_bytes": profiles[0].peak_memory_bytes,
        "peak_memory_kind": profiles[0].peak_memory_kind,
    }


def run_sweep(cfg: SweepConfig) -> list[dict]:
    """Measure every (N, variant, setting) point; returns one row per point (``status`` is
    ``ok`` or ``skipped: …``)."""
    rows: list[dict] = []
    last: dict[tuple[str, str], tuple[int, float]] = {}  # (variant, setting) → (flops, s)
    jobs = [(n, v, st) for n in sorted(cfg.ns) for v in cfg.variants
            for st in (cfg.settings if v == "mita" else ["-"])]
    with Progress(len(jobs), "sweep", "point") as bar:
        for n, variant, setting in jobs:
            bar.phase(f"N={n} {variant} {setting}")
            rows.append(_point(cfg, n, variant, setting, last))
            bar.update()
            r = rows[-1]
            if r["status"] != "ok":
                bar.write(f"N={n} {variant} {setting}: {r['status']}")
            else:
                bar.phase_done(f"N={n} {variant} {setting}: forward {r['e2e_ms']:.1f} ms")
    return rows


def _point(cfg: SweepConfig, n: int, variant: str, setting: str,
           last: dict[tuple[str, str], tuple[int, float]]) -> dict:
    """One (N, variant, setting) row of ``run_sweep``; ``last`` (the previous point's flops and
    seconds per (variant, setting)) predicts whether it fits the budget, and is updated."""
    dtype = getattr(torch, cfg.dtype)
    model_cfg, m, k = cfg.model_config(n, variant, setting)
    flops = model_stage_flops(model_cfg, cfg.batch, n)
    total_flops = sum(flops.values())
    row = {"n": n, "variant": variant, "setting": setting, "m": m, "k": k,
           "s": cfg.route_topk if variant == "mita" else 0, "batch": cfg.batch,
           "depth": cfg.depth, "dim": cfg.dim, "heads": cfg.num_heads, "dtype": cfg.dtype,
           "device": cfg.device, "flops": total_flops, "stage_flops": flops,
           "mita_backend": cfg.mita_backend if variant == "mita" else "-"}
    prev = last.get((variant, setting))
    if prev is not None:
        predicted = prev[1] * total_flops / prev[0] * (cfg.warmup + 1)
        if predicted > cfg.budget_s:
            row["status"] = (f"skipped: predicted {predicted:.0f} s for warm-up + one "
                             f"forward exceeds the {cfg.budget_s:.0f} s budget")
            return row
    torch.manual_seed(cfg.seed)
    model = EncoderClassifier(model_cfg).to(device=cfg.device, dtype=dtype).eval()
    set_mita_backend(model, cfg.mita_backend)
    g = torch.Generator().manual_seed(cfg.seed + n)
    ids = torch.randint(1, model_cfg.vocab_size, (cfg.batch, n), generator=g).to(cfg.device)
    row.update(_run_point(model, ids, cfg.warmup, cfg.repeats, cfg.budget_s))
    row["status"] = "ok"
    row["gflops_per_s"] = total_flops / (row["e2e_ms"] * 1e6)
    last[(variant, setting)] = (total_flops, row["e2e_ms"] / 1e3)
    return row


def attention_ms(row: dict) -> float:
    """Time of the attention proper: dense's SDPA stage or the sum of MiTA's seven stages."""
    return sum(row["stages_ms"].get(s, 0.0) for s in MITA_STAGES)


def speedups(rows: list[dict]) -> list[dict]:
    """MiTA/dense ratios at each N where both ran: whole forward and attention only, next to
    the pair-count limit N/(2m + sk)."""
    dense = {r["n"]: r for r in rows if r["variant"] == "dense" and r["status"] == "ok"}
    out = []
    for r in rows:
        if r["variant"] != "mita" or r["status"] != "ok" or r["n"] not in dense:
            continue
        d = dense[r["n"]]
        out.append({"n": r["n"], "setting": r["setting"], "m": r["m"], "k": r["k"], "s": r["s"],
                    "e2e_speedup": d["e2e_ms"] / r["e2e_ms"],
                    "attention_speedup": attention_ms(d) / attention_ms(r),
                    "flop_limit": r["n"] / (2 * r["m"] + r["s"] * clamp_topk(r["k"], r["n"]))})
    return out


def markdown(rows: list[dict]) -> str:
    lines = ["| N | variant | m | k | s | forward ms | attention ms | GFLOP/s | peak bytes "
             "(kind) | status |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["status"] == "ok":
            mem = f"{r['peak_memory_bytes'] / 2**20:.0f} MiB ({r['peak_memory_kind']})"
            lines.append(f"| {r['n']} | {r['variant']} | {r['m']} | {r['k']} | {r['s']} | "
                         f"{r['e2e_ms']:.1f} | {attention_ms(r):.1f} | "
                         f"{r['gflops_per_s']:.1f} | {mem} | ok |")
        else:
            lines.append(f"| {r['n']} | {r['variant']} | {r['m']} | {r['k']} | {r['s']} | - | "
                         f"- | - | - | {r['status']} |")
    sp = speedups(rows)
    if sp:
        lines += ["", "| N | setting | m | k | s | MiTA/dense forward speed-up | attention "
                  "speed-up | FLOP limit N/(2m+sk) |", "|---|---|---|---|---|---|---|---|"]
        lines += [f"| {x['n']} | {x['setting']} | {x['m']} | {x['k']} | {x['s']} | "
                  f"{x['e2e_speedup']:.2f}× | {x['attention_speedup']:.2f}× | "
                  f"{x['flop_limit']:.1f}× |" for x in sp]
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], out: Path) -> list[Path]:
    """Three PNGs: per-stage time vs N per variant/setting (``plots.stage_lines``); MiTA/dense
    speed-up vs N with the FLOP-limit line; measured time vs analytic FLOPs (log-log, fitted
    slope)."""
    ok = [r for r in rows if r["status"] == "ok"]
    groups = sorted({(r["variant"], r["setting"]) for r in ok})
    panels = {f"{v} {setting}".strip(" -"): [(r["n"], r["stages_ms"]) for r in ok
                                             if (r["variant"], r["setting"]) == (v, setting)]
              for v, setting in groups}
    paths = [stage_lines(panels, out / "stages.png", "ms per forward")] if panels else []

    sp = speedups(rows)
    fig = figure(figsize=(6, 4.5))
    ax = fig.subplots()
    for setting in sorted({x["setting"] for x in sp}):
        sel = sorted((x for x in sp if x["setting"] == setting), key=lambda x: x["n"])
        ns = [x["n"] for x in sel]
        (line,) = ax.plot(ns, [x["e2e_speedup"] for x in sel], "o-", label=f"{setting}: forward")
        color = line.get_color()
        ax.plot(ns, [x["attention_speedup"] for x in sel], "s:", color=color,
                label=f"{setting}: attention")
        ax.plot(ns, [x["flop_limit"] for x in sel], "--", color=color,
                label=f"{setting}: N/(2m+sk)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("N")
    ax.set_ylabel("MiTA / dense speed-up")
    ax.legend(fontsize=7)
    paths.append(save(fig, out / "speedup.png"))

    fig = figure(figsize=(6, 4.5))
    ax = fig.subplots()
    for variant, setting in groups:
        sel = sorted((r for r in ok if (r["variant"], r["setting"]) == (variant, setting)),
                     key=lambda r: r["n"])
        f = np.array([r["flops"] for r in sel], dtype=float)
        t = np.array([r["e2e_ms"] for r in sel])
        label = f"{variant} {setting}".strip(" -")
        if len(sel) >= 2:
            slope = np.polyfit(np.log(f), np.log(t), 1)[0]
            label += f" (slope {slope:.2f})"
        ax.plot(f, t, "o-", label=label)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("analytic FLOPs per forward")
    ax.set_ylabel("measured ms per forward")
    ax.legend(fontsize=7)
    paths.append(save(fig, out / "time_vs_flops.png"))
    return paths


def write_outputs(rows: list[dict], cfg: SweepConfig, out: Path) -> dict[str, Path]:
    """Write ``sweep.json``, ``sweep.csv``, ``sweep.md`` and the PNGs into ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    files = {"json": out / "sweep.json", "csv": out / "sweep.csv", "md": out / "sweep.md"}
    files["json"].write_text(json.dumps({"config": cfg.__dict__, "rows": rows,
                                         "speedups": speedups(rows)}, indent=2) + "\n")
    stages = stage_sorted(s for r in rows for s in r.get("stages_ms", {}))
    cols = ["n", "variant", "setting", "m", "k", "s", "batch", "depth", "dim", "heads", "dtype",
            "device", "status", "e2e_ms", "flops", "gflops_per_s", "peak_memory_bytes",
            "peak_memory_kind"]
    write_csv(files["csv"], cols + [f"{s}_ms" for s in stages],
              ([r.get(c) for c in cols] + [r.get("stages_ms", {}).get(s) for s in stages]
               for r in rows))
    header = (f"Sweep: depth {cfg.depth}, dim {cfg.dim}, heads {cfg.num_heads}, batch "
              f"{cfg.batch}, s {cfg.route_topk}, {cfg.dtype}, {cfg.device}, warm-up "
              f"{cfg.warmup}, median of {cfg.repeats}, torch {torch.__version__}\n\n")
    files["md"].write_text(header + markdown(rows))
    for i, p in enumerate(plot(rows, out)):
        files[f"png{i}"] = p
    return files
