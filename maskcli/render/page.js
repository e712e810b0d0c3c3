// The page's viewer: draws a mask from its rows' key intervals, exactly at every zoom (a pixel that covers many cells
// shows the exact share of them kept; zoomed in, each cell is its own colour), with the structure marks, hover text
// and keyboard control. The data is the JSON in #mask-data (maskcli/render/pagedata.py writes it); why.js explains.
"use strict";

const DATA = JSON.parse(document.getElementById("mask-data").textContent);
const EVAL_CELLS = 512 * 512; // a view of at most this many cells is drawn cell by cell where rows were sampled
const MAX_PX = 64; // the deepest zoom: one cell this many pixels wide
const MIN_CELL = 32; // a short or narrow mask's rows (columns) are drawn at least this tall (wide), to hover
const NARROW = 760; // below this window width the hover panel goes under the map (page.css's media query)

function Rows(r) {
  this.n = r.n; this.k = r.k; this.stride = r.stride;
  this.a = decodeArray(r.a); this.s = decodeArray(r.s); this.e = decodeArray(r.e);
  this.ds = decodeArray(r.ds); this.de = decodeArray(r.de);
}
// The key intervals of local query row q, absolute, into S and E; returns how many.
Rows.prototype.row = function (q, S, E) {
  const r = Math.floor(q / this.stride), i = runIndex(this.a, r), d = r - this.a[i], k = this.k;
  let m = 0;
  for (let j = 0; j < k; j++) {
    const s = this.s[i * k + j] + this.ds[i * k + j] * d, e = this.e[i * k + j] + this.de[i * k + j] * d;
    if (e > s) { S[m] = s; E[m] = e; m++; }
  }
  return m;
};
function maskRows(M, b) {
  const i = Math.min(b, M.rows.length - 1);
  M.decodedRows = M.decodedRows || [];
  if (!M.decodedRows[i]) M.decodedRows[i] = new Rows(M.rows[i]);
  return M.decodedRows[i];
}
// Whether absolute (q, kv) is kept: from the explainer where rows were sampled, else from the row's intervals.
function keptAt(M, b, q, kv) {
  const rows = maskRows(M, b);
  if (rows.stride > 1 && M.tree) return keepAt(M, b, q, kv);
  const S = new Float64Array(rows.k), E = new Float64Array(rows.k), m = rows.row(q - M.frame.vq0, S, E);
  for (let j = 0; j < m; j++) if (S[j] <= kv && kv < E[j]) return true;
  return false;
}

// Per pixel, the [lo, hi) cells (local) it stands for: zoomed out, the cells whose centres fall in it; zoomed in,
// the one cell under its centre. Both monotone, so an interval's pixels are found by binary search.
function axisMap(n, origin, scale, pixels) {
  const lo = new Float64Array(pixels), hi = new Float64Array(pixels);
  const edge = (c) => Math.min(n, Math.max(0, Math.ceil(c / scale + origin - 0.5)));
  for (let c = 0; c < pixels; c++) {
    if (scale < 1) { lo[c] = edge(c); hi[c] = edge(c + 1); continue; }
    const k = Math.floor(origin + (c + 0.5) / scale);
    if (k >= 0 && k < n) { lo[c] = k; hi[c] = k + 1; } else { lo[c] = hi[c] = k < 0 ? 0 : n; }
  }
  return {lo: lo, hi: hi};
}
function firstAbove(a, x) { let lo = 0, hi = a.length; while (lo < hi) { const m = (lo + hi) >> 1; if (a[m] > x) hi = m; else lo = m + 1; } return lo; }
function lastBelow(a, x) { let lo = -1, hi = a.length - 1; while (lo < hi) { const m = (lo + hi + 1) >> 1; if (a[m] < x) lo = m; else hi = m - 1; } return lo; }

