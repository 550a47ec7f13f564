// mita-serve dashboard: polls v1/stats and draws plain inline SVG. No libraries, no build.
"use strict";

const VARIANTS = ["mita", "dense"];
const COLOR = { mita: "#1f6fb4", dense: "#e07b10" };
const SVG = "http://www.w3.org/2000/svg";
const query = new URLSearchParams(window.location.search);
const REFRESH_MS = Math.max(1, Number(query.get("refresh_s")) || 2) * 1000;
let windowS = Number(query.get("window_s")) || 300;

// ---- small helpers -------------------------------------------------------------------------

function svg(tag, attrs, text) {
  const node = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
  if (text !== undefined) node.textContent = text;
  return node;
}

function html(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
  for (const c of children) node.append(c instanceof Node ? c : String(c));
  return node;
}

function swatch(variant) {
  return html("span", { class: "swatch", style: `background:${COLOR[variant]}` });
}

function fmtMs(ms) {
  if (ms === null || ms === undefined) return "–";
  if (ms < 1) return `${(ms * 1000).toPrecision(3)} µs`;
  if (ms < 1000) return `${ms.toPrecision(3)} ms`;
  return `${(ms / 1000).toPrecision(3)} s`;
}

// Axis ticks: no trailing zeros ("1 ms", "250 µs", "0").
function fmtTick(ms) {
  if (ms === 0) return "0";
  if (ms < 1) return `${+(ms * 1000).toPrecision(3)} µs`;
  if (ms < 1000) return `${+ms.toPrecision(3)} ms`;
  return `${+(ms / 1000).toPrecision(3)} s`;
}

function fmtCount(x) {
  // Prometheus' increase() extrapolates: its counts are estimates, shown as such.
  return Number.isInteger(x) ? String(x) : `≈${Math.round(x)}`;
}

function fmtTime(t) {
  return new Date(t * 1000).toLocaleTimeString([], { hour12: false });
}

function bucketLabel(b) {
  return `N ≤ ${Number(b.replace("le_", "")).toLocaleString("en")}`;
}

function niceMax(x) {
  if (!(x > 0)) return 1;
  const e = Math.pow(10, Math.floor(Math.log10(x)));
  return [1, 2, 5, 10].map((m) => m * e).find((v) => v >= x);
}

function replace(id, ...nodes) {
  document.getElementById(id).replaceChildren(...nodes);
}

function empty(text) {
  return html("div", { class: "empty" }, text);
}

// ---- cards ---------------------------------------------------------------------------------

function renderModels(models) {
  const variants = VARIANTS.filter((v) => models[v]);
  if (!variants.length) return replace("models", empty("classifiers not answering yet"));
  const table = html("table", {}, html("tr", {}, ...["variant", "m", "k", "s", "device", "dtype"]
    .map((h) => html("th", {}, h))));
  for (const v of variants) {
    const m = models[v];
    table.append(html("tr", { "data-variant": v }, html("td", {}, swatch(v), v),
      ...[m.m, m.k, m.s].map((x) => html("td", {}, x === null ? "–" : x)),
      html("td", {}, m.device), html("td", {}, m.dtype ?? "–")));
  }
  const ids = [...new Set(variants.map((v) => models[v].model_id))];
  replace("models", html("div", { class: "note" }, `model ${ids.join(", ")}`), table);
}

function splitBar(shares) {
  const bar = html("div", { class: "split" });
  for (const v of VARIANTS) {
    if (shares[v] > 0) {
      bar.append(html("div", { style: `width:${(100 * shares[v]).toFixed(2)}%;` +
        `background:${COLOR[v]}`, title: `${v} ${(100 * shares[v]).toFixed(1)} %` }));
    }
  }
  return bar;
}

function shareText(shares) {
  return VARIANTS.map((v) => `${v} ${(100 * (shares[v] || 0)).toFixed(1)} %`).join(" · ");
}

function renderAB(ab) {
  const total = VARIANTS.reduce((s, v) => s + (ab.weights[v] || 0), 0) || 1;
  const weights = Object.fromEntries(VARIANTS.map((v) => [v, (ab.weights[v] || 0) / total]));
  const observed = Object.keys(ab.observed).length
    ? [html("div", { class: "note" }, `observed: ${shareText(ab.observed)}`),
      splitBar(ab.observed)]
    : [html("div", { class: "note" }, "observed: no answered requests in the window")];
  replace("ab", html("div", { class: "note" }, `configured: ${shareText(weights)}`),
    splitBar(weights), ...observed,
    html("div", { class: "note" }, `shadow ${ab.shadow ? "on" : "off"} · sticky header ` +
      `${ab.sticky_header}`));
}

