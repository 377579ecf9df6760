// hotpool's usage dashboard. Plain JavaScript, no build step: the page is served as is.
// Data comes from the public JSON APIs with the signed-in key as a bearer header:
//   /v1/me               who the key is (sign-in check, admin or not)
//   /v1/usage            tokens and cost per bucket (totals, per deployment, per key)
//   /v1/usage/summary    requests by status, latency, replicas, scale events
//   /v1/tenants          the tenant filter, for operator keys
// Every value reaches the DOM through textContent, never as HTML.
"use strict";

const KEY_STORAGE = "hotpool.apiKey";
const RANGE_STORAGE = "hotpool.range";
// Every 30 s, or every `?refresh=N` seconds (at least 2) when the address says so.
const REFRESH_MS =
  Math.max(2, Number(new URLSearchParams(window.location.search).get("refresh")) || 30) * 1000;
// Range -> bucket width and count, within /v1/usage's limits (1m: 1440, 1h: 168, 1d: 31).
const RANGES = {
  "1h": { width: "1m", seconds: 60, buckets: 60 },
  "24h": { width: "1h", seconds: 3600, buckets: 24 },
  "7d": { width: "1h", seconds: 3600, buckets: 168 },
  "30d": { width: "1d", seconds: 86400, buckets: 30 },
};
const STATUS_COLORS = { completed: "#16a34a", partial: "#f59e0b", error: "#dc2626", cancelled: "#9ca3af" };
const PALETTE = ["#2563eb", "#16a34a", "#f59e0b", "#dc2626", "#7c3aed", "#0891b2", "#db2777", "#65a30d"];
const PHASE_ORDER = ["queue", "start", "fetch", "load", "warmup"];

const state = {
  key: sessionStorage.getItem(KEY_STORAGE),
  me: null,
  range: localStorage.getItem(RANGE_STORAGE) || "24h",
  tenant: "",
  charts: {},
  timer: null,
  loading: false,
  reloadAfter: false, // a range or tenant chosen while a load was in flight
  signInAttempt: 0, // only the latest sign-in's answer counts
  data: null, // the last data drawn; tests and people debugging can read it
};
window.hotpoolDashboard = state;

const $ = (id) => document.getElementById(id);

// ---- formatting -----------------------------------------------------------------------

function formatCount(n) {
  const abs = Math.abs(n);
  const units = [[1e12, "T"], [1e9, "B"], [1e6, "M"], [1e3, "K"]];
  for (const [size, suffix] of units) {
    if (abs >= size) {
      const v = n / size;
      return (abs / size >= 100 ? v.toFixed(0) : v.toFixed(1)).replace(/\.0$/, "") + suffix;
    }
  }
  return String(n);
}

function formatMoney(micros, currency) {
  if (micros === null || currency === null) return "–";
  const value = micros / 1e6;
  // Cents for sums people read; more digits for the fractions of a cent a token costs.
  const digits = value !== 0 && Math.abs(value) < 0.01 ? 6 : 2;
  const text = new Intl.NumberFormat("en-US", {
    style: "currency", currency, minimumFractionDigits: digits === 2 ? 2 : 0,
    maximumFractionDigits: digits,
  }).format(value);
  return text;
}

function formatMoneyTick(value, currency) {
  // Axis ticks: three significant digits, so $0.010 and $0.012 stay apart.
  return new Intl.NumberFormat("en-US", { style: "currency", currency, maximumSignificantDigits: 3 })
    .format(value);
}

function formatSeconds(s) {
  if (s === null || s === undefined) return "–";
  return s < 1 ? `${Math.round(s * 1000)} ms` : `${s.toFixed(2)} s`;
}

function formatTime(unix, width) {
  const d = new Date(unix * 1000);
  if (width === "1d") return d.toLocaleDateString([], { month: "short", day: "numeric" });
  if (width === "1h" && state.range === "7d") {
    return d.toLocaleString([], { weekday: "short", hour: "2-digit", minute: "2-digit" });
  }
  return d.toLocaleTimeString([], { hour: "2-digit", minute: "2-digit" });
}