// Cells of [s, e) (local keys) on one row, added per pixel: ends exactly, whole pixels between by a difference array.
function addInterval(acc, full, X, s, e) {
  const a = firstAbove(X.hi, s), z = lastBelow(X.lo, e);
  if (a > z) return;
  if (a === z) { acc[a] += Math.max(0, Math.min(e, X.hi[a]) - Math.max(s, X.lo[a])); return; }
  acc[a] += Math.max(0, X.hi[a] - Math.max(s, X.lo[a]));
  acc[z] += Math.max(0, Math.min(e, X.hi[z]) - X.lo[z]);
  if (z > a + 1) { full[a + 1] += 1; full[z] -= 1; }
}

// The hover panel beside the map scrolls within the window's height (below a narrow window's map, it need not).
function fitPanel() {
  const panel = document.querySelector("aside .scroll"), bottom = parseFloat(getComputedStyle(document.body).paddingBottom) + 4;
  const room = window.innerHeight - panel.getBoundingClientRect().top - window.scrollY - bottom;
  panel.style.maxHeight = window.innerWidth < NARROW ? "" : `${Math.max(160, room)}px`;
}

// The canvas's size in pixels for lq x lk cells: the room the window leaves beside the hover panel and below the
// header (so that the map and the panel need no scrolling), square cells; where that leaves over half the room
// empty across a short (narrow) mask, its rows (columns) are stretched to MIN_CELL pixels, up to the room there is.
function fitCanvas(canvas, lq, lk) {
  const main = document.querySelector("main"), side = canvas.getBoundingClientRect().left - main.getBoundingClientRect().left;
  const rem = parseFloat(getComputedStyle(document.documentElement).fontSize), narrow = window.innerWidth < NARROW;
  const aside = narrow ? 0 : 19.25 * rem, bottom = parseFloat(getComputedStyle(document.body).paddingBottom) + 4; // page.css: 18rem + gap
  fitPanel();
  const roomW = Math.max(120, main.clientWidth - side - aside - 4); // less the canvas's border
  const strip = document.getElementById("marks-k").offsetHeight;
  let roomH = Math.max(120, window.innerHeight - (canvas.getBoundingClientRect().top + window.scrollY) - strip - bottom - 2);
  if (narrow) roomH = Math.min(roomH, Math.round(window.innerHeight * 0.6)); // leave the panel below in sight
  const s = Math.min(roomW / lk, roomH / lq, MAX_PX), W = lk * s, H = lq * s;
  return [Math.round(W < roomW / 2 ? Math.max(W, Math.min(roomW, lk * MIN_CELL)) : W),
          Math.round(H < roomH / 2 ? Math.max(H, Math.min(roomH, lq * MIN_CELL)) : H)];
}

// A ruler's ticks: absolute positions at round steps (1, 2, 5 x 10^k) at least minPx apart, each at its cell's centre,
// as DOM elements (data-pos: the position; the ruler's data-step: the step), so that they read back exactly.
function tickText(t, step) { // 200k, 1M where the step is in thousands (millions), else the whole number
  if (step % 1000 === 0 && t !== 0 && t % 1e6 === 0) return `${t / 1e6}M`;
  if (step % 1000 === 0 && t !== 0) return `${t / 1000}k`;
  return String(t);
}
function ruler(el, first, count, origin, scale, length, vertical) {
  const chars = String(first + count - 1).length;
  const minPx = vertical ? 22 : Math.max(26, 7 * chars + 14);
  let step = 0;
  for (let p = 1; !step; p *= 10) step = [p, 2 * p, 5 * p].find((m) => m * scale >= minPx) || 0;
  const lo = first + Math.max(0, Math.floor(origin)), hi = first + Math.min(count, Math.ceil(origin + length / scale)) - 1;
  const ticks = [];
  for (let t = Math.ceil(lo / step) * step; t <= hi; t += step) {
    const at = (t - first + 0.5 - origin) * scale;
    if (at < -0.5 || at > length + 0.5) continue;
    const tick = document.createElement("span");
    tick.className = "tick"; tick.dataset.pos = String(t); tick.textContent = tickText(t, step);
    tick.style[vertical ? "top" : "left"] = `${at}px`;
    ticks.push(tick);
  }
  el.dataset.step = String(step);
  el.replaceChildren(...ticks);
}

