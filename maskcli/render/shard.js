// maskcli shard's page: the token -> rank strip, a table per mask (layer type) with each rank's work against the
// mean, each rank's ring steps as a grid coloured as `blocks` colours blocks, and the findings. The data is the JSON
// in #mask-data (maskcli/render/shardpage.py writes it: --json's report plus the strip's spans); text is set as
// text, never parsed as HTML. viridis() comes from attend.js: ranks are coloured as the --png figure colours them.
"use strict";

const DATA = JSON.parse(document.getElementById("mask-data").textContent);
const L = DATA.layout, N = L.ranks;
const STEP = { full: 0, partial: 1, empty: 2 }; // DATA.colours.blockTint's order (html.BLOCK_TINTS)
const MIXED_RGB = "rgb(150,150,150)", NONE_RGB = DATA.colours.severity.wrong;

function rankColour(r) { const [red, g, b] = viridis(N > 1 ? r / (N - 1) : 0); return `rgb(${red},${g},${b})`; }
const whole = (v) => Math.round(v).toLocaleString("en-US");
function number(v) { // as the terminal table writes FLOPs: three digits and a unit
  for (const [unit, size] of [["T", 1e12], ["G", 1e9], ["M", 1e6], ["k", 1e3]]) if (Math.abs(v) >= size) return `${Number((v / size).toPrecision(3))}${unit}`;
  return v.toFixed(0);
}
function make(tag, text, cls) { const el = document.createElement(tag); if (text !== undefined) el.textContent = text; if (cls) el.className = cls; return el; }
function swatch(colour, text) { const s = make("span", "", "swatch"); s.style.background = colour; return [s, document.createTextNode(text + " ")]; }
// canvas pixels under the mouse, whatever size CSS draws the canvas at
function at(canvas, ev) { const r = canvas.getBoundingClientRect(); return [(ev.clientX - r.left) * canvas.width / r.width, (ev.clientY - r.top) * canvas.height / r.height]; }

function drawStrip() {
  const canvas = document.getElementById("strip"), S = DATA.strip, count = S.owner.length;
  canvas.width = Math.max(count, Math.min(960, document.body.clientWidth - 40));
  const ctx = canvas.getContext("2d"), W = canvas.width, H = canvas.height, x = (p) => Math.round(p / L.length * W);
  for (let i = 0; i < count; i++) {
    ctx.fillStyle = S.mixed[i] ? MIXED_RGB : S.owner[i] < 0 ? NONE_RGB : rankColour(S.owner[i]);
    ctx.fillRect(x(S.edges[i]), 0, Math.max(1, x(S.edges[i + 1]) - x(S.edges[i])), H);
  }
  document.getElementById("strip-first").textContent = "0";
  document.getElementById("strip-last").textContent = whole(L.length - 1);
  const legend = document.getElementById("rank-legend");
  if (N <= 16) for (let r = 0; r < N; r++) legend.append(...swatch(rankColour(r), `rank ${r}`));
  else legend.append(...swatch(rankColour(0), "rank 0 …"), ...swatch(rankColour(N - 1), `rank ${N - 1}`));
  if (S.mixed.some(Boolean)) legend.append(...swatch(MIXED_RGB, "several ranks within the span"));
  if (S.owner.some((o) => o < 0)) legend.append(...swatch(NONE_RGB, "on no rank"));
  const out = document.getElementById("strip-cell");
  canvas.addEventListener("mousemove", (ev) => {
    const p = Math.min(L.length - 1, Math.max(0, Math.floor(at(canvas, ev)[0] / W * L.length)));
    let i = 0; while (i + 1 < count && S.edges[i + 1] <= p) i++;
    const a = S.edges[i], b = S.edges[i + 1] - 1, where = a === b ? `position ${whole(a)}` : `positions ${whole(a)}-${whole(b)}`;
    out.textContent = `${where}: ${S.mixed[i] ? "several ranks (stripes narrower than this span)" : S.owner[i] < 0 ? "on no rank" : `rank ${S.owner[i]}`}`;
  });
}