function formatAgo(unix) {
  if (unix === null) return "never";
  const s = Math.max(0, Date.now() / 1000 - unix);
  if (s < 60) return `${Math.round(s)} s ago`;
  if (s < 3600) return `${Math.round(s / 60)} min ago`;
  if (s < 86400) return `${Math.round(s / 3600)} h ago`;
  return `${Math.round(s / 86400)} d ago`;
}

// ---- API ------------------------------------------------------------------------------

class ApiError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}

async function api(path, params = {}) {
  const url = new URL(path, window.location.origin);
  for (const [name, value] of Object.entries(params)) {
    if (value !== undefined && value !== null && value !== "") url.searchParams.set(name, value);
  }
  const headers = { accept: "application/json" };
  if (state.key) headers.authorization = `Bearer ${state.key}`;
  let response;
  try {
    response = await fetch(url, { headers });
  } catch (err) {
    throw new ApiError(0, `The control plane did not answer (${err.message}).`);
  }
  const body = await response.json().catch(() => null);
  if (!response.ok) {
    const message = body && body.error ? body.error.message : `HTTP ${response.status}`;
    throw new ApiError(response.status, message);
  }
  return body;
}

// ---- sign-in --------------------------------------------------------------------------

function showSignIn(message) {
  stopRefresh();
  $("board").hidden = true;
  $("who").hidden = true;
  $("sign-in").hidden = false;
  const error = $("sign-in-error");
  error.textContent = message || "";
  error.hidden = !message;
  $("api-key").focus();
}

async function signIn(key) {
  // The page's own check of a kept key can still be in flight when a person signs in: the
  // answer of an older attempt must not sign the newer one out (or in).
  const attempt = ++state.signInAttempt;
  state.key = key;
  let me;
  try {
    me = await api("/v1/me");
  } catch (err) {
    if (attempt !== state.signInAttempt) return;
    state.key = null;
    sessionStorage.removeItem(KEY_STORAGE);
    if (err.status === 401) {
      showSignIn(key ? `This API key was not accepted: ${err.message}` : "");
    } else {
      showSignIn(err.message);
    }
    return;
  }
  if (attempt !== state.signInAttempt) return;
  if (me.key && !me.admin && !me.key.scopes.includes("usage")) {
    state.key = null;
    showSignIn(`The key ${me.key.prefix} lacks the usage scope; the dashboard needs it.`);
    return;
  }
  if (key) sessionStorage.setItem(KEY_STORAGE, key);
  state.me = me;
  $("sign-in").hidden = true;
  $("who").hidden = me.auth === "off";
  $("who-tenant").textContent = me.admin ? `${me.tenant.name} (admin)` : me.tenant.name;
  $("who-key").textContent = me.key ? me.key.prefix : "";
  $("local-mode").hidden = me.auth !== "off";
  $("board").hidden = false;
  await setupTenantFilter();
  selectRange(state.range);
}

function signOut() {
  sessionStorage.removeItem(KEY_STORAGE);
  state.key = null;
  state.me = null;
  for (const chart of Object.values(state.charts)) chart.destroy();
  state.charts = {};
  $("api-key").value = "";
  showSignIn("");
}

async function setupTenantFilter() {
  const label = $("tenant-filter");
  const select = $("tenant-select");
  label.hidden = true;
  while (select.options.length > 1) select.remove(1);
  if (!state.me.operator || state.me.auth === "off") return;
  try {
    const tenants = await api("/v1/tenants");
    for (const t of tenants.data) select.add(new Option(t.name, t.name));
    label.hidden = false;
  } catch (err) {
    showBoardError(`Could not list tenants: ${err.message}`);
  }
}

// ---- data -----------------------------------------------------------------------------