function Viewer(canvas, lq, lk, layers, colour, overlay, onCell) {
  this.canvas = canvas; this.ctx = canvas.getContext("2d"); this.lq = lq; this.lk = lk;
  this.layers = layers; this.colour = colour; this.overlay = overlay; this.onCell = onCell;
  [canvas.width, canvas.height] = fitCanvas(canvas, lq, lk);
  this.reset();
  const v = this;
  canvas.addEventListener("mousemove", (ev) => v.hover(ev.offsetX, ev.offsetY));
  canvas.addEventListener("wheel", (ev) => { ev.preventDefault(); v.zoom(ev.deltaY < 0 ? 1.25 : 0.8, ev.offsetX, ev.offsetY); }, {passive: false});
  canvas.addEventListener("mousedown", (ev) => { v.drag = [ev.offsetX, ev.offsetY]; });
  window.addEventListener("mouseup", () => { v.drag = null; });
  canvas.addEventListener("mousemove", (ev) => {
    if (!v.drag || !(ev.buttons & 1)) return;
    v.x0 -= (ev.offsetX - v.drag[0]) / v.sx; v.y0 -= (ev.offsetY - v.drag[1]) / v.sy; v.drag = [ev.offsetX, ev.offsetY]; v.draw();
  });
  canvas.addEventListener("keydown", (ev) => v.key(ev));
}
// Size the canvas to the window; the cells in view stay in view (the whole mask, if that is what was shown).
Viewer.prototype.fit = function () {
  const [W, H] = fitCanvas(this.canvas, this.lq, this.lk), oldW = this.canvas.width, oldH = this.canvas.height;
  const whole = this.x0 === 0 && this.y0 === 0 && this.sx === oldW / this.lk && this.sy === oldH / this.lq;
  if (W === oldW && H === oldH) return;
  this.canvas.width = W; this.canvas.height = H;
  if (whole) this.reset(); else { this.sx *= W / oldW; this.sy *= H / oldH; }
};
Viewer.prototype.reset = function () {
  this.x0 = 0; this.y0 = 0; this.sx = this.canvas.width / this.lk; this.sy = this.canvas.height / this.lq;
};
Viewer.prototype.setView = function (q0, k0, rows, keys) { // local cells q0.., k0.. fill the canvas
  this.y0 = q0; this.x0 = k0; this.sy = this.canvas.height / rows; this.sx = this.canvas.width / keys; this.draw();
};
// Each axis zooms between its whole length and MAX_PX pixels a cell; a short, wide mask (its rows MIN_CELL pixels or
// more, its keys less) zooms along its keys alone, and a narrow, tall one along its queries.
Viewer.prototype.zoom = function (factor, px, py) {
  const fitX = this.canvas.width / this.lk, fitY = this.canvas.height / this.lq;
  const wide = fitY >= MIN_CELL && fitX < MIN_CELL, tall = fitX >= MIN_CELL && fitY < MIN_CELL;
  const cx = this.x0 + px / this.sx, cy = this.y0 + py / this.sy;
  this.sx = Math.min(tall ? fitX : Math.max(fitX, MAX_PX), Math.max(fitX, this.sx * factor));
  this.sy = Math.min(wide ? fitY : Math.max(fitY, MAX_PX), Math.max(fitY, this.sy * factor));
  this.x0 = cx - px / this.sx; this.y0 = cy - py / this.sy;
  this.draw();
};
Viewer.prototype.key = function (ev) {
  const W = this.canvas.width, H = this.canvas.height, stepX = Math.max(1, W / 8 / this.sx), stepY = Math.max(1, H / 8 / this.sy);
  const moves = {ArrowLeft: [-stepX, 0], ArrowRight: [stepX, 0], ArrowUp: [0, -stepY], ArrowDown: [0, stepY]};
  if (moves[ev.key]) { this.x0 += moves[ev.key][0]; this.y0 += moves[ev.key][1]; this.draw(); }
  else if (ev.key === "+" || ev.key === "=") this.zoom(2, W / 2, H / 2);
  else if (ev.key === "-" || ev.key === "_") this.zoom(0.5, W / 2, H / 2);
  else if (ev.key === "0") { this.reset(); this.draw(); }
  else return;
  ev.preventDefault();
  this.hover(W / 2, H / 2);
};
Viewer.prototype.hover = function (px, py) {
  const q = Math.floor(this.y0 + py / this.sy), kv = Math.floor(this.x0 + px / this.sx);
  if (q >= 0 && q < this.lq && kv >= 0 && kv < this.lk) this.onCell(q, kv);
};
Viewer.prototype.draw = function () {
  const W = this.canvas.width, H = this.canvas.height, img = this.ctx.createImageData(W, H), px = img.data;
  const X = axisMap(this.lk, this.x0, this.sx, W), Y = axisMap(this.lq, this.y0, this.sy, H);
  const n = this.layers.count, acc = [], full = [], counts = new Float64Array(n), run = new Float64Array(n);
  for (let l = 0; l < n; l++) { acc.push(new Float64Array(W)); full.push(new Float64Array(W + 1)); }
  const back = DATA.colours.outside;
  const cells = (X.hi[W - 1] - X.lo[0]) * (Y.hi[H - 1] - Y.lo[0]);
  const rowOf = this.layers.rowsFor(cells, X.lo[0], X.hi[W - 1]);
  for (let r = 0; r < H; r++) {
    const rows = Y.hi[r] - Y.lo[r];
    for (let l = 0; l < n; l++) { acc[l].fill(0); full[l].fill(0); }
    for (let q = Y.lo[r]; q < Y.hi[r]; q++) {
      const found = rowOf(q);
      for (let l = 0; l < n; l++) {
        const S = found[l][0], E = found[l][1], m = found[l][2];
        for (let j = 0; j < m; j++) addInterval(acc[l], full[l], X, S[j], E[j]);
      }
    }
    run.fill(0);
    for (let c = 0; c < W; c++) {
      const width = X.hi[c] - X.lo[c], at = 4 * (r * W + c);
      for (let l = 0; l < n; l++) { run[l] += full[l][c]; counts[l] = acc[l][c] + run[l] * width; }
      const rgb = rows * width > 0 ? this.colour(counts, rows * width) : back;
      px[at] = rgb[0]; px[at + 1] = rgb[1]; px[at + 2] = rgb[2]; px[at + 3] = 255;
    }
  }
  this.ctx.putImageData(img, 0, 0);
  this.overlay(this);
  const F = DATA.masks[0].frame;
  ruler(document.getElementById("ruler-k"), F.vk0, this.lk, this.x0, this.sx, W, false);
  ruler(document.getElementById("ruler-q"), F.vq0, this.lq, this.y0, this.sy, H, true);
  if (window.__maskcliFirstDraw === undefined) window.__maskcliFirstDraw = performance.now();
  document.getElementById("status").textContent = this.status(cells);
};
Viewer.prototype.status = function (cells) {
  const q0 = Math.max(0, Math.floor(this.y0)), k0 = Math.max(0, Math.floor(this.x0));
  const q1 = Math.min(this.lq, Math.ceil(this.y0 + this.canvas.height / this.sy)), k1 = Math.min(this.lk, Math.ceil(this.x0 + this.canvas.width / this.sx));
  const F = DATA.masks[0].frame;
  const scale = this.sx >= 1 && this.sy >= 1 ? `one cell = ${this.sx.toPrecision(3)} px` : `one pixel = ${(1 / Math.min(this.sx, 1)).toPrecision(4)} keys x ${(1 / Math.min(this.sy, 1)).toPrecision(4)} queries (colour: ${DATA.page === "diff" ? "the exact shares, a pixel's differing cells shown as at least half of it" : "the share kept, any kept cell at least light blue"})`;
  let text = `queries ${F.vq0 + q0}-${F.vq0 + q1 - 1} · keys ${F.vk0 + k0}-${F.vk0 + k1 - 1} · ${scale}`;
  const stride = DATA.masks[0].rows[0].stride;
  if (stride > 1) {
    text += cells <= EVAL_CELLS && DATA.masks[0].tree ? " · exact: drawn cell by cell from the expression"
      : ` · NOT exact at this zoom: every ${stride}th query row is embedded (to keep the file small); zoom to ${EVAL_CELLS.toLocaleString("en")} cells or fewer (about 512 x 512) for an exact view`;
  } else text += " · exact: drawn from every row's key intervals";
  return text;
};

