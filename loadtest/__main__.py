"""``python -m loadtest run …``: load-test the running service at several N (loopback only),
with generated ListOps or the rows of your own labelled file (``--data``)."""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

from mita.data.labelled import read_file
from mita.tools.argtypes import NONNEGATIVE_INT, POSITIVE_FLOAT, POSITIVE_INT, Parser, bounded

from .engine import LoadConfig, check_loopback, fetch_models, run_load, summarize
from .inputs import GENERATED, build, error_gate, input_unit, refusal, warnings
from .report import markdown, write


def main(argv: list[str] | None = None) -> dict:
    """Run the load test, write its report and return its summary. Exits 2 (argparse) on a
    bad flag, a target it cannot load-test (not loopback, not answering ``/v1/models``, or not
    taking these sequences: ``loadtest.inputs.refusal``) before sending any classify request;
    exits 1 after writing the report when the run's error share exceeds
    ``--max-error-rate``."""
    p = Parser(prog="python -m loadtest")
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                       help="drive the HTTP API and write a report")
    r.add_argument("--url", default="http://127.0.0.1:8000",
                   help="the service, with its application's route prefix (e.g. …:8000/own)")
    r.add_argument("--n", type=bounded(int, 1, 1_048_576), nargs="+", default=[1024, 4096, 16384],
                   help="sequence lengths (at most the gateway's max_n; with --data text rows "
                        "for a sentencepiece model: characters)")
    r.add_argument("--data", type=Path, default=None, metavar="FILE",
                   help="send the rows of this labelled file (.tsv/.txt label<TAB>text lines, "
                        ".jsonl with 'text' or 'ids' and 'label'), joined and cut to each N, "
                        "instead of generated ListOps")
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
    r.add_argument("--max-error-rate", type=bounded(float, 0.0, 1.0), default=0.0, metavar="R",
                   help="exit 1 (after writing the report) when more than this share of the "
                        "timed requests is not answered 200: 429/503 refusals and transport "
                        "errors count")
    r.add_argument("--out", type=Path, default=Path("runs/loadtest"))
    a = p.parse_args(argv)
    cfg = LoadConfig(url=a.url, ns=a.n, variants=a.variants, mode=a.mode,
                     concurrency=a.concurrency, rate=a.rate, requests=a.requests,
                     warmup=a.warmup, duration_s=a.duration_s, timeout_s=a.timeout_s,
                     seed=a.seed)
    try:
        check_loopback(cfg.url)
        data = read_file(a.data) if a.data is not None else None
        a.out.mkdir(parents=True, exist_ok=True)  # a bad --out fails now, not after the load
        # What the target takes, asked before anything is sent: a checkpoint of another task
        # answered every generated ListOps request with 422 (or classified them as noise).
        models = fetch_models(cfg.url, min(cfg.timeout_s, 30.0))
        why = refusal(models, cfg.ns, data)
        if why is not None:
            p.error(why)
        unit = input_unit(models, data)
        payloads, source = (None, GENERATED) if data is None else build(
            data, cfg.ns, cfg.sequences_per_n, unit)
        notes = warnings(models, cfg.ns, unit)
        for note in notes:
            print(f"warning: {note}", file=sys.stderr)
        samples = asyncio.run(run_load(cfg, payloads))
    except (OSError, ValueError) as e:
        p.error(str(e))
    task = models["task"]
    failed = error_gate(samples, a.max_error_rate)
    summary = summarize(samples, cfg) | {
        "input": source, "warnings": notes,
        "target": {"name": task["name"], "tokenizer": task["tokenizer"]["kind"],
                   "max_length": task.get("max_length"), "grid": task.get("grid"),
                   "max_n": (models.get("ab_policy") or {}).get("max_n")},
        "error_budget": {"max_error_rate": a.max_error_rate, "sent": len(samples),
                         "failed": sum(s.status != 200 for s in samples),
                         "passed": failed is None}}
    files = write(summary, samples, a.out)
    print(markdown(summary))
    print("wrote " + ", ".join(str(f) for f in files.values()))
    if failed is not None:
        print(f"python -m loadtest: error: {failed}; see {files['md']}", file=sys.stderr)
        raise SystemExit(1)
    return summary


if __name__ == "__main__":
    main()
