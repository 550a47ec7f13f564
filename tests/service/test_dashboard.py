"""The live dashboard's page in real Chromium: against the running service, with fixed
/v1/stats data and no service, and the README's screenshot command.

The browser tests drive Debian's ``chromium`` through its ``chromedriver`` (selenium); they are
skipped where they are missing unless MITA_SERVE_REQUIRE_CHROMIUM=1 (``.ci/run`` sets it and
installs them). The screenshot goes to ``test-artifacts/dashboard.png``.
"""

from __future__ import annotations

import base64
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from mita.data.listops import generate_long
from mita.hooks import STAGE_COLORS, STAGE_ORDER, VARIANT_COLORS

from .. import pages
from ..helpers import (
    CHROMIUM_REQUIRED,
    DENSE_STAGES,
    EXAMPLES,
    set_gateway,
    texts,
    wait_for,
)

ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = ROOT / "test-artifacts"




# ---- the page in a real browser ------------------------------------------------------------







# sharing: answers, counts and refusals, nothing timed: runs beside the tests/own_ray/
# tests instead of waiting for the cores lock (tests/lanes.py)
pytestmark = pytest.mark.sharing


def test_dashboard_page_in_chromium(service, browser, serve_reset):
    """After requests of both variants in two N buckets with shadow on, the page draws every
    stage of both variants with non-zero p50, the latency/throughput lines, the ratio bars,
    the shadow rate and m/k/s; no console errors; full-page screenshot saved."""
    long_text, _ = generate_long(3000, seed=12)
    set_gateway(service, shadow=True)

    def comparisons() -> int:
        return service.client.get("/v1/stats").json()["shadow"]["comparisons"]
    # One request at a time, its shadow compared before the next: the gateway sheds a shadow
    # while shadow_max_inflight (2) of that variant still run, and back-to-back requests'
    # shadows (the long text's at N = 3,000) got there on a loaded 2-core machine (two
    # clean-clone runs: fewer than 8 comparisons, none left running).
    start, sent = comparisons(), 0
    for variant in ("mita", "dense"):
        for text in [t for t, _ in EXAMPLES[:3]] + [long_text]:
            r = service.post("/v1/classify", json={"text": text, "variant": variant})
            assert r.status_code == 200, r.text
            sent += 1
            assert wait_for(lambda want=start + sent: comparisons() >= want), (
                f"request {sent}'s shadow was not compared: {comparisons() - start} of {sent}")

    browser.get(f"{service.url}/dashboard")

    def drawn():
        bars = browser.execute_script(
            "return [...document.querySelectorAll('#stages g.bar')].map(g => "
            "[g.dataset.variant, g.dataset.stage, +g.dataset.p50, g.closest('svg')"
            ".dataset.bucket])")
        return bars if {b[0] for b in bars} == {"mita", "dense"} else None
    bars = wait_for(drawn, 30)
    assert bars, browser.find_element("tag name", "body").text[:2000]
    page_text, ab_text, shadow_text = texts(browser, "body", "#ab", "#shadow")
    models_rows = browser.execute_script(
        "return [...document.querySelectorAll('#models tr[data-variant]')].map(r => "
        "[...r.cells].map(c => c.textContent))")
    series = browser.execute_script(
        "return [...document.querySelectorAll('path.series')].map(p => "
        "[p.closest('svg').id || p.closest('svg').dataset.bucket, p.dataset.variant, "
        "p.dataset.key])")
    ratio = browser.execute_script(
        "return [...document.querySelectorAll('#ratio g.ratio')].map(g => "
        "[g.dataset.bucket, +g.dataset.ratio, g.dataset.likeForLike, g.textContent])")
    swatches = browser.execute_script(
        "return [...document.querySelectorAll('#stages rect.stage-swatch')].map(r => "
        "[r.dataset.stage, r.getAttribute('fill')])")
    t0s = browser.execute_script(
        "return [...document.querySelectorAll('#latency svg, #throughput-chart')].map(c => "
        "+c.dataset.t0)")
    timeline = service.client.get("/v1/stats").json()["timeline"]
    legend = browser.execute_script(
        "return [...document.querySelectorAll('#legend [data-variant]')].map(e => "
        "e.textContent)")
    ARTIFACTS.mkdir(exist_ok=True)
    width, height = browser.execute_script(
        "const e = document.documentElement; return [e.scrollWidth, e.scrollHeight]")
    shot = browser.execute_cdp_cmd("Page.captureScreenshot", {  # the whole page
        "format": "png", "captureBeyondViewport": True,
        "clip": {"x": 0, "y": 0, "width": width, "height": height, "scale": 1}})
    (ARTIFACTS / "dashboard.png").write_bytes(base64.b64decode(shot["data"]))
    # Prometheus-mode counts (increase() estimates) showed "106.6 of 143.2 labels agree"
    counts = browser.execute_script("return [fmtCount(106.6), fmtCount(143), fmtCount(0)]")
    # A bucket where only dense has stage timings (MiTA's forwards ran fused) says so.
    notes = browser.execute_script(
        "const row = {variant: 'dense', stage: 'attention', p50_ms: 5, p95_ms: 6, count: 5};"
        "const one = stageChart('le_16384', [row], ['attention']);"
        "const both = stageChart('le_16384', [row, {...row, variant: 'mita'}], "
        "['attention']);"
        "return [[...one.querySelectorAll('text.sub')].map(t => t.textContent), "
        "both.querySelectorAll('text.sub').length]")
    # 1 h offered, 300 s kept: the page said only "last 300 s"
    browser.get(f"{service.url}/dashboard?window_s=3600")
    capped = wait_for(lambda: (lambda t: t if "asked" in t else None)(
        texts(browser, "#updated")[0]), 30)
    logs = browser.get_log("browser")

    for bucket in ("le_1024", "le_4096"):
        for variant, stages in (("mita", list(STAGE_ORDER)), ("dense", DENSE_STAGES)):
            got = [b for b in bars if b[0] == variant and b[3] == bucket]
            assert [b[1] for b in got] == stages, (variant, bucket, got)
            assert all(b[2] > 0 for b in got), got
    for stage in STAGE_ORDER:
        assert stage in page_text
    assert legend == ["mita", "dense"]
    assert "configured: mita 50.0 % · dense 50.0 %" in ab_text and "shadow on" in ab_text
    assert shadow_text.split("\n")[0].endswith("%") and "labels agree" in shadow_text
    assert models_rows == [["mita", "16", "16", "1", "cpu", "float32"],
                           ["dense", "–", "–", "–", "cpu", "float32"]]
    # Request latency: one chart per N bucket served, both variants' p50 and p99 in each.
    for chart, key in (("le_1024", "p50_ms"), ("le_1024", "p99_ms"), ("le_4096", "p50_ms"),
                       ("le_4096", "p99_ms"), ("throughput-chart", "rps")):
        assert {v for c, v, k in series if c == chart and k == key} == {"mita", "dense"}
    # The same sequences went to both variants: every bucket compares like with like.
    assert {b for b, *_ in ratio} == {"le_1024", "le_4096"} and all(x > 0 for _, x, *_ in ratio)
    assert all(like == "true" for _, _, like, _ in ratio)
    assert any("–3,000" in text or "N = 3,000" in text for *_, text in ratio), ratio
    # Every stage's swatch in its one colour (mita.hooks.STAGE_COLORS), in forward order.
    assert {stage: fill for stage, fill in swatches} == {
        st: STAGE_COLORS[st] for st in STAGE_ORDER}
    assert [st for st, _ in swatches][:len(STAGE_ORDER)] == list(STAGE_ORDER)
    # Time axes start at the first answered request's bin, not at the window's start.
    first = min(p["t"] for p in timeline if p["requests"])
    assert len(t0s) >= 3 and set(t0s) == {first}, (t0s, first)
    assert counts == ["≈107", "143", "0"]
    assert notes == [["no mita stage timings in this bucket yet (staged forwards only)"], 0]
    assert capped.startswith("last 300 s (3600 s asked: the gateway keeps 300 s, its "
                             "stats_window_s; set prometheus_url for more)"), capped
    errors = [e for e in logs if e["level"] == "SEVERE"]
    assert not errors, errors