// Layers: the interval sets a page draws (one mask, or A and B and their intersection), for batch row b.
function layersOf(masks, b, intersect) {
  const rows = masks.map((M) => maskRows(M, b));
  const bufs = rows.map((R) => [new Float64Array(Math.max(R.k, 1)), new Float64Array(Math.max(R.k, 1)), 0]);
  const both = intersect ? [new Float64Array(rows[0].k + rows[1].k), new Float64Array(rows[0].k + rows[1].k), 0] : null;
  return {
    count: masks.length + (intersect ? 1 : 0),
    rowsFor: function (cells, klo, khi) {
      const evaluate = masks.map((M, i) => rows[i].stride > 1 && M.tree && cells <= EVAL_CELLS);
      return function (q) {
        masks.forEach((M, i) => {
          const k0 = M.frame.vk0, buf = bufs[i];
          if (evaluate[i]) { // exact cells from the expression, as runs over the keys in view
            let m = 0, open = -1;
            for (let k = klo; k <= khi; k++) {
              const keep = k < khi && keepAt(M, b, q + M.frame.vq0, k + k0);
              if (keep && open < 0) open = k;
              if (!keep && open >= 0) { buf[0][m] = open; buf[1][m] = k; m++; open = -1; }
            }
            buf[2] = m;
            return;
          }
          const m = rows[i].row(q, buf[0], buf[1]);
          for (let j = 0; j < m; j++) { buf[0][j] -= k0; buf[1][j] -= k0; }
          buf[2] = m;
        });
        if (both) {
          let m = 0;
          for (let i = 0; i < bufs[0][2]; i++) for (let j = 0; j < bufs[1][2]; j++) {
            const s = Math.max(bufs[0][0][i], bufs[1][0][j]), e = Math.min(bufs[0][1][i], bufs[1][1][j]);
            if (e > s) { both[0][m] = s; both[1][m] = e; m++; }
          }
          both[2] = m;
          return bufs.concat([both]);
        }
        return bufs;
      };
    },
  };
}