function window_() {
  const r = RANGES[state.range];
  const now = Math.floor(Date.now() / 1000);
  const first = Math.floor(now / r.seconds) * r.seconds - (r.buckets - 1) * r.seconds;
  return { start: first, end: now + 1, ...r };
}

async function load() {
  if (state.loading) {
    // What is in flight was asked for another range or tenant, maybe: ask again after it.
    state.reloadAfter = true;
    return;
  }
  state.loading = true;
  const w = window_();
  const asked = { range: state.range, tenant: state.tenant };
  const common = { start_time: w.start, end_time: w.end, tenant: asked.tenant };
  const usage = { ...common, bucket_width: w.width, limit: w.buckets };
  try {
    const [series, byDeployment, byKey, summary] = await Promise.all([
      api("/v1/usage", usage),
      api("/v1/usage", { ...usage, group_by: "model" }),
      api("/v1/usage", { ...usage, group_by: "api_key" }),
      api("/v1/usage/summary", common),
    ]);
    state.data = { window: w, ...asked, series, byDeployment, byKey, summary };
    draw(state.data);
    showBoardError("");
    $("updated").textContent = `updated ${new Date().toLocaleTimeString()}`;
    $("board").dataset.loaded = String(Date.now());
  } catch (err) {
    if (err.status === 401) {
      signOut();
      showSignIn(`Signed out: ${err.message}`);
    } else {
      showBoardError(`Could not load usage: ${err.message}`);
    }
  } finally {
    state.loading = false;
  }
  if (state.reloadAfter && state.me) {
    state.reloadAfter = false;
    load();
  }
}

function showBoardError(message) {
  const el = $("board-error");
  el.textContent = message;
  el.hidden = !message;
}

function sumResults(page, keyOf) {
  // Sums each group's results over the page's buckets.
  const groups = new Map();
  let currency = null;
  for (const bucket of page.data) {
    for (const r of bucket.results) {
      const key = keyOf(r);
      const g = groups.get(key) || { name: key, input: 0, cached: 0, output: 0, requests: 0, costMicros: null };
      g.input += r.input_tokens;
      g.cached += r.input_cached_tokens;
      g.output += r.output_tokens;
      g.requests += r.num_model_requests;
      if (r.cost_micros !== null) {
        g.costMicros = (g.costMicros || 0) + r.cost_micros;
        currency = r.cost.currency;
      }
      groups.set(key, g);
    }
  }
  return { groups: [...groups.values()], currency };
}

// ---- drawing --------------------------------------------------------------------------

function chart(id, config) {
  const existing = state.charts[id];
  if (existing) {
    existing.data = config.data;
    existing.options = config.options;
    existing.update("none");
    return existing;
  }
  const created = new Chart($(id), config);
  state.charts[id] = created;
  return created;
}

function baseOptions(extra = {}) {
  return {
    responsive: true,
    maintainAspectRatio: false,
    animation: false,
    plugins: { legend: { position: "bottom", labels: { boxWidth: 12 } } },
    ...extra,
  };
}

function countAxis(stacked = false) {
  return { stacked, beginAtZero: true, ticks: { callback: (v) => formatCount(v) } };
}

function draw(d) {
  const totals = sumResults(d.series, () => "all");
  const all = totals.groups[0] || { input: 0, cached: 0, output: 0, requests: 0, costMicros: null };
  const currency = totals.currency;
  setKpi("kpi-requests", all.requests, formatCount(all.requests));
  setKpi("kpi-input", all.input, formatCount(all.input));
  setKpi("kpi-cached", all.cached, formatCount(all.cached));
  setKpi("kpi-output", all.output, formatCount(all.output));
  setKpi("kpi-cost", all.costMicros === null ? "" : all.costMicros, formatMoney(all.costMicros, currency));

  drawSeries(d, currency);
  drawTop("chart-top-deployments", "table-top-deployments",
    sumResults(d.byDeployment, (r) => r.model), currency);
  drawTop("chart-top-keys", "table-top-keys",
    sumResults(d.byKey, (r) => r.api_key_id || "no key"), currency);
  drawStatus(d.summary);
  drawLatency(d.summary);
  drawReplicas(d);
  drawColdStarts(d);
  drawDeployments(d.summary);
  drawVersions(d.summary);
}

