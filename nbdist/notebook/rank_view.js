// nbdist per-rank view: a chip and a row per rank (state, line count, last line; errors first)
// and a filter that shows the output of one rank or a group ("3", "0-3,7", "failed", "all").
// Plain ESM with no imports (works offline). The kernel sends `rows` (sorted) and `texts`
// (each rank's last lines); what the reader picked lives here, so updates never reset it.

const STATES = ["failed", "dead", "interrupted", "running", "finished"];

function parseFilter(text, rows) {
  const wanted = new Set();
  for (const part of text.toLowerCase().split(/[\s,]+/).filter(Boolean)) {
    if (part === "all") rows.forEach((r) => wanted.add(r.rank));
    else if (part === "errors") rows.filter((r) => STATES.indexOf(r.state) < 3).forEach((r) => wanted.add(r.rank));
    else if (STATES.includes(part)) rows.filter((r) => r.state === part).forEach((r) => wanted.add(r.rank));
    else {
      const m = part.match(/^(\d+)(?:-(\d+))?$/);
      if (!m) continue;
      const low = +m[1], high = m[2] === undefined ? low : +m[2];
      for (let r = low; r <= high && r - low < 4096; r++) wanted.add(r);
    }
  }
  return rows.map((r) => r.rank).filter((r) => wanted.has(r));
}

function el(tag, cls, text) {
  const node = document.createElement(tag);
  if (cls) node.className = cls;
  if (text !== undefined) node.textContent = text;
  return node;
}

function render({ model, el: root }) {
  root.classList.add("nbdist-ranks");
  const head = el("div", "nbr-head");
  const summary = el("span", "nbr-summary");
  const filter = el("input", "nbr-filter");
  filter.placeholder = "show ranks: 3 · 0-3,7 · errors · all";
  filter.title = "Ranks whose output to show: numbers and ranges (0-3,7), a state (failed, running, finished), errors or all";
  const buttons = el("span", "nbr-buttons");
  for (const label of ["errors", "all", "none"]) {
    const button = el("button", "nbr-button", label);
    button.addEventListener("click", () => { filter.value = label === "none" ? "" : label; draw(); });
    buttons.append(button);
  }
  head.append(summary, filter, buttons);
  const chips = el("div", "nbr-chips");
  const table = el("div", "nbr-table");
  const pane = el("div", "nbr-pane");
  root.append(head, chips, table, pane);
  let picked = null; // null: the reader has not chosen yet (errors are shown)

  function pick(rank, add) {
    const current = picked === null ? [] : parseFilter(filter.value, model.get("rows"));
    const next = add ? (current.includes(rank) ? current.filter((r) => r !== rank) : [...current, rank]) : [rank];
    filter.value = next.sort((a, b) => a - b).join(",");
    draw();
  }

  function draw() {
    const rows = model.get("rows") || [];
    const texts = model.get("texts") || {};
    summary.textContent = model.get("summary") || "";
    picked = filter.value.trim() ? parseFilter(filter.value, rows) : null;
    const shown = picked ?? parseFilter("errors", rows);
    root.dataset.selected = shown.join(",");
    root.dataset.states = rows.map((r) => `${r.rank}:${r.state}`).join(",");
    chips.replaceChildren(...rows.slice().sort((a, b) => a.rank - b.rank).map((r) => {
      const chip = el("button", `nbr-chip nbr-${r.state}${shown.includes(r.rank) ? " nbr-on" : ""}`, String(r.rank));
      chip.dataset.rank = r.rank;
      chip.title = `rank ${r.rank}: ${r.state}, ${r.lines} lines (shift-click adds it to the filter)`;
      chip.addEventListener("click", (e) => pick(r.rank, e.shiftKey || e.ctrlKey || e.metaKey));
      return chip;
    }));
    table.replaceChildren(...rows.map((r) => {
      const row = el("div", `nbr-row nbr-${r.state}`);
      row.dataset.rank = r.rank;
      row.append(el("span", "nbr-rank", `rank ${r.rank}`), el("span", "nbr-state", r.state),
        el("span", "nbr-lines", `${r.lines} lines`), el("span", "nbr-last", r.last));
      row.addEventListener("click", (e) => pick(r.rank, e.shiftKey || e.ctrlKey || e.metaKey));
      return row;
    }));
    pane.replaceChildren(...shown.map((rank) => {
      const row = rows.find((r) => r.rank === rank);
      const box = el("div", "nbr-out");
      box.dataset.rank = rank;
      box.append(el("div", "nbr-out-head", `── rank ${rank} (${row ? row.state : "?"}) ──`),
        el("pre", "nbr-text", texts[String(rank)] || "(no output)"));
      return box;
    }));
    if (!shown.length) pane.append(el("div", "nbr-hint", "pick a rank above (or type a filter) to read its output"));
  }

  filter.addEventListener("input", draw);
  model.on("change:rows", draw);
  model.on("change:texts", draw);
  model.on("change:summary", draw);
  draw();
}

export default { render };