function mix(parts, total) { // colours weighted by their counts of cells
  const out = [0, 0, 0];
  for (const [rgb, count] of parts) for (let i = 0; i < 3; i++) out[i] += rgb[i] * count / total;
  return out.map(Math.round);
}

// The structure marks, as the figures draw them: label boundaries, padded keys and queries, the cache edge, in lines
// two pixels wide (they read over a pixel of a million cells as over one cell), named in the strip under the map.
function drawMarks(v, S, F, extra) {
  const ctx = v.ctx, W = v.canvas.width, H = v.canvas.height;
  const x = (key) => (key - F.vk0 - v.x0) * v.sx, y = (query) => (query - F.vq0 - v.y0) * v.sy;
  ctx.save();
  ctx.fillStyle = v.hatch;
  for (const [a, b] of S.padKeys) ctx.fillRect(x(a), 0, x(b) - x(a), H);
  for (const [a, b] of S.padQueries) ctx.fillRect(0, y(a), W, y(b) - y(a));
  cellLines(v, W, H);
  ctx.strokeStyle = DATA.colours.mark; ctx.lineWidth = 2;
  ctx.beginPath();
  for (const [start] of S.segments.slice(1)) {
    const px = Math.round(x(start)), py = Math.round(y(start));
    if (px > 0 && px < W) { ctx.moveTo(px, 0); ctx.lineTo(px, H); }
    if (py > 0 && py < H) { ctx.moveTo(0, py); ctx.lineTo(W, py); }
  }
  ctx.stroke();
  if (S.cache !== null) {
    ctx.strokeStyle = DATA.colours.cache; ctx.lineWidth = 2; ctx.setLineDash([6, 4]);
    const px = Math.round(x(S.cache));
    ctx.beginPath(); ctx.moveTo(px, 0); ctx.lineTo(px, H); ctx.stroke();
  }
  markStrip(S, x, W);
  if (extra) extra(ctx, x, y, W, H);
  ctx.restore();
}
// Faint lines between cells, where cells are CELL_LINES pixels or more: a run of cells of one colour reads as cells.
const CELL_LINES = 12;
function cellLines(v, W, H) {
  const ctx = v.ctx;
  ctx.strokeStyle = DATA.colours.cells; ctx.lineWidth = 1;
  ctx.beginPath();
  if (v.sx >= CELL_LINES) for (let k = Math.max(1, Math.ceil(v.x0)); k < Math.min(v.lk, v.x0 + W / v.sx); k++) {
    const px = Math.round((k - v.x0) * v.sx) + 0.5; ctx.moveTo(px, 0); ctx.lineTo(px, H);
  }
  if (v.sy >= CELL_LINES) for (let q = Math.max(1, Math.ceil(v.y0)); q < Math.min(v.lq, v.y0 + H / v.sy); q++) {
    const py = Math.round((q - v.y0) * v.sy) + 0.5; ctx.moveTo(0, py); ctx.lineTo(W, py);
  }
  ctx.stroke();
}