function setKpi(id, raw, text) {
  const el = $(id);
  el.textContent = text;
  el.dataset.value = String(raw);
}

function drawSeries(d, currency) {
  const labels = d.series.data.map((b) => formatTime(b.start_time, d.window.width));
  const bucketSum = (b, f) => b.results.reduce((s, r) => s + f(r), 0);
  const input = d.series.data.map((b) => bucketSum(b, (r) => r.input_tokens - r.input_cached_tokens));
  const cached = d.series.data.map((b) => bucketSum(b, (r) => r.input_cached_tokens));
  const output = d.series.data.map((b) => bucketSum(b, (r) => r.output_tokens));
  chart("chart-tokens", {
    type: "bar",
    data: {
      labels,
      datasets: [
        { label: "input (not cached)", data: input, backgroundColor: "#2563eb", stack: "t" },
        { label: "cached input", data: cached, backgroundColor: "#93c5fd", stack: "t" },
        { label: "output", data: output, backgroundColor: "#16a34a", stack: "t" },
      ],
    },
    options: baseOptions({
      scales: { x: { stacked: true }, y: countAxis(true) },
      plugins: {
        legend: { position: "bottom" },
        tooltip: { callbacks: { label: (c) => `${c.dataset.label}: ${formatCount(c.raw)} tokens` } },
      },
    }),
  });
  const cost = d.series.data.map((b) => bucketSum(b, (r) => r.cost_micros || 0) / 1e6);
  chart("chart-cost", {
    type: "line",
    data: {
      labels,
      datasets: [{ label: currency ? `cost (${currency})` : "cost (no prices set)", data: cost,
        borderColor: "#7c3aed", backgroundColor: "rgba(124,58,237,0.15)", fill: true, stepped: false,
        pointRadius: 0 }],
    },
    options: baseOptions({
      scales: { y: { beginAtZero: true, ticks: { callback: (v) => formatMoneyTick(v, currency || "USD") } } },
      plugins: {
        legend: { position: "bottom" },
        tooltip: { callbacks: { label: (c) => formatMoney(Math.round(c.raw * 1e6), currency || "USD") } },
      },
    }),
  });
}

const tokensOf = (g) => g.input + g.output;
const byTokens = (a, b) => tokensOf(b) - tokensOf(a);
// A group with no price (its deployment's is not set) after those with one; ties by tokens.
const byCost = (a, b) => (b.costMicros ?? -1) - (a.costMicros ?? -1) || byTokens(a, b);

function drawTop(chartId, tableId, summed, currency) {
  const top = [...summed.groups].sort(byTokens).slice(0, 8);
  chart(chartId, {
    type: "bar",
    data: {
      labels: top.map((g) => g.name),
      datasets: [
        { label: "input", data: top.map((g) => g.input), backgroundColor: "#2563eb", stack: "t" },
        { label: "output", data: top.map((g) => g.output), backgroundColor: "#16a34a", stack: "t" },
      ],
    },
    options: baseOptions({ indexAxis: "y", scales: { x: countAxis(true), y: { stacked: true } } }),
  });
  // With prices the table ranks by cost. With none, a column of dashes would rank nothing:
  // it ranks by tokens, what cost follows, and says how to set prices.
  const priced = summed.groups.some((g) => g.costMicros !== null);
  const ranked = [...summed.groups].sort(priced ? byCost : byTokens).slice(0, 8);
  const table = $(tableId);
  table.replaceChildren();
  const columns = [[priced ? "By cost" : "By tokens", ""], ["Requests", "num"], ["Tokens", "num"]];
  if (priced) columns.push(["Cost", "num"]);
  const head = table.createTHead().insertRow();
  for (const [text, cls] of columns) {
    const th = document.createElement("th");
    th.textContent = text;
    if (cls) th.className = cls;
    head.appendChild(th);
  }
  const body = table.createTBody();
  for (const g of ranked) {
    const row = body.insertRow();
    row.dataset.name = g.name;
    row.dataset.tokens = String(tokensOf(g));
    row.dataset.costMicros = g.costMicros === null ? "" : String(g.costMicros);
    cell(row, g.name);
    cell(row, formatCount(g.requests), "num");
    cell(row, formatCount(tokensOf(g)), "num");
    if (priced) cell(row, formatMoney(g.costMicros, currency), "num");
  }
  if (!priced && ranked.length) {
    // The README's "Usage, prices and cost" says more; the page cannot link to it (the
    // control plane does not serve it), so it names the command and the API.
    const code = (text) => Object.assign(document.createElement("code"), { textContent: text });
    table.createCaption().append("No prices are set, so this ranks by tokens. An admin sets "
      + "them with ", code("hotpool prices set"), " or ", code("POST /v1/prices"), ".");
  }
}