function renderShadow(shadow) {
  if (!shadow.comparisons) {
    return replace("shadow", html("div", { class: "big" }, "–"),
      html("div", { class: "note" }, "no shadow comparisons in the window " +
        "(enable shadow: true in the gateway's user_config)"));
  }
  replace("shadow", html("div", { class: "big", id: "shadow-rate" },
    `${(100 * shadow.rate).toFixed(1)} %`),
  html("div", { class: "note" }, `${fmtCount(shadow.agree)} of ` +
    `${fmtCount(shadow.comparisons)} labels agree`));
}

function renderRequests(requests, latency) {
  if (!requests.length) return replace("requests", empty("no requests in the window yet"));
  const table = html("table", {}, html("tr", {}, html("th", {}, "variant"),
    html("th", {}, "status"), html("th", {}, "count")));
  for (const r of requests) {
    table.append(html("tr", {}, html("td", {}, COLOR[r.variant] ? swatch(r.variant) : "",
      r.variant), html("td", {}, r.status), html("td", {}, fmtCount(r.count))));
  }
  const ok = latency.reduce((s, r) => s + r.count, 0);
  replace("requests", table, html("div", { class: "note" }, `${fmtCount(ok)} answered`));
}

// ---- charts --------------------------------------------------------------------------------

// Per-stage grouped horizontal bars for one N bucket: p50 bar, p95 tick, log-scale x.
function stageChart(bucket, rows, stageOrder) {
  const stages = stageOrder.filter((s) => rows.some((r) => r.stage === s));
  const values = rows.flatMap((r) => [r.p50_ms, r.p95_ms]).filter((x) => x > 0);
  if (!values.length) return empty(`${bucketLabel(bucket)}: no non-zero stage timings`);
  const lo = Math.pow(10, Math.floor(Math.log10(Math.min(...values))));
  const hi = Math.pow(10, Math.ceil(Math.log10(Math.max(...values) * 1.0001)));
  const W = 560, left = 112, right = 76, top = 22, rowH = 30, barH = 11;
  const H = top + stages.length * rowH + 22;
  const x = (ms) => left + (W - left - right) *
    (Math.log10(Math.max(ms, lo)) - Math.log10(lo)) / (Math.log10(hi) - Math.log10(lo));
  const chart = svg("svg", { viewBox: `0 0 ${W} ${H}`, width: "100%", role: "img",
    "data-bucket": bucket, class: "stage-chart" });
  chart.append(svg("text", { x: 0, y: 13, "font-weight": 600 }, bucketLabel(bucket)));
  const axis = svg("g", { class: "axis" });
  for (let d = lo; d <= hi * 1.0001; d *= 10) {
    axis.append(svg("line", { class: "grid", x1: x(d), x2: x(d), y1: top - 4, y2: H - 20 }));
    axis.append(svg("text", { x: x(d), y: H - 6, "text-anchor": "middle" }, fmtTick(d)));
  }
  chart.append(axis);
  stages.forEach((stage, i) => {
    const y0 = top + i * rowH;
    chart.append(svg("text", { x: left - 6, y: y0 + rowH / 2 + 3, "text-anchor": "end",
      class: "stage-name" }, stage));
    VARIANTS.forEach((v, j) => {
      const r = rows.find((row) => row.stage === stage && row.variant === v);
      if (!r || !(r.p50_ms > 0)) return;
      const y = y0 + 3 + j * (barH + 2);
      const g = svg("g", { class: "bar", "data-variant": v, "data-stage": stage,
        "data-p50": r.p50_ms, "data-p95": r.p95_ms, "data-count": r.count });
      g.append(svg("title", {}, `${v} ${stage} (${bucketLabel(bucket)}): p50 ` +
        `${fmtMs(r.p50_ms)}, p95 ${fmtMs(r.p95_ms)}, ${fmtCount(r.count)} samples`));
      g.append(svg("rect", { x: left, y, width: Math.max(1, x(r.p50_ms) - left), height: barH,
        fill: COLOR[v], rx: 2 }));
      if (r.p95_ms > 0) {
        g.append(svg("line", { x1: x(r.p95_ms), x2: x(r.p95_ms), y1: y - 1, y2: y + barH + 1,
          stroke: COLOR[v], "stroke-width": 2 }));
      }
      g.append(svg("text", { x: W - right + 4, y: y + barH - 2, fill: COLOR[v] },
        fmtMs(r.p50_ms)));
      chart.append(g);
    });
  });
  return chart;
}