// Under the map, off its cells: each segment's name across its keys in view, and where the KV cache ends.
function markStrip(S, x, W) {
  const strip = document.getElementById("marks-k"), items = [];
  const add = (text, left, className) => {
    const item = document.createElement("span");
    item.className = className; item.textContent = text; item.style.left = `${left}px`;
    items.push(item);
  };
  if (S.word) for (const [start, end, label] of S.segments) {
    const left = Math.max(x(start), 0), right = Math.min(x(end), W), text = `${S.word} ${label}`;
    if (right - left >= 7 * text.length + 8) add(text, (left + right) / 2, "segment"); // no room: hover names it
  }
  if (S.cache !== null && x(S.cache) >= 0 && x(S.cache) <= W) add("KV cache | new keys", x(S.cache), "cache");
  strip.replaceChildren(...items);
  for (const item of items) { // centred on its place, kept within the map's width
    const half = item.offsetWidth / 2, at = parseFloat(item.style.left);
    item.style.left = `${Math.min(Math.max(at, half), Math.max(half, W - half))}px`;
  }
}

function hatchPattern(ctx) {
  const tile = document.createElement("canvas");
  tile.width = tile.height = 8;
  const t = tile.getContext("2d");
  t.strokeStyle = "rgba(90, 90, 90, 0.55)"; t.lineWidth = 1.5;
  t.beginPath(); t.moveTo(0, 8); t.lineTo(8, 0); t.stroke();
  return ctx.createPattern(tile, "repeat");
}

function leaves(node) {
  return node.op === undefined ? [node] : node.items.flatMap(leaves);
}
function hoverLabels(M) { // the labels hover names: embedded, or a leaf's of the explainer's tree
  if (!M.labels) return null;
  return M.labels.runs || leaves(M.tree)[M.labels.leaf].p[M.labels.param].runs;
}
function cellHeader(M, b, q, kv) {
  const F = M.frame, lines = [`q ${q} · kv ${kv}` + (F.batch > 1 ? ` · batch row ${b}` : "") +
    (q - F.vq0 !== q || kv - F.vk0 !== kv ? ` · q_idx ${q - F.vq0} · kv_idx ${kv - F.vk0}` : "")];
  const table = hoverLabels(M);
  if (table) lines.push(`${M.labels.word} ${labelAt(table, b, q)} at q · ${M.labels.word} ${labelAt(table, b, kv)} at kv`);
  if (M.tokens && q < M.tokens.length && kv < M.tokens.length) lines.push(`"${M.tokens[q]}" at q · "${M.tokens[kv]}" at kv`);
  return lines;
}

function setInfo(lines, why) {
  document.getElementById("cell").textContent = lines.join("\n");
  document.getElementById("why").textContent = why;
}

function batchSelect(count, onChange) {
  const select = document.getElementById("batch");
  if (count <= 1) { select.parentElement.hidden = true; return; }
  for (let b = 0; b < count; b++) select.add(new Option(`batch row ${b}`, String(b)));
  select.addEventListener("change", () => onChange(Number(select.value)));
}