function cell(row, text, cls) {
  const td = row.insertCell();
  td.textContent = text;
  if (cls) td.className = cls;
  return td;
}

function drawStatus(summary) {
  const statuses = Object.keys(summary.requests);
  chart("chart-status", {
    type: "doughnut",
    data: {
      labels: statuses,
      datasets: [{ data: statuses.map((s) => summary.requests[s]),
        backgroundColor: statuses.map((s) => STATUS_COLORS[s] || "#6b7280") }],
    },
    options: baseOptions({ plugins: { legend: { position: "right" } } }),
  });
}

function drawLatency(summary) {
  const rows = summary.deployments.filter((d) => d.ttft_seconds.p50 !== null || d.total_seconds.p50 !== null);
  const series = [
    ["TTFT p50", (d) => d.ttft_seconds.p50, "#93c5fd"],
    ["TTFT p95", (d) => d.ttft_seconds.p95, "#2563eb"],
    ["total p50", (d) => d.total_seconds.p50, "#86efac"],
    ["total p95", (d) => d.total_seconds.p95, "#16a34a"],
  ];
  const datasets = series.map(([label, f, color]) => ({ label, data: rows.map(f), backgroundColor: color }));
  chart("chart-latency", {
    type: "bar",
    data: { labels: rows.map((d) => d.name), datasets },
    options: baseOptions({
      scales: { y: latencyAxis(datasets.flatMap((d) => d.data)) },
      plugins: {
        legend: { position: "bottom" },
        tooltip: { callbacks: { label: (c) => `${c.dataset.label}: ${formatSeconds(c.raw)}` } },
      },
    }),
  });
}

// Logarithmic: on a linear axis one request 100x slower than the rest leaves every other
// bar a pixel high. The bars rise from a decade below the fastest one's, so it keeps a
// height too (a log axis has no zero to start from).
function latencyAxis(values) {
  const positive = values.filter((v) => v > 0);
  const fastest = positive.length ? Math.min(...positive) : 0.1;
  return {
    type: "logarithmic",
    min: 10 ** (Math.floor(Math.log10(fastest)) - 1),
    ticks: { callback: (v) => formatSecondsTick(v) },
  };
}

function formatSecondsTick(v) {
  // 1, 2 and 5 of each decade: the other ticks of a log axis would crowd it.
  const mantissa = Math.round(v / 10 ** Math.floor(Math.log10(v)));
  if (![1, 2, 5].includes(mantissa)) return "";
  return v < 1 ? `${+(v * 1000).toPrecision(3)} ms` : `${+v.toPrecision(3)} s`;
}

