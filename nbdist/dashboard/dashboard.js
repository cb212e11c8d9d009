// nbdist live dashboard: per-rank state table with memory bars, metric-vs-step and memory-vs-time
// charts on <canvas>. Plain ESM with no imports (works offline); the kernel sends a JSON `view`
// plus one float32 buffer `points` of interleaved (x, y) pairs, already downsampled.

const STATE_COLORS = { running: "#2e9e44", idle: "#8a8a8a", stale: "#d08700", dead: "#d0312d", waiting: "#8a8a8a" };
const UNITS = [["TiB", 2 ** 40], ["GiB", 2 ** 30], ["MiB", 2 ** 20], ["KiB", 2 ** 10]];

function formatBytes(value) {
  if (value == null || !isFinite(value)) return "–";
  for (const [unit, size] of UNITS) {
    if (Math.abs(value) >= size) {
      const scaled = value / size;
      return `${scaled < 10 ? scaled.toFixed(2) : scaled < 100 ? scaled.toFixed(1) : scaled.toFixed(0)} ${unit}`;
    }
  }
  return `${Math.round(value)} B`;
}

function formatNumber(value) {
  if (value == null) return "–";
  if (!isFinite(value)) return String(value);
  const m = Math.abs(value);
  if (m !== 0 && (m < 1e-3 || m >= 1e5)) return value.toPrecision(3);
  if (m >= 100) return value.toFixed(0);
  return String(Number(value.toPrecision(4)));
}

function formatMs(seconds) {
  if (seconds == null || !isFinite(seconds)) return "–";
  return seconds >= 0.01 ? `${(seconds * 1e3).toFixed(0)} ms` : `${(seconds * 1e3).toFixed(1)} ms`;
}

function describeStragglers(s) {
  // worded as nbdist/dashboard/stragglers.describe words it for the static SVG
  if (!s || !s.last) return "stragglers: no collective seen by every rank yet";
  if (s.flagged != null) {
    return `straggler: rank ${s.flagged} arrived last, ${formatMs(s.flagged_late)} late (last in ${s.late_collectives} of the last ${s.collectives} collectives)`;
  }
  return `no straggler: at the last collective (${s.last.name}) rank ${s.last.rank} arrived last by ${formatMs(s.last.late)}`;
}

function niceTicks(low, high, count) {
  if (!(isFinite(low) && isFinite(high)) || high <= low) return [low];
  const raw = (high - low) / count;
  const power = 10 ** Math.floor(Math.log10(raw));
  const step = [1, 2, 2.5, 5, 10].map((m) => m * power).find((s) => s >= raw);
  const ticks = [];
  for (let v = Math.ceil(low / step) * step; v <= high + step * 1e-9; v += step) ticks.push(+v.toPrecision(12));
  return ticks;
}

function floatsOf(value) {
  // ipywidgets hands binary traits over as DataView; the offset may not be 4-aligned, so copy
  if (!value) return new Float32Array(0);
  if (value instanceof Float32Array) return value;
  const buffer = value.buffer ?? value;
  const offset = value.byteOffset ?? 0;
  const length = value.byteLength ?? buffer.byteLength;
  if (offset % 4 === 0) return new Float32Array(buffer, offset, Math.floor(length / 4));
  return new Float32Array(buffer.slice(offset, offset + length));
}

function cssColor(ctx, color) {
  // normalise any CSS colour (var() resolved by getComputedStyle) to rgb for luminance
  ctx.fillStyle = "#000";
  ctx.fillStyle = color;
  const c = ctx.fillStyle;
  if (c.startsWith("#")) return [1, 3, 5].map((i) => parseInt(c.slice(i, i + 2), 16));
  const m = c.match(/[\d.]+/g);
  return m ? m.slice(0, 3).map(Number) : [255, 255, 255];
}

