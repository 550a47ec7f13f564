"""The advisor's recommendation, served: start the real service with the recommended
``mita_setting`` in the serve config, send labelled ListOps sequences to both variants over
HTTP, and compare accuracy, agreement and KL with what ``python -m profiler advise`` reported.

    .venv/bin/python benchmarks/advise_served.py [--advice benchmarks/advise-cpu/advise.json]
        [--seeds 1000003 7777777]

The advice's own seed redraws its sequences (the served numbers should equal the advice's);
another seed draws fresh ones (they should agree within the paired standard error).
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import numpy as np
import yaml

from mita.data.listops import ListOpsConfig, encode, generate
from mita.tools.argtypes import Parser
from profiler.advise import compare
from service import launch


def main() -> None:
    p = Parser()
    p.add_argument("--advice", type=Path, default=Path("benchmarks/advise-cpu/advise.json"))
    p.add_argument("--seeds", type=int, nargs="+", default=None,
                   help="data seeds (default: the advice's and 7777777)")
    p.add_argument("--port", type=int, default=8785)
    a = p.parse_args()
    advice = json.loads(a.advice.read_text())
    cfg = advice["config"]
    snippet = yaml.safe_load(advice["overall"]["snippet"])["args"]
    row = next(r for r in advice["rows"] if r["setting"] == advice["overall"]["setting"])
    seeds = a.seeds or [cfg["seed"], 7_777_777]
    serve_cfg = launch.load_config(launch.CPU_CONFIG, {
        "http_options": {"port": a.port},
        "args": {"device": "cpu", "checkpoint": snippet["checkpoint"],
                 "mita_setting": snippet["mita_setting"]}})
    url = launch.start(serve_cfg, metrics_port=a.port + 1)
    results = []
    try:
        with httpx.Client(base_url=url, timeout=120) as client:
            served = client.get("/v1/models").json()["variants"]["mita"]["config"]
            print("served MiTA setting:", {k: served[k] for k in snippet["mita_setting"]})
            for seed in seeds:
                data = [(encode(t), y) for t, y in generate(
                    cfg["size"], seed, ListOpsConfig(cfg["min_length"], cfg["max_length"]))]
                probs = {}
                for variant in ("dense", "mita"):
                    out = []
                    for ids, _ in data:
                        r = client.post("/v1/classify/binary", content=bytes(ids),
                                        params={"variant": variant},
                                        headers={"content-type": "application/octet-stream"})
                        r.raise_for_status()
                        out.append(r.json()["probabilities"])
                    probs[variant] = np.array(out)
                got = compare(probs["dense"], probs["mita"], np.array([y for _, y in data]))
                dense_acc = float((probs["dense"].argmax(1) == [y for _, y in data]).mean())
                results.append((seed, got, dense_acc))
                print(seed, got, "dense accuracy", dense_acc, flush=True)
    finally:
        launch.stop()
    print(f"\nSetting {row['setting']} served through args.mita_setting; {cfg['size']} generated "
          f"ListOps sequences per seed, {cfg['min_length']} < length < {cfg['max_length']}\n")
    print("| data | dense accuracy | MiTA accuracy | drop (± SE) points | agreement | KL |")
    print("|---|---|---|---|---|---|")
    dense_row = advice["rows"][0]
    print(f"| advised (seed {cfg['seed']}) | {100 * dense_row['accuracy']:.1f} % | "
          f"{100 * row['accuracy']:.1f} % | {row['accuracy_drop_points']:+.1f} ± "
          f"{row['drop_se_points']:.1f} | {100 * row['agreement']:.1f} % | {row['kl']:.4f} |")
    for seed, got, dense_acc in results:
        print(f"| served, seed {seed} | {100 * dense_acc:.1f} % | {100 * got['accuracy']:.1f} % "
              f"| {100 * (dense_acc - got['accuracy']):+.1f} ± {got['drop_se_points']:.1f} | "
              f"{100 * got['agreement']:.1f} % | {got['kl']:.4f} |")


if __name__ == "__main__":
    main()