function drawReplicas(d) {
  // A stepped line per deployment: its replica count after each scale event, starting from
  // the count before the first event in range and ending at the count now.
  const events = d.summary.scale_events;
  const names = [...new Set(events.map((e) => e.deployment))].sort();
  const labels = d.series.data.map((b) => b.start_time);
  const datasets = names.map((name, i) => {
    const mine = events.filter((e) => e.deployment === name);
    let count = mine.length ? mine[0].from_replicas : 0;
    let next = 0;
    const data = labels.map((start) => {
      const end = start + d.window.seconds;
      let peak = count;
      while (next < mine.length && mine[next].created_at < end) {
        count = mine[next].to_replicas;
        peak = Math.max(peak, count);
        next += 1;
      }
      return peak; // the most replicas the bucket saw: a short burst stays visible
    });
    return { label: name, data, stepped: true, borderColor: PALETTE[i % PALETTE.length],
      backgroundColor: PALETTE[i % PALETTE.length], pointRadius: 0 };
  });
  chart("chart-replicas", {
    type: "line",
    data: { labels: labels.map((t) => formatTime(t, d.window.width)), datasets },
    options: baseOptions({ scales: { y: { beginAtZero: true, ticks: { precision: 0 } } } }),
  });
}

function drawColdStarts(d) {
  const starts = d.summary.scale_events.filter((e) => e.cold_start_seconds !== null).slice(-30);
  const phases = [...new Set(starts.flatMap((e) => Object.keys(e.phases || {})))]
    .sort((a, b) => rank(a) - rank(b));
  const labels = starts.map((e) => `${e.deployment} ${formatTime(e.created_at, "1m")}`);
  const datasets = phases.map((phase, i) => ({
    label: phase,
    data: starts.map((e) => (e.phases && e.phases[phase]) || 0),
    backgroundColor: PALETTE[i % PALETTE.length],
    stack: "phases",
  }));
  // Cold starts without a phase breakdown still show their total.
  if (starts.some((e) => !e.phases)) {
    datasets.push({ label: "total (no phases)", data: starts.map((e) => (e.phases ? 0 : e.cold_start_seconds)),
      backgroundColor: "#9ca3af", stack: "phases" });
  }
  chart("chart-cold-starts", {
    type: "bar",
    data: { labels, datasets },
    options: baseOptions({
      scales: { x: { stacked: true }, y: { stacked: true, beginAtZero: true, ticks: { callback: (v) => formatSeconds(v) } } },
      plugins: {
        legend: { position: "bottom" },
        tooltip: { callbacks: { label: (c) => `${c.dataset.label}: ${formatSeconds(c.raw)}` } },
      },
    }),
  });
}

function rank(phase) {
  const i = PHASE_ORDER.indexOf(phase);
  return i < 0 ? PHASE_ORDER.length : i;
}

function deploymentState(d) {
  if (!d.live) return "deleted";
  const r = d.replicas;
  if (r.ready > 0) return "ready";
  if (r.queued + r.cold + r.loading > 0) return "starting";
  if (r.draining > 0) return "draining";
  return "scaled to zero";
}

// Speculative decoding beside the deployment: its method and k, the share of proposed tokens
// its replicas accepted, and "off" while the automatic switch has it off on all the ready
// ones. The counts outlive the replicas (the control plane keeps the last ones of those that
// went), so a deployment scaled to zero still shows the rate it had.
function formatSpeculation(s) {
  if (!s) return "–";
  const what = `${s.method} k=${s.num_tokens}`;
  if (s.acceptance_rate === null) return s.replicas ? `${what} · no proposals yet` : what;
  const off = s.replicas && s.enabled_replicas === 0 ? ", off under load" : "";
  return `${what} · ${Math.round(100 * s.acceptance_rate)}% accepted${off}`;
}

