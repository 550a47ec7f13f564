"""The dashboard's drawing of counts, KL and the policy split from a recorded /v1/stats answer,
without the service (the page on the running service: tests/service/test_dashboard.py)."""

from __future__ import annotations

import json
import threading
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from mita.hooks import VARIANT_COLORS
from service.routing import RoutingTable
from service.settings import AutoPolicy

from ..fakes import counted_window, stats_body
from ..helpers import texts, wait_for

ROOT = Path(__file__).resolve().parents[2]


@contextmanager
def dashboard_without_ray(body: dict, routing: dict | None = None):
    """The dashboard's page and script as the gateway serves them, with ``body`` as its
    /v1/stats and ``routing`` (default: an empty table) as its /v1/routing, on a loopback
    port: the page in a browser with fixed data and no service."""
    static = ROOT / "service" / "static"
    files = {"/dashboard": ((static / "dashboard.html").read_bytes(), "text/html"),
             "/dashboard/dashboard.js": ((static / "dashboard.js").read_bytes(),
                                         "text/javascript"),
             "/v1/stats": (json.dumps(body).encode(), "application/json"),
             "/v1/routing": (json.dumps(routing or RoutingTable().report("weighted"))
                             .encode(), "application/json")}

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            found = files.get(self.path.split("?")[0])
            if found is None:
                self.send_error(404)
                return
            data, ctype = found
            self.send_response(200)
            self.send_header("content-type", f"{ctype}; charset=utf-8")
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()
        server.server_close()










def test_dashboard_draws_counts_kl_and_the_policy_split(browser):
    """The page, with fixed /v1/stats data (``counted_window``) and no service: every stage
    figure says its n, MiTA's two-sample bucket is greyed out (its qkv_proj 13.2 ms against
    dense's 2.25 ms is no comparison), the shadow card gives the KL's mean and p50, the A/B
    card the policy-routed split (75/25 of 8) and the overrides (5 dense) apart; each
    variant in the colour /v1/stats gives (the load tester's too)."""
    body = stats_body(counted_window().summary())
    # policy auto's table on fixed evidence: le_1024 dense (MiTA slower), le_4096 MiTA
    table = RoutingTable(AutoPolicy(min_agreement=0.45, min_pairs=10, min_latency_samples=6))
    for _ in range(6):
        table.add_forward("mita", 64, 1.5)
        table.add_forward("dense", 64, 1.0)
        table.add_forward("mita", 4096, 12.5)
        table.add_forward("dense", 4096, 100.0)
    for i in range(10):
        table.add_pair(4096, i < 8, 0.125)
    with dashboard_without_ray(body, table.report("auto")) as url:
        browser.get(f"{url}/dashboard")

        def drawn():
            return browser.execute_script(
                "return [...document.querySelectorAll('#stages g.bar')].map(g => "
                "[g.closest('svg').dataset.bucket, g.dataset.variant, g.dataset.stage, "
                "g.getAttribute('class'), g.getAttribute('opacity'), "
                "g.querySelector('text.figure').textContent, "
                "g.querySelector('rect').getAttribute('fill')])") or None
        bars = wait_for(drawn, 30)
        assert bars, browser.find_element("tag name", "body").text[:2000]
        notes = browser.execute_script(
            "return [...document.querySelectorAll('#stages svg')].map(c => "
            "[c.dataset.bucket, [...c.querySelectorAll('text.sub')].map(t => t.textContent)])")
        observed, overrides, kl, dropped = texts(
            browser, "#ab-observed", "#ab-overrides", "#shadow-kl", "#shadow-dropped")
        # Prometheus mode: the split of all answered requests, said so; no overrides line.
        prom = browser.execute_script(
            "renderAB({...arguments[0], observed_basis: 'all_answered', overrides: null});"
            "return [document.getElementById('ab-observed').textContent, "
            "document.getElementById('ab-overrides')]", body["ab"])
        auto = browser.execute_script(
            "renderAB({...arguments[0], policy: 'auto'});"
            "return document.getElementById('ab-configured').textContent", body["ab"])
        routing = wait_for(lambda: browser.execute_script(
            "return [...document.querySelectorAll('#routing tr[data-bucket]')].map(r => "
            "[r.dataset.bucket, r.dataset.variant, r.dataset.reason, "
            "[...r.querySelectorAll('td')].map(td => td.textContent)])") or None, 30)
        policy, = texts(browser, "#routing-policy")
        logs = browser.get_log("browser")
    assert routing == [
        ["le_1024", "dense", "slower", ["N ≤ 1,024", "dense", "MiTA not faster by the margin",
                                        "1.50 ms (6)", "1.00 ms (6)", "no shadow pairs yet",
                                        "–"]],
        ["le_4096", "mita", "faster_and_agreeing",
         ["N ≤ 4,096", "mita", "faster and agreeing", "12.5 ms (6)", "100 ms (6)",
          "80.0 % (≥ 49.0 %, 10)", "0.125"]]]
    assert policy == ("policy auto: MiTA where the upper end of its median forward's 95 % "
                      "interval is at least 10 % below the lower end of dense's (6+ forwards "
                      "each) and the lower bound of its agreement is at least 45 % (10+ "
                      "shadow pairs)")
    got = {(b, v, st): (cls, op, text, fill) for b, v, st, cls, op, text, fill in bars}
    assert got["le_1024", "mita", "qkv_proj"] == ("bar few", "0.3", "13.2 ms n=2",
                                                  VARIANT_COLORS["mita"])
    assert got["le_1024", "dense", "qkv_proj"] == ("bar", "1", "2.25 ms n=6",
                                                   VARIANT_COLORS["dense"])
    assert got["le_4096", "mita", "qkv_proj"] == ("bar", "1", "11.2 ms n=6",
                                                  VARIANT_COLORS["mita"])
    assert all(text.endswith((" n=2", " n=6")) for _, _, text, _ in got.values())
    assert dict(notes) == {
        "le_1024": ["grey: fewer than 5 staged forwards (n), too few to compare"],
        "le_4096": []}
    assert observed == "observed, policy-routed: mita 75.0 % · dense 25.0 % (8 requests)"
    assert overrides == "overrides (variant named, not in the split): mita 0 · dense 5"
    assert dropped.startswith("4 shadow calls dropped"), dropped
    assert kl == "KL(dense ‖ MiTA): mean 0.177 · p50 0.02 nats"
    assert prom == ["observed, all answered (overrides included: Prometheus does not record "
                    "routing): mita 75.0 % · dense 25.0 % (8 requests)", None]
    assert auto == ("policy auto (routing by N bucket, below); sticky clients: mita 80.0 % · "
                    "dense 20.0 %")
    errors = [e for e in logs if e["level"] == "SEVERE"]
    assert not errors, errors
