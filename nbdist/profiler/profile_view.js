// nbdist profile view: one row per rank (compute / wait / communication / idle), a mark where each
// collective's last rank arrived; wheel zooms around the pointer, drag pans, double-click resets.
// Plain ESM, no imports (works offline). The kernel sends `data` once (ProfileReport.view_data).

const SVG_NS = "http://www.w3.org/2000/svg";
const LEFT = 70, RIGHT = 36, ROW = 22, GAP = 8, TOP = 26;

function svgNode(tag, attrs, text) {
  const node = document.createElementNS(SVG_NS, tag);
  for (const [key, value] of Object.entries(attrs || {})) node.setAttribute(key, String(value));
  if (text != null) node.textContent = text;
  return node;
}

function formatUs(value) {
  const m = Math.abs(value);
  if (m >= 1e6) return `${(value / 1e6).toFixed(2)} s`;
  if (m >= 1e3) return `${(value / 1e3).toFixed(1)} ms`;
  return `${value.toFixed(0)} µs`;
}

function ticks(low, high, count) {
  const raw = (high - low) / count;
  if (!(raw > 0)) return [low];
  const power = 10 ** Math.floor(Math.log10(raw));
  const step = [1, 2, 2.5, 5, 10].map((m) => m * power).find((s) => s >= raw);
  const out = [];
  for (let v = Math.ceil(low / step) * step; v <= high; v += step) out.push(v);
  return out;
}

function hideStaticSibling(el) {
  // the SVG output displayed just before this view is what a saved notebook shows; while the
  // live view is up it would only repeat it
  const child = el.closest?.(".jp-OutputArea-child");
  const previous = child?.previousElementSibling;
  if (previous && previous.querySelector("img.nbdist-profile-img, svg.nbdist-profile-svg")) {
    previous.style.display = "none";
    return () => { previous.style.display = ""; };
  }
  return null;  // not in the page yet (Notebook 7 renders before attaching): tried again on draw
}