function maskPage() {
  const masks = DATA.masks, diff = DATA.page === "diff", M = masks[0], F = M.frame, C = DATA.colours;
  const canvas = document.getElementById("mask");
  let b = 0, viewer = null;
  const keepOf = (i) => (bb, q, kv) => keptAt(masks[i], bb, q, kv);
  const colour = diff ? (c, total) => {
    const onlyA = c[0] - c[2], onlyB = c[1] - c[2], differ = onlyA + onlyB, same = total - differ;
    // a pixel where fewer than half its cells differ shows its differences as half of it: one differing cell in a
    // pixel of thousands (window(4095) against window(4096)) is what diff is for, and an exact share would hide it
    const d = differ > 0 && 2 * differ < total ? total / 2 / differ : 1, r = d === 1 ? 1 : total / 2 / same;
    return mix([[C.visible, c[2] * r], [C.onlyA, onlyA * d], [C.onlyB, onlyB * d], [C.masked, (total - c[0] - c[1] + c[2]) * r]], total);
  } : (c, total) => { // as the figures shade it: a pixel with any kept cell is at least light blue, never the masked
    const share = c[0] > 0 ? 0.3 + 0.7 * c[0] / total : 0; // grey (a sink's column of 4 keys in 4,096 stays seen)
    return mix([[C.visible, share], [C.masked, 1 - share]], 1);
  };
  const blocks = DATA.blocks;
  const grid = blocks ? (ctx, x, y, W, H) => {
    if (blocks.map) tintBlocks(ctx, x, y, W, H, blocks, blocks.map[Math.min(b, blocks.map.length - 1)], viewer, F, C);
    if (blocks.kv * viewer.sx < 4 || blocks.q * viewer.sy < 4) return;
    ctx.strokeStyle = C.grid; ctx.lineWidth = 1; ctx.setLineDash([4, 3]); ctx.beginPath(); // dashed: not a label boundary
    const k0 = Math.ceil(viewer.x0 / blocks.kv), q0 = Math.ceil(viewer.y0 / blocks.q);
    for (let k = k0 * blocks.kv; k < Math.min(F.lk, viewer.x0 + W / viewer.sx); k += blocks.kv) { const px = Math.round(x(k + F.vk0)) + 0.5; ctx.moveTo(px, 0); ctx.lineTo(px, H); }
    for (let q = q0 * blocks.q; q < Math.min(F.lq, viewer.y0 + H / viewer.sy); q += blocks.q) { const py = Math.round(y(q + F.vq0)) + 0.5; ctx.moveTo(0, py); ctx.lineTo(W, py); }
    ctx.stroke();
  } : null;
  const onCell = (lq, lk) => {
    const q = lq + F.vq0, kv = lk + F.vk0, head = cellHeader(M, b, q, kv);
    if (!diff) {
      const answer = explainCell(M, b, q, kv, keepOf(0), "");
      const keep = answer ? answer.keep : keptAt(M, b, q, kv);
      head.push(verdict(keep) + (blocks ? " · " + blockText(M, b, lq, lk) : ""));
      setInfo(head, answer ? answer.lines.concat([M.positions]).join("\n") : M.unexplained);
      return;
    }
    const sides = masks.map((S, i) => explainCell(S, Math.min(b, S.frame.batch - 1), q, kv, keepOf(i), i ? "B: " : "A: "));
    const a = keptAt(masks[0], Math.min(b, masks[0].frame.batch - 1), q, kv), bb = keptAt(masks[1], Math.min(b, masks[1].frame.batch - 1), q, kv);
    head.push(a && bb ? "both" : a ? "only in A" : bb ? "only in B" : "neither");
    if (sides.some((s) => s === null)) { setInfo(head, masks.map((S) => S.unexplained).filter(Boolean).join("\n")); return; }
    const cell = whereText(M, b, q, kv), out = [];
    out.push(a === bb ? `the cell ${cell} is the same in A and B: ${verdict(a)}`
      : `the cell ${cell} differs: A ${a ? "keeps" : "masks"} it, B ${bb ? "keeps" : "masks"} it`);
    out.push(...sides[0].lines, ...sides[1].lines);
    if (masks[0].positions === masks[1].positions) out.push(masks[0].positions);
    else out.push("A " + masks[0].positions, "B " + masks[1].positions);
    setInfo(head, out.join("\n"));
  };
  const overlay = (v) => drawMarks(v, M.structure[Math.min(b, M.structure.length - 1)], F, grid);
  viewer = new Viewer(canvas, F.lq, F.lk, layersOf(masks, b, diff), colour, overlay, onCell);
  viewer.hatch = hatchPattern(viewer.ctx);
  window.maskcliViewer = viewer;
  batchSelect(Math.max(...masks.map((S) => Math.min(S.frame.batch, S.rows.length))), (value) => {
    b = value; viewer.layers = layersOf(masks, b, diff); viewer.draw();
  });
  if (!window.__maskcliResize) { // once: serve's page calls maskPage again for each request it shows
    window.__maskcliResize = true;
    window.addEventListener("resize", () => { window.maskcliViewer.fit(); window.maskcliViewer.draw(); });
  }
  viewer.draw();
}

