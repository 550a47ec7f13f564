// mita-serve dashboard: polls v1/stats and draws plain inline SVG. No libraries, no build.
"use strict";

const VARIANTS = ["mita", "dense"];
const SVG = "http://www.w3.org/2000/svg";
const OTHER_STAGE = "#c7c7c7";
// Colours and the sample floor come from v1/stats (mita.hooks), the one definition the load
// tester's plots use too.
let COLOR = {};  // variant → colour
let stageColors = {};  // stage → colour, in forward order
let minStageSamples = 0;  // a stage figure from fewer staged forwards is greyed out
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
  // Local mode: only requests the policy routed are its split; those that named their
  // variant (a load test per variant, a curl) are overrides, counted apart.
  const policy = ab.observed_basis === "policy_routed";
  const what = policy ? "observed, policy-routed" : "observed, all answered (overrides " +
    "included: Prometheus does not record routing)";
  const observed = Object.keys(ab.observed).length
    ? [html("div", { class: "note", id: "ab-observed" },
      `${what}: ${shareText(ab.observed)} (${fmtCount(ab.observed_requests)} requests)`),
    splitBar(ab.observed)]
    : [html("div", { class: "note", id: "ab-observed" },
      `${what}: no ${policy ? "policy-routed" : "answered"} requests in the window`)];
  const overrides = ab.overrides ? [html("div", { class: "note", id: "ab-overrides" },
    "overrides (variant named, not in the split): " +
    VARIANTS.map((v) => `${v} ${fmtCount(ab.overrides[v] || 0)}`).join(" · "))] : [];
  // Under policy auto the weights split only sticky clients: the routing panel routes the rest.
  const configured = ab.policy === "auto" ? "policy auto (routing by N bucket, below); " +
    `sticky clients: ${shareText(weights)}` : `configured: ${shareText(weights)}`;
  replace("ab", html("div", { class: "note", id: "ab-configured" }, configured),
    splitBar(weights), ...observed, ...overrides,
    html("div", { class: "note" }, `shadow ${ab.shadow ? "on" : "off"} · sticky header ` +
      `${ab.sticky_header}`));
}

function fmtKl(x) {
  return x === null || x === undefined ? "–" : `${+x.toPrecision(3)}`;
}