function drawDeployments(summary) {
  $("table-deployments").classList.toggle("all-tenants", summary.tenant === null && state.me.operator);
  const showTenant = state.me.operator && state.me.auth !== "off";
  for (const th of document.querySelectorAll(".tenant-col")) th.hidden = !showTenant;
  const body = $("table-deployments").tBodies[0];
  body.replaceChildren();
  for (const d of summary.deployments) {
    const row = body.insertRow();
    row.dataset.name = d.name;
    const r = d.replicas;
    const requests = Object.values(d.requests).reduce((a, b) => a + b, 0);
    cell(row, d.name);
    const tenantCell = cell(row, d.tenant || "–");
    tenantCell.hidden = !showTenant;
    cell(row, deploymentState(d));
    cell(row, `${r.cold + r.queued} / ${r.loading} / ${r.ready} / ${r.draining}`);
    cell(row, d.live ? `${d.min_replicas}–${d.max_replicas}` : "–");
    cell(row, formatCount(requests), "num");
    cell(row, formatCount(d.requests.error + d.requests.partial), "num");
    cell(row, formatAgo(d.last_request_at));
    // How its replicas hold the linear weights: dense, int8 or the GGUF's own blocks.
    cell(row, !d.live ? "–" : d.quantization === "none" ? "dense" : d.quantization);
    cell(row, formatSpeculation(d.speculation));
  }
}

function drawVersions(summary) {
  // While a canary runs: each version's requests, errors, latency and tokens, side by side.
  const rows = summary.deployments.filter((d) => d.versions).flatMap((d) =>
    d.versions.map((v) => ({ name: d.name, ...v })));
  $("panel-versions").hidden = rows.length === 0;
  const body = $("table-versions").tBodies[0];
  body.replaceChildren();
  for (const v of rows) {
    const row = body.insertRow();
    row.dataset.name = v.name;
    row.dataset.version = String(v.version);
    const requests = Object.values(v.requests).reduce((a, b) => a + b, 0);
    const errors = v.requests.error + v.requests.partial;
    row.dataset.requests = String(requests);
    row.dataset.errors = String(errors);
    row.dataset.tokens = String(v.input_tokens + v.output_tokens);
    cell(row, v.name);
    cell(row, `v${v.version}`);
    cell(row, v.role || "draining");
    cell(row, `${v.traffic_percent.toFixed(v.traffic_percent % 1 ? 1 : 0)}%`, "num");
    cell(row, String(v.replicas), "num");
    cell(row, formatCount(requests), "num");
    cell(row, requests ? `${formatCount(errors)} (${((100 * errors) / requests).toFixed(1)}%)` : "0", "num");
    cell(row, formatSeconds(v.ttft_seconds.p50), "num");
    cell(row, formatSeconds(v.ttft_seconds.p95), "num");
    cell(row, formatCount(v.input_tokens + v.output_tokens), "num");
  }
}

// ---- controls -------------------------------------------------------------------------

function selectRange(range) {
  if (!RANGES[range]) range = "24h";
  state.range = range;
  localStorage.setItem(RANGE_STORAGE, range);
  for (const b of document.querySelectorAll("[data-range]")) {
    b.classList.toggle("active", b.dataset.range === range);
  }
  startRefresh();
}

function startRefresh() {
  stopRefresh();
  load();
  state.timer = setInterval(() => {
    if (!document.hidden && !state.loading) load(); // a tick during a slow load waits for the next
  }, REFRESH_MS);
}

function stopRefresh() {
  state.reloadAfter = false;
  if (state.timer !== null) clearInterval(state.timer);
  state.timer = null;
}

document.addEventListener("DOMContentLoaded", () => {
  $("sign-in-form").addEventListener("submit", (event) => {
    event.preventDefault();
    const key = $("api-key").value.trim();
    if (!key) {
      showSignIn("Paste an API key first.");
      return;
    }
    signIn(key);
  });
  $("sign-out").addEventListener("click", signOut);
  for (const b of document.querySelectorAll("[data-range]")) {
    b.addEventListener("click", () => selectRange(b.dataset.range));
  }
  $("tenant-select").addEventListener("change", (event) => {
    state.tenant = event.target.value;
    startRefresh();
  });
  // A key kept from earlier in this tab, or none: local-only mode needs none.
  signIn(state.key);
});