// Each block on screen tinted by its category ('0' full, '1' partial, '2' empty: html.block_tints), one colour at a time.
function tintBlocks(ctx, x, y, W, H, blocks, map, viewer, F, C) {
  const nkv = Math.ceil(F.lk / blocks.kv), nq = Math.ceil(F.lq / blocks.q);
  const j0 = Math.max(0, Math.floor(viewer.x0 / blocks.kv)), j1 = Math.min(nkv, Math.ceil((viewer.x0 + W / viewer.sx) / blocks.kv));
  const i0 = Math.max(0, Math.floor(viewer.y0 / blocks.q)), i1 = Math.min(nq, Math.ceil((viewer.y0 + H / viewer.sy) / blocks.q));
  ctx.save();
  ctx.globalAlpha = C.blockAlpha; ctx.setLineDash([]);
  for (let c = 0; c < 3; c++) {
    ctx.fillStyle = C.blockTint[c];
    const code = 48 + c;
    for (let i = i0; i < i1; i++) {
      const top = y(i * blocks.q + F.vq0), bottom = y(Math.min(F.lq, (i + 1) * blocks.q) + F.vq0);
      for (let j = j0; j < j1; j++) {
        if (map.charCodeAt(i * nkv + j) !== code) continue;
        const left = x(j * blocks.kv + F.vk0);
        ctx.fillRect(left, top, x(Math.min(F.lk, (j + 1) * blocks.kv) + F.vk0) - left, bottom - top);
      }
    }
  }
  ctx.restore();
}

// A block of FlexAttention's block view (local, padded to whole blocks): full, partial or empty, from the intervals.
function blockText(M, b, lq, lk) {
  const B = DATA.blocks, F = M.frame, i = Math.floor(lq / B.q), j = Math.floor(lk / B.kv);
  const q0 = i * B.q, q1 = Math.min(F.lq, q0 + B.q), k0 = j * B.kv + F.vk0, k1 = Math.min(F.lk, j * B.kv + B.kv) + F.vk0;
  const rows = maskRows(M, b), S = new Float64Array(rows.k), E = new Float64Array(rows.k);
  let kept = 0;
  if (rows.stride > 1) { // sampled rows: count the block's cells from the expression, where they are few
    if (!M.tree || (q1 - q0) * (k1 - k0) > EVAL_CELLS) return `block (${i}, ${j}) (its rows are sampled here: maskcli blocks counts it)`;
    for (let q = q0; q < q1; q++) for (let k = k0; k < k1; k++) kept += keepAt(M, b, q + F.vq0, k) ? 1 : 0;
  } else for (let q = q0; q < q1; q++) {
    const m = rows.row(q, S, E);
    for (let t = 0; t < m; t++) kept += Math.max(0, Math.min(E[t], k1) - Math.max(S[t], k0));
  }
  const whole = q1 - q0 === B.q && k1 - k0 === B.kv && kept === B.q * B.kv;
  return `block (${i}, ${j}): ${kept === 0 ? "empty" : whole ? "full" : "partial"}`;
}

if (DATA.page === "attend") attendPage(); else if (DATA.page === "serve") servePage(); else maskPage();
