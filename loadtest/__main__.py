"""``python -m loadtest run …``: load-test the running service at several N (loopback only)."""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

from mita.argtypes import NONNEGATIVE_INT, POSITIVE_FLOAT, POSITIVE_INT, Parser, bounded

from .engine import LoadConfig, check_loopback, run_load, summarize
from .report import markdown, write


def main(argv: list[str] | None = None) -> dict:
    p = Parser(prog="python -m loadtest")
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                       help="drive the HTTP API and write a report")
    r.add_argument("--url", default="http://127.0.0.1:8000")
    r.add_argument("--n", type=bounded(int, 1, 1_048_576), nargs="+", default=[1024, 4096, 16384],
                   help="sequence lengths (at most the gateway's largest max_n, 1,048,576)")
    r.add_argument("--variants", nargs="+", choices=["mita", "dense", "ab"],
                   default=["mita", "dense"], help="'ab' leaves the choice to the A/B policy")
    r.add_argument("--mode", choices=["closed", "open"], default="closed")
    r.add_argument("--concurrency", type=POSITIVE_INT, default=4, help="closed loop")
    r.add_argument("--rate", type=POSITIVE_FLOAT, default=5.0,
                   help="open loop, requests/s (Poisson)")
    r.add_argument("--requests", type=POSITIVE_INT, default=50, help="timed requests per phase")
    r.add_argument("--warmup", type=NONNEGATIVE_INT, default=3)
    r.add_argument("--duration-s", type=POSITIVE_FLOAT, default=120.0,
                   help="wall-time cap per phase")
    r.add_argument("--timeout-s", type=POSITIVE_FLOAT, default=300.0)
    r.add_argument("--seed", type=NONNEGATIVE_INT, default=0)
    r.add_argument("--out", type=Path, default=Path("runs/loadtest"))
    a = p.parse_args(argv)
    cfg = LoadConfig(url=a.url, ns=a.n, variants=a.variants, mode=a.mode,
                     concurrency=a.concurrency, rate=a.rate, requests=a.requests,
                     warmup=a.warmup, duration_s=a.duration_s, timeout_s=a.timeout_s,
                     seed=a.seed)
    try:
        check_loopback(cfg.url)
        a.out.mkdir(parents=True, exist_ok=True)  # a bad --out fails now, not after the load
        samples = asyncio.run(run_load(cfg))
    except (OSError, ValueError) as e:
        p.error(str(e))
    summary = summarize(samples, cfg)
    files = write(summary, samples, a.out)
    print(markdown(summary))
    print("wrote " + ", ".join(str(f) for f in files.values()))
    return summary


if __name__ == "__main__":
    main()
