"""Real Prometheus (Debian's 2.42) scraping the real service under a real load-test run.

Every expression of the Grafana dashboard and of the recording rules must answer with a
non-empty result, and the load tester's report must match numpy over its own raw samples.
"""

from __future__ import annotations

import asyncio
import csv
import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import yaml

from loadtest.engine import LoadConfig, check_loopback, run_load, summarize
from loadtest.report import write

from .conftest import free_port, set_gateway, wait_for

ROOT = Path(__file__).resolve().parent.parent
PROM_DIR = ROOT / "deploy" / "prometheus"
DASHBOARD = ROOT / "deploy" / "grafana" / "mita-serve-dashboard.json"

pytestmark = pytest.mark.service
_required = os.environ.get("MITA_SERVE_REQUIRE_PROMETHEUS") == "1"


@pytest.fixture(scope="module")
def prometheus(service, tmp_path_factory):
    binary = shutil.which("prometheus")
    if binary is None:
        if _required:
            pytest.fail("prometheus is not installed but MITA_SERVE_REQUIRE_PROMETHEUS=1")
        pytest.skip("prometheus not installed (.ci/run installs Debian's package)")
    port = free_port()
    data = tmp_path_factory.mktemp("prometheus")
    proc = subprocess.Popen(
        [binary, f"--config.file={PROM_DIR / 'prometheus.yml'}",
         f"--storage.tsdb.path={data}", f"--web.listen-address=127.0.0.1:{port}"],
        stdout=subprocess.DEVNULL, stderr=open(data / "prometheus.log", "w"))
    url = f"http://127.0.0.1:{port}"

    def ready():
        try:
            return httpx.get(f"{url}/-/ready", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False
    try:
        assert wait_for(ready, 30), (data / "prometheus.log").read_text()[-2000:]
        yield url
    finally:
        proc.terminate()
        proc.wait(10)


def query(url: str, expr: str) -> list:
    r = httpx.get(f"{url}/api/v1/query", params={"query": expr}, timeout=10)
    r.raise_for_status()
    return r.json()["data"]["result"]


def dashboard_exprs() -> list[str]:
    dash = json.loads(DASHBOARD.read_text())
    return [t["expr"].replace("$n_bucket", ".+") for p in dash["panels"] for t in p["targets"]]


def rule_exprs() -> list[str]:
    rules = yaml.safe_load((PROM_DIR / "rules.yml").read_text())["groups"][0]["rules"]
    return [r["expr"] for r in rules] + [r["record"] for r in rules]


def test_load_then_every_dashboard_and_rule_expression_answers(service, prometheus, tmp_path):
    cfg = LoadConfig(url=service.url, ns=[256, 2048], variants=["mita", "dense"],
                     concurrency=2, requests=10, warmup=1, duration_s=60)
    samples = []
    # Two rounds with a pause, so counters rise across several scrapes (5 s interval) and
    # rate()-based quantiles are numbers, not NaN.
    for _ in range(2):
        samples += asyncio.run(run_load(cfg))
        time.sleep(6)
    set_gateway(service, shadow=True)
    for text in ("[MAX 2 [MIN 4 7 ] 0 ]", "[SM 1 2 [MED 3 4 5 ] ]", "[MIN 9 [MAX 1 2 ] ]"):
        assert service.client.post("/v1/classify", json={"text": text}).status_code == 200
        time.sleep(2)
    for bad in ({"ids": [99]}, {"text": ""}):
        assert service.client.post("/v1/classify", json=bad).status_code == 422
    time.sleep(4)
    set_gateway(service, shadow=False)
    assert all(s.status == 200 for s in samples)

    def all_answer():
        missing = [e for e in dashboard_exprs() + rule_exprs() if not query(prometheus, e)]
        return missing or None
    deadline = time.monotonic() + 60
    missing = all_answer()
    while missing and time.monotonic() < deadline:
        time.sleep(2)
        missing = all_answer()
    assert not missing, f"expressions with empty results: {missing}"

    # A stage quantile from a recording rule is a real number in a plausible range.
    values = [float(r["value"][1]) for r in query(
        prometheus, 'mita_serve:stage_duration_seconds:p50_1m{variant="mita", stage="topk"}')]
    assert any(1e-6 < v < 10 for v in values), values

    # The load tester's report: files exist and percentiles equal numpy on the raw samples.
    summary = summarize(samples, cfg)
    files = write(summary, samples, tmp_path)
    for f in files.values():
        assert f.stat().st_size > 0
    report = json.loads(files["json"].read_text())
    with open(files["csv"]) as f:
        assert len(list(csv.DictReader(f))) == len(samples) == 2 * 2 * 2 * 10
    for row in report["rows"]:
        lat = [s["latency_s"] * 1e3 for s in report["samples"]
               if s["n"] == row["n"] and s["requested"] == row["variant"]]
        assert len(lat) == 20
        for q in (50, 90, 99):
            assert row[f"p{q}_ms"] == pytest.approx(float(np.percentile(lat, q)), rel=1e-12)
        assert set(row["stages_ms"]) >= {"embed", "attention", "head"}
    assert {x["n"] for x in report["ratios"]} == {256, 2048}


def test_loadtest_refuses_non_loopback():
    check_loopback("http://127.0.0.1:8000")
    check_loopback("http://[::1]:8000")
    check_loopback("http://localhost:8000")
    for url in ("http://10.0.0.5:8000", "http://example.com", "http://192.168.1.2"):
        with pytest.raises(ValueError, match="only loopback"):
            check_loopback(url)