function themeOf(el, model, ctx) {
  const style = getComputedStyle(el);
  const v = (name, fallback) => style.getPropertyValue(name).trim() || fallback;
  let mode = model.get("theme");
  const jpBackground = style.getPropertyValue("--jp-layout-color0").trim();
  if (mode !== "light" && mode !== "dark") {
    if (jpBackground) {
      const [r, g, b] = cssColor(ctx, jpBackground);
      mode = 0.2126 * r + 0.7152 * g + 0.0722 * b < 128 ? "dark" : "light";
    } else {
      mode = globalThis.matchMedia?.("(prefers-color-scheme: dark)").matches ? "dark" : "light";
    }
  }
  const dark = mode === "dark";
  return {
    mode,
    background: v("--jp-layout-color0", dark ? "#111111" : "#ffffff"),
    foreground: v("--jp-ui-font-color1", dark ? "#e6e6e6" : "#1f1f1f"),
    muted: v("--jp-ui-font-color2", dark ? "#a0a0a0" : "#6a6a6a"),
    grid: v("--jp-border-color2", dark ? "#333333" : "#e4e4e4"),
    axis: v("--jp-border-color1", dark ? "#555555" : "#bdbdbd"),
    font: v("--jp-ui-font-family", "system-ui, -apple-system, 'Segoe UI', sans-serif"),
  };
}

function el_(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text != null) node.textContent = text;
  return node;
}

function drawChart(canvas, theme, lines, options) {
  // lines: [{color, dash, x: Float32Array-ish view, y, count}]; returns points drawn
  const dpr = globalThis.devicePixelRatio || 1;
  const width = Math.max(200, canvas.clientWidth || 400);
  const height = Math.max(120, canvas.clientHeight || 220);
  if (canvas.width !== Math.round(width * dpr) || canvas.height !== Math.round(height * dpr)) {
    canvas.width = Math.round(width * dpr);
    canvas.height = Math.round(height * dpr);
  }
  const ctx = canvas.getContext("2d");
  ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
  ctx.clearRect(0, 0, width, height);
  ctx.font = `11px ${theme.font}`;
  const left = 58, right = 10, top = 8, bottom = 26;
  const plotW = width - left - right, plotH = height - top - bottom;
  const log = options.log;
  let xmin = Infinity, xmax = -Infinity, ymin = Infinity, ymax = -Infinity, maxX = -Infinity;
  for (const line of lines) {
    const p = line.points;
    for (let i = 0; i < line.count; i++) {
      const x = p[2 * i], y = p[2 * i + 1];
      if (!isFinite(x) || !isFinite(y) || (log && y <= 0)) continue;
      if (x < xmin) xmin = x;
      if (x > xmax) xmax = x;
      if (y < ymin) ymin = y;
      if (y > ymax) ymax = y;
    }
  }
  ctx.strokeStyle = theme.axis;
  ctx.lineWidth = 1;
  ctx.beginPath();
  ctx.moveTo(left, top + plotH + 0.5);
  ctx.lineTo(left + plotW, top + plotH + 0.5);
  ctx.stroke();
  if (!isFinite(xmin)) {
    ctx.fillStyle = theme.muted;
    ctx.fillText("no data yet", left + 8, top + plotH / 2);
    canvas.dataset.points = "0";
    canvas.dataset.maxX = "";
    return 0;
  }
  maxX = xmax;
  if (xmax === xmin) { xmax = xmin + 1; }
  if (ymax === ymin) {
    const pad = Math.abs(ymax) * 0.05 || 1;
    if (log) { ymin /= 2; ymax *= 2; } else { ymin -= pad; ymax += pad; }
  }
  if (!log && ymin >= 0 && ymin < 0.25 * ymax) ymin = 0;
  const ty = log ? (y) => Math.log10(y) : (y) => y;
  const y0 = ty(ymin), y1 = ty(ymax);
  const sx = (x) => left + ((x - xmin) / (xmax - xmin)) * plotW;
  const sy = (y) => top + plotH - ((ty(y) - y0) / (y1 - y0)) * plotH;
  // grid + y labels
  let yTicks;
  if (log) {
    yTicks = [];
    for (let e = Math.floor(y0); e <= Math.ceil(y1); e++) if (10 ** e >= ymin && 10 ** e <= ymax) yTicks.push(10 ** e);
    if (yTicks.length < 2) yTicks = [ymin, ymax];
  } else {
    const unit = options.bytes ? (ymax >= 2 ** 30 ? 2 ** 30 : 2 ** 20) : 1;
    yTicks = niceTicks(ymin / unit, ymax / unit, 4).map((t) => t * unit);
  }
  ctx.textAlign = "right";
  ctx.textBaseline = "middle";
  for (const t of yTicks) {
    const py = Math.round(sy(t)) + 0.5;
    ctx.strokeStyle = theme.grid;
    ctx.beginPath();
    ctx.moveTo(left, py);
    ctx.lineTo(left + plotW, py);
    ctx.stroke();
    ctx.fillStyle = theme.muted;
    ctx.fillText(options.bytes ? formatBytes(t) : formatNumber(t), left - 6, py);
  }
  ctx.textAlign = "center";
  ctx.textBaseline = "top";
  for (const t of niceTicks(xmin, xmax, Math.max(2, Math.floor(plotW / 90)))) {
    ctx.fillText(formatNumber(t), sx(t), top + plotH + 6);
  }
  // lines: a NaN (segment break) or an unplottable point lifts the pen
  let drawn = 0;
  ctx.save();
  ctx.beginPath();
  ctx.rect(left, top - 2, plotW + 2, plotH + 4);
  ctx.clip();
  ctx.lineWidth = 1.5;
  ctx.lineJoin = "round";
  for (const line of lines) {
    const p = line.points;
    ctx.strokeStyle = line.color;
    ctx.globalAlpha = line.alpha ?? 1;
    ctx.setLineDash(line.dash);
    ctx.beginPath();
    let pen = false;
    for (let i = 0; i < line.count; i++) {
      const x = p[2 * i], y = p[2 * i + 1];
      if (!isFinite(x) || !isFinite(y) || (log && y <= 0)) { pen = false; continue; }
      const px = sx(x), py = sy(y);
      if (pen) ctx.lineTo(px, py); else ctx.moveTo(px, py);
      pen = true;
      drawn++;
    }
    ctx.stroke();
  }
  ctx.restore();
  canvas.dataset.points = String(drawn);
  canvas.dataset.maxX = String(maxX);
  return drawn;
}