function renderStages(stages) {
  replace("legend", ...VARIANTS.map((v) => html("span", { "data-variant": v }, swatch(v), v)));
  if (!stages.length) return replace("stages", empty("no stage timings in the window yet"));
  const order = [...new Set(stages.map((r) => r.stage))];  // the server sends forward order
  const buckets = [...new Set(stages.map((r) => r.n_bucket))];
  replace("stages", ...buckets.map((b) => stageChart(b, stages.filter((r) => r.n_bucket === b),
    order)));
}

// Lines over time; series: [{variant, key, dash}] read from timeline points.
function timeChart(timeline, series, unit, id) {
  const ts = [...new Set(timeline.map((p) => p.t))].sort((a, b) => a - b);
  const vals = timeline.flatMap((p) => series.map((s) => p[s.key]))
    .filter((v) => v !== null && v !== undefined);
  if (!ts.length || !vals.some((v) => v > 0)) return empty("no answered requests in the window yet");
  const W = 440, H = 220, left = 58, right = 12, top = 10, bottom = 24;
  const ymax = niceMax(Math.max(...vals));
  const t0 = ts[0], t1 = Math.max(ts[ts.length - 1], t0 + 1);
  const x = (t) => left + (W - left - right) * (t - t0) / (t1 - t0);
  const y = (v) => H - bottom - (H - top - bottom) * v / ymax;
  const chart = svg("svg", { viewBox: `0 0 ${W} ${H}`, width: "100%", role: "img", id });
  const axis = svg("g", { class: "axis" });
  for (let i = 0; i <= 4; i++) {
    const v = ymax * i / 4;
    axis.append(svg("line", { class: "grid", x1: left, x2: W - right, y1: y(v), y2: y(v) }));
    axis.append(svg("text", { x: left - 4, y: y(v) + 4, "text-anchor": "end" },
      unit === "ms" ? fmtTick(v) : `${+v.toPrecision(3)}/s`));
  }
  for (let i = 0; i <= 4; i++) {
    const t = t0 + (t1 - t0) * i / 4;
    axis.append(svg("text", { x: x(t), y: H - 6, "text-anchor": i === 0 ? "start" : i === 4
      ? "end" : "middle" }, fmtTime(t)));
  }
  chart.append(axis);
  for (const s of series) {
    const points = timeline.filter((p) => p.variant === s.variant)
      .sort((a, b) => a.t - b.t);
    let d = "", pen = "M";
    for (const p of points) {
      const v = p[s.key];
      if (v === null || v === undefined) { pen = "M"; continue; }
      d += `${pen}${x(p.t).toFixed(1)},${y(v).toFixed(1)} `;
      pen = "L";
    }
    if (!d) continue;
    chart.append(svg("path", { d, fill: "none", stroke: COLOR[s.variant], "stroke-width": 1.8,
      "stroke-dasharray": s.dash ? "5 3" : "none", class: "series", "data-variant": s.variant,
      "data-key": s.key }));
    // Single points (a bin between gaps) still show as dots.
    for (const p of points) {
      if (p[s.key] !== null && p[s.key] !== undefined) {
        chart.append(svg("circle", { cx: x(p.t), cy: y(p[s.key]), r: 1.8,
          fill: COLOR[s.variant] }));
      }
    }
  }
  return chart;
}

function renderTimeline(timeline) {
  replace("latency", timeChart(timeline, VARIANTS.flatMap((v) => [
    { variant: v, key: "p50_ms" }, { variant: v, key: "p99_ms", dash: true }]), "ms",
  "latency-chart"));
  replace("throughput", timeChart(timeline, VARIANTS.map((v) => ({ variant: v, key: "rps" })),
    "rps", "throughput-chart"));
}