function render({ model, el }) {
  const data = model.get("data");
  const root = document.createElement("div");
  root.className = "nbdist-profile";
  root.style.cssText = "font: 12px var(--jp-ui-font-family, system-ui, sans-serif); color: var(--jp-ui-font-color1, #1f1f1f)";
  const legend = document.createElement("div");
  legend.className = "nbdist-profile-legend";
  for (const [index, kind] of data.kinds.entries()) {
    const swatch = document.createElement("span");
    swatch.style.cssText = `display:inline-block;width:10px;height:10px;margin:0 4px 0 10px;background:${data.colors[kind]}`;
    legend.append(swatch, document.createTextNode(kind));
    if (index === data.kinds.length - 1) legend.append(document.createTextNode("  ·  ▼ last rank into a collective · wheel: zoom · drag: pan · double-click: reset"));
  }
  const svg = svgNode("svg", { class: "nbdist-profile-timeline" });
  svg.style.cssText = "width:100%;display:block;user-select:none;cursor:grab";
  const info = document.createElement("div");
  info.className = "nbdist-profile-info";
  info.style.cssText = "min-height:1.4em;margin:2px 0 4px " + LEFT + "px;color:var(--jp-ui-font-color2,#6a6a6a)";
  const table = document.createElement("pre");
  table.className = "nbdist-profile-summary";
  table.style.cssText = "margin:6px 0 0;font-size:12px";
  table.textContent = data.summary;
  root.append(legend, svg, info, table);
  el.appendChild(root);

  const span = Math.max(data.span, 1);
  let view = [0, span];
  const height = TOP + data.rows.length * (ROW + GAP) + 18;
  svg.setAttribute("height", height);

  let restore = null;
  function draw() {
    restore = restore || hideStaticSibling(el);
    const width = Math.max(300, svg.clientWidth || el.clientWidth || 900);
    const plot = width - LEFT - RIGHT;
    const [t0, t1] = view;
    const x = (t) => LEFT + ((t - t0) / (t1 - t0)) * plot;
    svg.replaceChildren();
    svg.setAttribute("viewBox", `0 0 ${width} ${height}`);
    for (const tick of ticks(t0, t1, 6)) {
      svg.append(svgNode("line", { x1: x(tick), x2: x(tick), y1: TOP - 4, y2: height - 16, stroke: "#e4e4e4" }));
      svg.append(svgNode("text", { x: x(tick), y: height - 4, "text-anchor": "middle", fill: "#6a6a6a", "font-size": 11 }, formatUs(tick)));
    }
    const minWidth = (t1 - t0) / plot / 2;  // thinner than half a pixel: not drawn one by one
    data.rows.forEach((row, index) => {
      const y = TOP + index * (ROW + GAP);
      const group = svgNode("g", { class: "nbdist-profile-row", "data-rank": row.rank });
      group.append(svgNode("text", { x: 6, y: y + 15, fill: "currentColor" }, `rank ${row.rank}`));
      group.append(svgNode("rect", { x: x(Math.max(row.start, t0)), y, width: Math.max(0, x(Math.min(row.end, t1)) - x(Math.max(row.start, t0))), height: ROW, fill: data.colors.idle }));
      let drawn = 0;
      for (const [a, b, kind] of row.segments) {
        if (b < t0 || a > t1 || b - a < minWidth) continue;
        const left = x(Math.max(a, t0));
        group.append(svgNode("rect", { x: left, y, width: Math.max(0.5, x(Math.min(b, t1)) - left), height: ROW, fill: data.colors[data.kinds[kind]] }));
        drawn += 1;
      }
      group.dataset.segments = String(drawn);
      svg.append(group);
    });
    for (const c of data.collectives) {
      const ranks = Object.keys(c.arrivals);
      if (ranks.length < 2) continue;
      const lastArrival = c.arrivals[String(c.last)];
      if (lastArrival < t0 || lastArrival > t1) continue;
      const rowIndex = data.rows.findIndex((row) => row.rank === c.last);
      const y = TOP + Math.max(rowIndex, 0) * (ROW + GAP);
      const mark = svgNode("path", { d: `M${x(lastArrival)},${y - 1}l-5,-7h10z`, fill: "currentColor", class: "nbdist-profile-collective" });
      const waits = ranks.filter((r) => Number(r) !== c.last).map((r) => `rank ${r} waited ${formatUs(c.waits[r])}`).join(", ");
      const text = `${c.name} #${c.seq} (group ${c.group}): rank ${c.last} arrived last; ${waits}`;
      mark.append(svgNode("title", {}, text));
      mark.addEventListener("mouseenter", () => { info.textContent = text; });
      svg.append(mark);
    }
  }

  let drag = null;
  svg.addEventListener("wheel", (event) => {
    event.preventDefault();
    const rect = svg.getBoundingClientRect();
    const plot = rect.width - LEFT - RIGHT;
    const [t0, t1] = view;
    const at = t0 + Math.min(Math.max((event.clientX - rect.left - LEFT) / plot, 0), 1) * (t1 - t0);
    const factor = event.deltaY > 0 ? 1.25 : 0.8;
    const width = Math.min(span, Math.max((t1 - t0) * factor, 10));
    const start = Math.min(Math.max(at - (at - t0) * (width / (t1 - t0)), 0), span - width);
    view = [start, start + width];
    draw();
  }, { passive: false });
  svg.addEventListener("mousedown", (event) => { drag = { x: event.clientX, view: [...view] }; });
  const up = () => { drag = null; };
  const move = (event) => {
    if (!drag) return;
    const rect = svg.getBoundingClientRect();
    const width = drag.view[1] - drag.view[0];
    const shift = ((drag.x - event.clientX) / (rect.width - LEFT - RIGHT)) * width;
    const start = Math.min(Math.max(drag.view[0] + shift, 0), span - width);
    view = [start, start + width];
    draw();
  };
  globalThis.addEventListener("mouseup", up);
  globalThis.addEventListener("mousemove", move);
  svg.addEventListener("dblclick", () => { view = [0, span]; draw(); });
  const resize = new ResizeObserver(() => draw());
  resize.observe(svg);
  draw();
  root.dataset.rows = String(data.rows.length);
  return () => {
    resize.disconnect();
    globalThis.removeEventListener("mouseup", up);
    globalThis.removeEventListener("mousemove", move);
    if (restore) restore();
  };
}

export default { render };