function render({ model, el }) {
  const root = el_("div", "nbdist-dash");
  const header = el_("div", "nbd-header");
  const title = el_("span", "nbd-title", model.get("title") || "nbdist");
  const status = el_("span", "nbd-status");
  const controls = el_("span", "nbd-controls");
  const select = el_("select", "nbd-metric");
  select.title = "metric to plot";
  const logLabel = el_("label", "nbd-log");
  const logBox = el_("input");
  logBox.type = "checkbox";
  logLabel.append(logBox, document.createTextNode(" log y"));
  controls.append(select, logLabel);
  header.append(title, status, controls);
  const table = el_("table", "nbd-table");
  const stragglerLine = el_("div", "nbd-stragglers");
  const charts = el_("div", "nbd-charts");
  const metricBox = el_("div", "nbd-chart");
  const metricTitle = el_("div", "nbd-chart-title");
  const metricCanvas = el_("canvas", "nbd-canvas nbd-metric-canvas");
  metricBox.append(metricTitle, metricCanvas);
  const memoryBox = el_("div", "nbd-chart");
  const memoryTitle = el_("div", "nbd-chart-title", "memory per rank vs seconds (— allocated, - - reserved)");
  const memoryCanvas = el_("canvas", "nbd-canvas nbd-memory-canvas");
  memoryBox.append(memoryTitle, memoryCanvas);
  charts.append(metricBox, memoryBox);
  root.append(header, table, stragglerLine, charts);
  el.append(root);
  const probe = document.createElement("canvas").getContext("2d");

  let receivedAt = performance.now();
  let theme = themeOf(root, model, probe);

  function palette(rank) {
    const colors = (model.get("view").colors || {})[theme.mode] || ["#4e79a7"];
    return colors[rank % colors.length];
  }
  function dash(rank) {
    const colors = (model.get("view").colors || {}).light || [1];
    return [[], [6, 3], [2, 2], [8, 3, 2, 3]][Math.floor(rank / colors.length) % 4];
  }

  function currentMetric(view) {
    const chosen = model.get("metric");
    return view.metrics?.includes(chosen) ? chosen : view.metrics?.[0] ?? "";
  }

  function liveState(info, stale_after, elapsed) {
    // the kernel may be busy: age the last known state locally so "stale for N s" keeps counting
    if (info.state !== "running" && info.state !== "stale") return [info.state, info.detail || ""];
    const age = (info.age ?? 0) + elapsed;
    if (age > stale_after) return ["stale", `no telemetry for ${age.toFixed(0)} s`];
    if (info.silent != null) {
      const silent = info.silent + elapsed;
      if (silent > info.silent_limit) return ["stale", `no log() for ${silent.toFixed(0)} s`];
    }
    return ["running", ""];
  }

  function renderTable() {
    const view = model.get("view") || {};
    const ranks = view.ranks || [];
    const metric = currentMetric(view);
    const elapsed = (performance.now() - receivedAt) / 1000;
    const rows = [];
    const head = el_("tr");
    for (const h of ["rank", "state", "step", "steps/s", metric || "metric", "step time", "late by", "memory (allocated / reserved · peak · of capacity)"]) head.append(el_("th", "", h));
    const stragglers = view.stragglers || {};
    rows.push(head);
    const states = [];
    for (const info of ranks) {
      const tr = el_("tr", "nbd-rank");
      tr.dataset.rank = info.rank;
      const [state, detail] = liveState(info, view.stale_after ?? 5, elapsed);
      states.push(state);
      tr.dataset.state = state;
      if (stragglers.flagged === info.rank) tr.classList.add("nbd-straggler");
      tr.dataset.last = JSON.stringify(info.last || {}); // latest value per metric (tests, a11y tools)
      const swatch = el_("span", "nbd-swatch");
      swatch.style.background = palette(info.rank);
      const rankCell = el_("td");
      rankCell.append(swatch, document.createTextNode(` ${info.rank}`));
      const stateCell = el_("td", "nbd-state", state === "stale" ? detail.replace(/^no /, "stale: no ") : state);
      stateCell.style.color = STATE_COLORS[state] || theme.muted;
      if (detail) stateCell.title = detail;
      const memory = info.memory || {};
      const memCell = el_("td", "nbd-memcell");
      const bar = el_("div", "nbd-bar");
      const cap = memory.capacity || 0;
      const frac = (k) => (cap > 0 ? Math.max(0, Math.min(1, (memory[k] || 0) / cap)) * 100 : 0);
      const reserved = el_("div", "nbd-bar-reserved");
      reserved.style.width = `${frac("reserved")}%`;
      reserved.style.background = palette(info.rank);
      const allocated = el_("div", "nbd-bar-allocated");
      allocated.style.width = `${frac("allocated")}%`;
      allocated.style.background = palette(info.rank);
      const peak = el_("div", "nbd-bar-peak");
      peak.style.left = `${frac("peak")}%`;
      peak.style.background = palette(info.rank);
      bar.append(reserved, allocated, peak);
      bar.title = memory.kind === "cpu"
        ? "CPU: allocated = heap in use (mallinfo2), reserved = RSS, peak = RSS high-water mark this cell, capacity = RAM"
        : "CUDA: allocated / reserved by PyTorch's caching allocator, peak = max allocated this cell, capacity = device memory";
      const memText = el_("span", "nbd-memtext",
        `${formatBytes(memory.allocated)} / ${formatBytes(memory.reserved)} · peak ${formatBytes(memory.peak)} · of ${formatBytes(cap || null)}` +
        (memory.util != null ? ` · GPU ${memory.util}%` : ""));
      memCell.append(bar, memText);
      const last = info.last?.[metric];
      tr.append(rankCell, stateCell, el_("td", "nbd-num", formatNumber(info.step)),
        el_("td", "nbd-num", formatNumber(info.steps_per_s)), el_("td", "nbd-num", formatNumber(last)),
        el_("td", "nbd-num nbd-steptime", formatMs(info.step_time)), el_("td", "nbd-num nbd-lateby", formatMs(info.late_by)), memCell);
      if (info.wait_share != null) tr.lastChild.previousSibling.previousSibling.title = `${Math.round(info.wait_share * 100)} % of it waiting in collectives`;
      rows.push(tr);
    }
    table.replaceChildren(...rows);
    stragglerLine.textContent = describeStragglers(stragglers);
    stragglerLine.classList.toggle("nbd-flagged", stragglers.flagged != null);
    root.dataset.straggler = stragglers.flagged != null ? String(stragglers.flagged) : "";
    root.dataset.states = states.join(",");
    const cell = view.cell ? ` · cell ${view.cell}` : "";
    status.textContent = `${ranks.length} ranks${cell} · ${view.points ?? 0} points shown`;
  }

  function renderCharts() {
    const view = model.get("view") || {};
    const points = floatsOf(model.get("points"));
    const metric = currentMetric(view);
    const log = model.get("log_scale");
    const metricLines = [];
    const memoryLines = [];
    for (const s of view.series || []) {
      const slice = points.subarray(2 * s.offset, 2 * (s.offset + s.count));
      if (s.chart === "metric" && s.name === metric) {
        metricLines.push({ color: palette(s.rank), dash: dash(s.rank), points: slice, count: s.count });
      } else if (s.chart === "memory") {
        const reserved = s.name === "reserved";
        memoryLines.push({ color: palette(s.rank), dash: reserved ? [4, 3] : dash(s.rank), alpha: reserved ? 0.6 : 1, points: slice, count: s.count });
      }
    }
    metricTitle.textContent = `${metric || "metric"} per rank${log ? " (log)" : ""} vs step`;
    const drawn = drawChart(metricCanvas, theme, metricLines, { log });
    drawChart(memoryCanvas, theme, memoryLines, { log: false, bytes: true });
    root.dataset.metricPoints = String(drawn);
  }

  function syncControls() {
    const view = model.get("view") || {};
    const names = view.metrics || [];
    const metric = currentMetric(view);
    if (select.options.length !== names.length || [...select.options].some((o, i) => o.value !== names[i])) {
      select.replaceChildren(...names.map((n) => { const o = el_("option", "", n); o.value = n; return o; }));
    }
    select.value = metric;
    select.disabled = names.length === 0;
    logBox.checked = !!model.get("log_scale");
  }

  function draw() {
    const started = performance.now();
    theme = themeOf(root, model, probe);
    root.dataset.theme = theme.mode;
    syncControls();
    renderTable();
    renderCharts();
    const view = model.get("view") || {};
    root.dataset.revision = String(view.revision ?? 0);
    root.dataset.renderMs = (performance.now() - started).toFixed(2);
  }

  let frame = 0;
  function schedule() {
    // coalesce bursts of trait changes into one paint
    if (!frame) frame = requestAnimationFrame(() => { frame = 0; draw(); });
  }
  const onData = () => { receivedAt = performance.now(); schedule(); };
  model.on("change:view", onData);
  model.on("change:points", onData);
  model.on("change:log_scale", schedule);
  model.on("change:metric", schedule);
  model.on("change:theme", schedule);
  // the user's choices are applied here at once; the kernel learns them when it is next idle
  select.addEventListener("change", () => { model.set("metric", select.value); model.save_changes(); schedule(); });
  logBox.addEventListener("change", () => { model.set("log_scale", logBox.checked); model.save_changes(); schedule(); });
  const resize = typeof ResizeObserver === "function" ? new ResizeObserver(schedule) : null;
  resize?.observe(root);
  const ticker = setInterval(renderTable, 1000);
  draw();
  return () => {
    clearInterval(ticker);
    resize?.disconnect();
    if (frame) cancelAnimationFrame(frame);
    model.off("change:view", onData);
    model.off("change:points", onData);
    model.off("change:log_scale", schedule);
    model.off("change:metric", schedule);
    model.off("change:theme", schedule);
  };
}

export default { render };