function renderRatio(ratios) {
  if (!ratios.length) {
    return replace("ratio", empty("needs answered requests of both variants in the same N " +
      "bucket"));
  }
  const W = 440, left = 44, gap = 20, H = 220, top = 16, bottom = 24;
  const barW = Math.min(72, (W - left - 10) / ratios.length - gap);
  const ymax = niceMax(Math.max(1.2, ...ratios.map((r) => r.ratio)) * 1.05);
  const y = (v) => H - bottom - (H - top - bottom) * v / ymax;
  const chart = svg("svg", { viewBox: `0 0 ${W} ${H}`, width: "100%", role: "img",
    id: "ratio-chart" });
  const axis = svg("g", { class: "axis" });
  for (let i = 0; i <= 4; i++) {
    const v = ymax * i / 4;
    axis.append(svg("line", { class: "grid", x1: left, x2: W - 10, y1: y(v), y2: y(v) }));
    axis.append(svg("text", { x: left - 4, y: y(v) + 4, "text-anchor": "end" },
      `${+v.toPrecision(2)}×`));
  }
  chart.append(axis);
  ratios.forEach((r, i) => {
    const x0 = left + gap / 2 + i * (barW + gap);
    const g = svg("g", { class: "ratio", "data-bucket": r.n_bucket, "data-ratio": r.ratio });
    g.append(svg("title", {}, `${bucketLabel(r.n_bucket)}: mita p50 ${fmtMs(r.mita_p50_ms)}, ` +
      `dense p50 ${fmtMs(r.dense_p50_ms)}`));
    g.append(svg("rect", { x: x0, y: y(r.ratio), width: barW, height: y(0) - y(r.ratio),
      fill: r.ratio < 1 ? COLOR.mita : COLOR.dense, rx: 2 }));
    g.append(svg("text", { x: x0 + barW / 2, y: y(r.ratio) - 3, "text-anchor": "middle" },
      `${r.ratio.toFixed(2)}×`));
    g.append(svg("text", { x: x0 + barW / 2, y: H - 6, "text-anchor": "middle" },
      bucketLabel(r.n_bucket)));
    chart.append(g);
  });
  chart.append(svg("line", { x1: left, x2: W - 10, y1: y(1), y2: y(1), stroke: "#444",
    "stroke-dasharray": "3 3" }));
  replace("ratio", chart);
}

// ---- refresh loop --------------------------------------------------------------------------

function render(s) {
  const source = s.source === "prometheus" ? "Prometheus (all replicas)"
    : "gateway's own records (this replica)";
  document.getElementById("source").textContent = `source: ${source}`;
  // The local source keeps only stats_window_s: say so when the selected window is longer.
  const capped = s.window_s + 1 < windowS ? ` (${windowS} s asked: the gateway keeps ` +
    `${Math.round(s.window_s)} s, its stats_window_s; set prometheus_url for more)` : "";
  document.getElementById("updated").textContent = `last ${Math.round(s.window_s)} s` +
    `${capped}, updated ${fmtTime(s.generated_at)}${s.truncated ? " (record cap reached: " +
      "window cut short)" : ""}`;
  renderModels(s.models);
  renderAB(s.ab);
  renderShadow(s.shadow);
  renderRequests(s.requests, s.latency);
  renderStages(s.stages);
  renderTimeline(s.timeline);
  renderRatio(s.ratios);
}

async function refresh() {
  const errorBox = document.getElementById("error");
  try {
    const r = await fetch(`v1/stats?window_s=${windowS}`, { cache: "no-store" });
    const body = await r.json();
    if (!r.ok) throw new Error(body.error || `${r.status} ${r.statusText}`);
    render(body);
    errorBox.hidden = true;
    document.body.dataset.updates = String(Number(document.body.dataset.updates || 0) + 1);
  } catch (e) {
    errorBox.textContent = `Could not load v1/stats: ${e.message}. Retrying every ` +
      `${REFRESH_MS / 1000} s; the last data stays on screen.`;
    errorBox.hidden = false;
  } finally {
    window.setTimeout(refresh, REFRESH_MS);
  }
}

document.addEventListener("DOMContentLoaded", () => {
  const select = document.getElementById("window");
  if (![...select.options].some((o) => Number(o.value) === windowS)) {
    select.append(html("option", { value: windowS }, `${windowS} s`));
  }
  select.value = String(windowS);
  select.addEventListener("change", () => { windowS = Number(select.value); });
  refresh();
});