function renderShadow(shadow) {
  const dropped = html("div", { class: "note", id: "shadow-dropped" },
    `${fmtCount(shadow.dropped || 0)} shadow calls dropped (shed or refused so as not ` +
    "to delay primary requests, or failed)");
  if (!shadow.comparisons) {
    return replace("shadow", html("div", { class: "big" }, "–"),
      html("div", { class: "note" }, "no shadow comparisons in the window " +
        "(enable shadow: true in the gateway's user_config)"), dropped);
  }
  replace("shadow", html("div", { class: "big", id: "shadow-rate" },
    `${(100 * shadow.rate).toFixed(1)} %`),
  html("div", { class: "note" }, `${fmtCount(shadow.agree)} of ` +
    `${fmtCount(shadow.comparisons)} labels agree`),
  html("div", { class: "note", id: "shadow-kl" }, `KL(dense ‖ MiTA): mean ` +
    `${fmtKl(shadow.kl_mean)} · p50 ${fmtKl(shadow.kl_p50)} nats`), dropped);
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

const REASONS = { faster_and_agreeing: "faster and agreeing",
  slower: "MiTA not faster by the margin", agreement_too_low: "agreement too low",
  not_enough_data: "not enough data" };

function fmtShare(x) {
  return x === null || x === undefined ? "–" : `${(100 * x).toFixed(1)} %`;
}

function renderRouting(r) {
  const a = r.auto, ws = r.warm_start;
  // The rule of service.routing.decide_bucket: the ends of each median's interval, not the
  // medians, must clear the margin.
  const conf = r.buckets.length ? ` ${+(100 * r.buckets[0].confidence).toFixed(1)} %` : "";
  const rule = `MiTA where the upper end of its median forward's${conf} interval is at least ` +
    `${+(100 * a.margin).toFixed(1)} % below the lower end of dense's ` +
    `(${a.min_latency_samples}+ forwards each) and the lower bound of its agreement is at least ` +
    `${+(100 * a.min_agreement).toFixed(1)} % (${a.min_pairs}+ shadow pairs)`;
  const head = html("div", { class: "note", id: "routing-policy" }, (r.policy === "auto"
    ? "policy auto: " : "policy weighted (requests follow the A/B split); auto would send ") +
    rule + (!ws ? "" : ws.error ? ` · warm start ${ws.file} not used: ${ws.error}`
      : ` · warm start: ${ws.file}`));
  const rows = r.buckets.filter((b) => b.mita_forwards + b.dense_forwards + b.pairs > 0);
  if (!rows.length) return replace("routing", head, empty("no forwards recorded yet"));
  const table = html("table", {}, html("tr", {}, ...["N bucket", "serves", "why", "MiTA p50",
    "dense p50", "agreement (lower bound, pairs)", "KL mean"].map((h) => html("th", {}, h))));
  for (const b of rows) {
    table.append(html("tr", { "data-bucket": b.n_bucket, "data-variant": b.variant,
      "data-reason": b.reason }, html("td", {}, bucketLabel(b.n_bucket)),
    html("td", {}, swatch(b.variant), b.variant),
    html("td", {}, REASONS[b.reason] + (b.from_warm_start ? " (warm start)" : "")),
    html("td", {}, `${fmtMs(b.mita_p50_ms)} (${b.mita_forwards})`),
    html("td", {}, `${fmtMs(b.dense_p50_ms)} (${b.dense_forwards})`),
    html("td", {}, b.pairs ? `${fmtShare(b.agreement)} (≥ ` +
      `${fmtShare(b.agreement_lower_bound)}, ${b.pairs})` : "no shadow pairs yet"),
    html("td", {}, fmtKl(b.kl_mean))));
  }
  replace("routing", head, table);
}

// ---- charts --------------------------------------------------------------------------------

// Per-stage grouped horizontal bars for one N bucket: p50 bar, p95 tick, log-scale x; each
// figure with its sample count n, greyed out below minStageSamples (too few to compare).
function stageChart(bucket, rows, stageOrder) {
  const stages = stageOrder.filter((s) => rows.some((r) => r.stage === s));
  const values = rows.flatMap((r) => [r.p50_ms, r.p95_ms]).filter((x) => x > 0);
  if (!values.length) return empty(`${bucketLabel(bucket)}: no non-zero stage timings`);
  const lo = Math.pow(10, Math.floor(Math.log10(Math.min(...values))));
  const hi = Math.pow(10, Math.ceil(Math.log10(Math.max(...values) * 1.0001)));
  // A variant with no stage rows here: MiTA's fused forwards have no per-stage times, only
  // one forward in staged_profile_every (or a "profile": "staged" request) is staged.
  const absent = VARIANTS.filter((v) => !rows.some((r) => r.variant === v));
  const notes = [
    ...(absent.length ? [`no ${absent.join(", ")} stage timings in this bucket yet (staged ` +
      "forwards only)"] : []),
    ...(rows.some((r) => r.count < minStageSamples) ? [`grey: fewer than ${minStageSamples} ` +
      "staged forwards (n), too few to compare"] : [])];
  const W = 600, left = 124, right = 116, rowH = 30, barH = 11;
  const top = 22 + 11 * Math.max(0, notes.length - 1);  // one line per note
  const H = top + stages.length * rowH + 22;
  const x = (ms) => left + (W - left - right) *
    (Math.log10(Math.max(ms, lo)) - Math.log10(lo)) / (Math.log10(hi) - Math.log10(lo));
  const chart = svg("svg", { viewBox: `0 0 ${W} ${H}`, width: "100%", role: "img",
    "data-bucket": bucket, class: "stage-chart" });
  chart.append(svg("text", { x: 0, y: 13, "font-weight": 600 }, bucketLabel(bucket)));
  notes.forEach((note, i) => chart.append(svg("text", { x: W - 4, y: 13 + 11 * i,
    "text-anchor": "end", class: "sub" }, note)));
  const axis = svg("g", { class: "axis" });
  for (let d = lo; d <= hi * 1.0001; d *= 10) {
    axis.append(svg("line", { class: "grid", x1: x(d), x2: x(d), y1: top - 4, y2: H - 20 }));
    axis.append(svg("text", { x: x(d), y: H - 6, "text-anchor": "middle" }, fmtTick(d)));
  }
  chart.append(axis);
  stages.forEach((stage, i) => {
    const y0 = top + i * rowH;
    chart.append(svg("text", { x: left - 16, y: y0 + rowH / 2 + 3, "text-anchor": "end",
      class: "stage-name" }, stage));
    chart.append(svg("rect", { x: left - 12, y: y0 + rowH / 2 - 5, width: 8, height: 8, rx: 1,
      fill: stageColors[stage] || OTHER_STAGE, class: "stage-swatch", "data-stage": stage }));
    VARIANTS.forEach((v, j) => {
      const r = rows.find((row) => row.stage === stage && row.variant === v);
      if (!r || !(r.p50_ms > 0)) return;
      const y = y0 + 3 + j * (barH + 2);
      // Too few samples: pale, still in its variant's colour, with its n.
      const tooFew = r.count < minStageSamples;
      const g = svg("g", { class: tooFew ? "bar few" : "bar", "data-variant": v,
        "data-stage": stage, "data-p50": r.p50_ms, "data-p95": r.p95_ms,
        "data-count": r.count, opacity: tooFew ? 0.3 : 1 });
      g.append(svg("title", {}, `${v} ${stage} (${bucketLabel(bucket)}): p50 ` +
        `${fmtMs(r.p50_ms)}, p95 ${fmtMs(r.p95_ms)}, n = ${fmtCount(r.count)} staged ` +
        `forwards${tooFew ? ` (fewer than ${minStageSamples}: too few to compare)` : ""}`));
      g.append(svg("rect", { x: left, y, width: Math.max(1, x(r.p50_ms) - left), height: barH,
        fill: COLOR[v], rx: 2 }));
      if (r.p95_ms > 0) {
        g.append(svg("line", { x1: x(r.p95_ms), x2: x(r.p95_ms), y1: y - 1, y2: y + barH + 1,
          stroke: COLOR[v], "stroke-width": 2 }));
      }
      g.append(svg("text", { x: W - right + 4, y: y + barH - 2, fill: COLOR[v],
        class: "figure" }, `${fmtMs(r.p50_ms)} n=${fmtCount(r.count)}`));
      chart.append(g);
    });
  });
  return chart;
}

function renderStages(stages) {
  replace("legend", ...VARIANTS.map((v) => html("span", { "data-variant": v }, swatch(v), v)));
  if (!stages.length) return replace("stages", empty("no stage timings in the window yet"));
  // Forward order (the server's stage_colors), then any stage it does not know.
  const seen = new Set(stages.map((r) => r.stage));
  const order = [...Object.keys(stageColors).filter((st) => seen.has(st)),
    ...[...seen].filter((st) => !(st in stageColors)).sort()];
  const buckets = [...new Set(stages.map((r) => r.n_bucket))];
  replace("stages", ...buckets.map((b) => stageChart(b, stages.filter((r) => r.n_bucket === b),
    order)));
}

// The first bin with an answered request: time axes start there, not before the service ran.
function firstSample(timeline) {
  const ts = timeline.filter((p) => p.requests > 0).map((p) => p.t);
  return ts.length ? Math.min(...ts) : null;
}

// Lines over time from t0; series: [{variant, key, dash}] read from timeline points. log: a
// log-scale y axis (latency: one slow burst does not flatten the rest).
function timeChart(timeline, series, unit, attrs, t0, log, title) {
  const points = timeline.filter((p) => p.t >= t0);
  const ts = [...new Set(points.map((p) => p.t))].sort((a, b) => a - b);
  const vals = points.flatMap((p) => series.map((s) => p[s.key]))
    .filter((v) => v !== null && v !== undefined && (!log || v > 0));
  if (!ts.length || !vals.some((v) => v > 0)) {
    return empty(`${title ? `${title}: ` : ""}no answered requests in the window yet`);
  }
  const W = 440, H = title ? 200 : 220, left = 58, right = 12, top = title ? 24 : 10;
  const bottom = 24;
  const lo = log ? Math.pow(10, Math.floor(Math.log10(Math.min(...vals)))) : 0;
  const hi = log ? Math.pow(10, Math.ceil(Math.log10(Math.max(...vals) * 1.0001)))
    : niceMax(Math.max(...vals));
  const frac = log ? (v) => (Math.log10(v) - Math.log10(lo)) / (Math.log10(hi) - Math.log10(lo))
    : (v) => v / hi;
  const t1 = Math.max(ts[ts.length - 1], t0 + 1);
  const x = (t) => left + (W - left - right) * (t - t0) / (t1 - t0);
  const y = (v) => H - bottom - (H - top - bottom) * frac(v);
  const chart = svg("svg", { viewBox: `0 0 ${W} ${H}`, width: "100%", role: "img",
    "data-t0": t0, ...attrs });
  if (title) chart.append(svg("text", { x: 0, y: 13, "font-weight": 600 }, title));
  const axis = svg("g", { class: "axis" });
  const ticks = [];
  if (log) for (let d = lo; d <= hi * 1.0001; d *= 10) ticks.push(d);
  else for (let i = 0; i <= 4; i++) ticks.push(hi * i / 4);
  for (const v of ticks) {
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
    const own = points.filter((p) => p.variant === s.variant).sort((a, b) => a.t - b.t);
    const ok = (v) => v !== null && v !== undefined && (!log || v > 0);
    let d = "", pen = "M";
    for (const p of own) {
      if (!ok(p[s.key])) { pen = "M"; continue; }
      d += `${pen}${x(p.t).toFixed(1)},${y(p[s.key]).toFixed(1)} `;
      pen = "L";
    }
    if (!d) continue;
    chart.append(svg("path", { d, fill: "none", stroke: COLOR[s.variant], "stroke-width": 1.8,
      "stroke-dasharray": s.dash ? "5 3" : "none", class: "series", "data-variant": s.variant,
      "data-key": s.key }));
    // Single points (a bin between gaps) still show as dots.
    for (const p of own) {
      if (ok(p[s.key])) {
        chart.append(svg("circle", { cx: x(p.t), cy: y(p[s.key]), r: 1.8,
          fill: COLOR[s.variant] }));
      }
    }
  }
  return chart;
}

function renderTimeline(timeline, byN) {
  const t0 = firstSample(timeline);
  if (t0 === null) {
    replace("latency", empty("no answered requests in the window yet"));
    return replace("throughput", empty("no answered requests in the window yet"));
  }
  const lines = VARIANTS.flatMap((v) => [{ variant: v, key: "p50_ms" },
    { variant: v, key: "p99_ms", dash: true }]);
  const buckets = [...new Set(byN.map((p) => p.n_bucket))];
  if (!buckets.length) replace("latency", empty("no request latencies per N bucket yet"));
  else replace("latency", ...buckets.map((b) => timeChart(byN.filter((p) => p.n_bucket === b),
    lines, "ms", { class: "latency-chart", "data-bucket": b }, t0, true, bucketLabel(b))));
  replace("throughput", timeChart(timeline, VARIANTS.map((v) => ({ variant: v, key: "rps" })),
    "rps", { id: "throughput-chart" }, t0, false));
}

// What a ratio bar compared: "N = 1,024" for one N, else how many N values and their range.
function ratioLabel(r) {
  if (!r.like_for_like) return "N mix may differ";
  const fmt = (n) => n.toLocaleString("en");
  return r.n_values === 1 ? `N = ${fmt(r.n_min)}`
    : `${r.n_values} N, ${fmt(r.n_min)}–${fmt(r.n_max)}`;
}

function renderRatio(ratios) {
  if (!ratios.length) {
    return replace("ratio", empty("needs answered requests of both variants at the same N"));
  }
  const W = 440, left = 44, gap = 20, H = 220, top = 16, bottom = 36;
  const barW = Math.min(64, (W - left - 10) / ratios.length - gap);
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
    const g = svg("g", { class: "ratio", "data-bucket": r.n_bucket, "data-ratio": r.ratio,
      "data-like-for-like": r.like_for_like });
    g.append(svg("title", {}, `${ratioLabel(r)}: mita p50 ${fmtMs(r.mita_p50_ms)}, ` +
      `dense p50 ${fmtMs(r.dense_p50_ms)}` + (r.like_for_like ? ", same N for both"
        : "; the variants may have served different N in this bucket")));
    g.append(svg("rect", { x: x0, y: y(r.ratio), width: barW, height: y(0) - y(r.ratio),
      fill: r.ratio < 1 ? COLOR.mita : COLOR.dense, rx: 2,
      "fill-opacity": r.like_for_like ? 1 : 0.45 }));
    g.append(svg("text", { x: x0 + barW / 2, y: y(r.ratio) - 3, "text-anchor": "middle" },
      `${r.ratio.toFixed(2)}×`));
    g.append(svg("text", { x: x0 + barW / 2, y: H - 20, "text-anchor": "middle" },
      bucketLabel(r.n_bucket)));
    g.append(svg("text", { x: x0 + barW / 2, y: H - 6, "text-anchor": "middle",
      class: "sub" }, ratioLabel(r)));
    chart.append(g);
  });
  chart.append(svg("line", { x1: left, x2: W - 10, y1: y(1), y2: y(1), stroke: "#444",
    "stroke-dasharray": "3 3" }));
  const mixed = ratios.some((r) => !r.like_for_like);
  replace("ratio", chart, html("div", { class: "note" }, mixed
    ? "Prometheus knows only the N bucket: a pale bar compares whatever N each variant served " +
      "in it, not like for like"
    : "only N values both variants served, each N's ratio of medians (geometric mean)"));
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
  COLOR = s.variant_colors;
  minStageSamples = s.min_stage_samples;
  renderModels(s.models);
  renderAB(s.ab);
  renderShadow(s.shadow);
  renderRequests(s.requests, s.latency);
  stageColors = s.stage_colors;
  renderStages(s.stages);
  renderTimeline(s.timeline, s.timeline_by_n);
  renderRatio(s.ratios);
}

async function refresh() {
  const errorBox = document.getElementById("error");
  try {
    const r = await fetch(`v1/stats?window_s=${windowS}`, { cache: "no-store" });
    const body = await r.json();
    if (!r.ok) throw new Error(body.error || `${r.status} ${r.statusText}`);
    render(body);
    // the routing panel after the colours are known; its own failure only leaves it as it was
    const routing = await fetch("v1/routing", { cache: "no-store" }).catch(() => null);
    if (routing && routing.ok) renderRouting(await routing.json());
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