function rankTable(M, first) {
  const table = make("table", undefined, "ranks"), pad = L.slots.some((s, r) => s !== L.tokens[r]), steps = M.steps !== null;
  const columns = first ? DATA.columns : [];
  const heads = M.shape[1] > 1 || L.heads !== null; // as the terminal: cells times the heads a rank computes them for
  const names = ["rank", "tokens"].concat(pad ? ["pad"] : [], [heads ? "cells x heads" : "cells", "FLOPs", "x mean"], steps ? ["skip"] : [], columns.map((c) => c.name));
  const head = table.createTHead().insertRow();
  names.forEach((name, j) => head.append(make("th", name, j >= names.length - columns.length ? "list" : "")));
  const worst = Math.max(...M.ratio), uneven = M.imbalance > 1 + 1e-9, body = table.createTBody();
  for (let r = 0; r < N; r++) {
    const row = body.insertRow(), cells = [String(r), whole(L.tokens[r])];
    if (pad) cells.push(whole(L.slots[r] - L.tokens[r]));
    cells.push(whole(M.work[r]), number(M.flops[r]), M.ratio[r].toFixed(3));
    if (steps) cells.push(`${M.steps[r].filter((s) => s === "empty").length}/${N}`);
    for (const c of columns) cells.push(c.values[r].join(","));
    cells.forEach((text, j) => {
      const td = make("td", text, j >= names.length - columns.length ? "list" : "");
      if (names[j] === "x mean" && uneven && M.ratio[r] === worst) td.classList.add("worst");
      row.append(td);
    });
  }
  return table;
}

function imbalanceText(M) {
  const most = M.ratio.indexOf(Math.max(...M.ratio)), least = M.ratio.indexOf(Math.min(...M.ratio));
  const same = Math.max(...M.ratio) === Math.min(...M.ratio);
  return `imbalance (max / mean work) ${M.imbalance.toFixed(3)}: ` + (same ? "every rank does the same work" : `rank ${most} does the most, rank ${least} the least`);
}

function stepGrid(M, holder) {
  const canvas = make("canvas", undefined, "steps"), size = Math.max(2, Math.min(28, Math.floor(480 / N)));
  canvas.width = canvas.height = size * N;
  canvas.tabIndex = 0;
  canvas.setAttribute("aria-label", "each rank's ring steps: hover a step for its cells");
  const ctx = canvas.getContext("2d"), tint = DATA.colours.blockTint;
  for (let r = 0; r < N; r++) for (let i = 0; i < N; i++) {
    ctx.fillStyle = tint[STEP[M.steps[r][i]]];
    ctx.fillRect(i * size, r * size, size, size);
  }
  if (size >= 8) { // lines between the steps where they are wide enough to need them
    ctx.strokeStyle = "rgba(0, 0, 0, 0.25)"; ctx.beginPath();
    for (let k = 1; k < N; k++) { ctx.moveTo(k * size + 0.5, 0); ctx.lineTo(k * size + 0.5, N * size); ctx.moveTo(0, k * size + 0.5); ctx.lineTo(N * size, k * size + 0.5); }
    ctx.stroke();
  }
  const figure = make("figure"), caption = make("figcaption", "ring steps: a row per rank r, a column per step i (the keys of rank (r - i) mod N)");
  const legend = make("p", undefined, "legend"), out = make("pre", "hover a step for its cells", "step-cell");
  legend.append(...swatch(tint[0], "full"), ...swatch(tint[1], "partial"), ...swatch(tint[2], "empty: a step the rank may skip"));
  canvas.addEventListener("mousemove", (ev) => {
    const [x, y] = at(canvas, ev), i = Math.min(N - 1, Math.floor(x / size)), r = Math.min(N - 1, Math.floor(y / size)), s = ((r - i) % N + N) % N;
    const block = L.tokens[r] * L.tokens[s];
    out.textContent = `rank ${r}, step ${i}: the keys of rank ${s} · ${M.steps[r][i]}` +
      (M.grid ? ` · ${whole(M.grid[r][s])} of ${whole(block)} cells visible` : "");
  });
  figure.append(caption, canvas, legend, out);
  holder.append(figure);
}

function drawMasks() {
  const holder = document.getElementById("masks");
  DATA.masks.forEach((M, index) => {
    const section = make("div", undefined, "mask");
    const named = M.label === M.expression ? M.label : `${M.label} (${M.expression})`; // a layer type names its mask
    section.append(make("h2", DATA.masks.length > 1 ? named : `each rank's part of ${M.expression}`), rankTable(M, index === 0), make("p", imbalanceText(M)));
    if (M.steps !== null) stepGrid(M, section);
    else section.append(make("p", "ulysses: no ring steps; every rank attends over all tokens for its heads after an all-to-all"));
    holder.append(section);
  });
}

function drawFindings() {
  const list = document.getElementById("findings");
  for (const f of DATA.findings) {
    const item = make("li"), word = make("strong", f.severity);
    word.style.color = DATA.colours.severity[f.severity];
    item.append(word, document.createTextNode(`: ${f.code}: ${f.message}`));
    list.append(item);
  }
  if (!DATA.findings.some((f) => f.severity === "wrong")) list.append(make("li", "the ranks' parts add up to the global mask exactly", "fine"));
}

drawStrip();
drawMasks();
drawFindings();
window.__maskcliFirstDraw = performance.now();