def readme_screenshot_command() -> str:
    """The README's dashboard screenshot command (a bash block's lines joined)."""
    for block in re.findall(r"```bash\n(.*?)```", pages.text(), re.S):
        command = " ".join(block.replace("\\\n", " ").split())
        if command.startswith("chromium "):
            return command
    raise AssertionError("the README shows no chromium screenshot command")


def test_readme_screenshot_command_draws_the_data(service, tmp_path):
    """Found by a user: the README's ``chromium --headless --screenshot`` captured the page
    before the first /v1/stats answer ("connecting…", empty panels). Its command, run as
    written against a running service, draws the data: the stage bars of both variants, in
    their colours, fill thousands of pixels (the "connecting…" page has none)."""
    import matplotlib.image

    chromium = shutil.which("chromium")
    if chromium is None:
        if CHROMIUM_REQUIRED:
            pytest.fail("chromium missing but MITA_SERVE_REQUIRE_CHROMIUM=1")
        pytest.skip("chromium not installed (.ci/run installs Debian's)")
    for variant in ("mita", "dense"):
        for text, _ in EXAMPLES[:2]:
            r = service.post("/v1/classify", json={"text": text, "variant": variant,
                                                   "profile": "staged"})
            assert r.status_code == 200, r.text
    command = readme_screenshot_command()
    assert "'http://127.0.0.1:8000/dashboard" in command, command
    assert " --screenshot=docs/dashboard.png " in command, command
    shot = tmp_path / "dashboard.png"
    done = subprocess.run(["bash", "-c", command.replace("http://127.0.0.1:8000", service.url)
                           .replace("docs/dashboard.png", str(shot))], cwd=tmp_path,
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 0 and shot.is_file(), done.stderr[-3000:]
    rgb = (matplotlib.image.imread(shot)[..., :3] * 255).round().astype(int)
    assert rgb.shape[:2] == (1750, 1400)
    drawn = {v: int((rgb == [int(c[i:i + 2], 16) for i in (1, 3, 5)]).all(axis=-1).sum())
             for v, c in VARIANT_COLORS.items()}
    assert drawn["mita"] > 2000 and drawn["dense"] > 2000, drawn
