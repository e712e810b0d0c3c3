// maskcli attend's page: every stage side by side for one (batch, head) pair, as heatmaps of the dense values
// (attend is small-L); hover or the arrow keys on a panel show the cell in every stage and why the mask keeps it.
"use strict";

const VIRIDIS = [[68, 1, 84], [59, 82, 139], [33, 145, 140], [94, 201, 98], [253, 231, 37]];

function viridis(t) {
  const x = Math.min(1, Math.max(0, t)) * (VIRIDIS.length - 1), i = Math.min(VIRIDIS.length - 2, Math.floor(x)), f = x - i;
  return VIRIDIS[i].map((c, j) => Math.round(c + (VIRIDIS[i + 1][j] - c) * f));
}
const numeric = (v) => (typeof v === "number" ? v : v === "nan" ? NaN : v === "inf" ? Infinity : -Infinity);
const shown = (v) => (typeof v === "number" ? v.toPrecision(6) : v);

function attendPage() {
  const A = DATA.stages, M = DATA.masks[0], F = M.frame, C = DATA.colours, holder = document.getElementById("panels");
  let pair = 0, cursor = [0, 0];
  document.getElementById("viewer-bar").hidden = true;
  document.getElementById("plot").hidden = true;
  const select = document.getElementById("batch");
  if (A.pairs.length > 1) {
    select.previousSibling.textContent = "batch row, head ";
    A.pairs.forEach(([b, h], i) => select.add(new Option(`batch row ${b}, head ${h}`, String(i))));
    select.addEventListener("change", () => { pair = Number(select.value); draw(); show(cursor[0], cursor[1]); });
  } else select.parentElement.hidden = true;

  // One cell size for every panel: the largest (up to 48 px) at which the panels, wrapped into rows, fit the room
  // beside the hover panel and below the header; at least 4 px, where they do not.
  const widest = Math.max(A.lk, A.names.includes("output") ? A.d : 0);
  function cellSize() {
    const main = document.querySelector("main"), rem = parseFloat(getComputedStyle(document.documentElement).fontSize);
    const roomW = main.clientWidth - (window.innerWidth < NARROW ? 0 : 19.25 * rem);
    const roomH = window.innerHeight - holder.getBoundingClientRect().top - window.scrollY - 24;
    let best = 4;
    for (let rows = 1; rows <= A.names.length; rows++) {
      const across = Math.ceil(A.names.length / rows), chrome = 3.5 * rem; // the query ruler and the gap; caption and key ruler
      const size = Math.min(48, (roomW - across * chrome) / (across * widest), (roomH - rows * 3.6 * rem) / (rows * A.lq));
      best = Math.max(best, Math.floor(size));
    }
    return best;
  }
  const panels = A.names.map((name) => {
    const box = document.createElement("figure"), canvas = document.createElement("canvas"), caption = document.createElement("figcaption");
    const stage = document.createElement("div"), keys = document.createElement("div"), queries = document.createElement("div");
    const cols = name === "output" ? A.d : A.lk;
    canvas.tabIndex = 0; canvas.id = `stage-${name}`;
    canvas.setAttribute("aria-label", `${name}: arrow keys move over the cells`);
    caption.textContent = name + (name === "output" ? " (rows = queries, columns = value dimensions)" : "");
    stage.className = "stage"; keys.className = "ruler k"; queries.className = "ruler q";
    stage.append(keys, queries, canvas); box.append(caption, stage); holder.append(box);
    keys.id = `ruler-k-${name}`; queries.id = `ruler-q-${name}`;
    const at = (ev) => [Math.floor(ev.offsetY / P.size), Math.floor(ev.offsetX / P.size)];
    canvas.addEventListener("mousemove", (ev) => { const [q, k] = at(ev); if (q < A.lq && k < cols) show(q, k, name); });
    canvas.addEventListener("keydown", (ev) => {
      const moves = {ArrowLeft: [0, -1], ArrowRight: [0, 1], ArrowUp: [-1, 0], ArrowDown: [1, 0]};
      if (!moves[ev.key]) return;
      ev.preventDefault();
      const q = Math.min(A.lq - 1, Math.max(0, cursor[0] + moves[ev.key][0])), k = Math.min(cols - 1, Math.max(0, cursor[1] + moves[ev.key][1]));
      show(q, k, name);
    });
    const P = {name: name, canvas: canvas, size: 0, cols: cols, keys: keys, queries: queries};
    return P;
  });
  function apply(size) {
    for (const P of panels) {
      P.size = size; P.canvas.width = P.cols * size; P.canvas.height = A.lq * size;
      // rulers: absolute query and key positions (the output's columns: value dimensions from 0)
      ruler(P.keys, P.name === "output" ? 0 : F.vk0, P.cols, 0, size, P.canvas.width, false);
      ruler(P.queries, F.vq0, A.lq, 0, size, P.canvas.height, true);
    }
  }
  function layout() { // the estimate, then smaller while the panels wrap past the window (captions can be wider)
    let size = cellSize();
    apply(size);
    while (size > 4 && holder.getBoundingClientRect().bottom + window.scrollY > window.innerHeight - 16) apply(size = Math.max(4, Math.floor(size * 0.85)));
    fitPanel();
  }

  function draw() {
    for (const P of panels) {
      const values = A.values[P.name][pair], keep = A.keep[pair], ctx = P.canvas.getContext("2d");
      const masking = P.name !== "output" && !["scores", "scaled", "unmasked"].includes(P.name);
      let lo = Infinity, hi = -Infinity;
      values.forEach((row, q) => row.forEach((v, k) => {
        const x = numeric(v);
        if (Number.isFinite(x) && (!masking || keep[q][k])) { lo = Math.min(lo, x); hi = Math.max(hi, x); }
      }));
      values.forEach((row, q) => row.forEach((v, k) => {
        const x = numeric(v), hidden = masking && !keep[q][k] && !(P.name === "weights" && x !== 0 && Number.isFinite(x));
        const rgb = hidden || !Number.isFinite(x) ? C.masked : masking && !keep[q][k] ? C.onlyA : viridis(hi > lo ? (x - lo) / (hi - lo) : 0.5);
        ctx.fillStyle = `rgb(${rgb[0]}, ${rgb[1]}, ${rgb[2]})`;
        ctx.fillRect(k * P.size, q * P.size, P.size, P.size);
      }));
    }
    if (window.__maskcliFirstDraw === undefined) window.__maskcliFirstDraw = performance.now();
  }

  function show(q, k, from) {
    cursor = [q, k];
    const [b] = A.pairs[pair], head = [], absQ = q + F.vq0;
    head.push(`batch row ${A.pairs[pair][0]}, head ${A.pairs[pair][1]}`);
    if (from === "output") {
      head.push(`q ${absQ} · value dimension ${k}: output ${shown(A.values.output[pair][q][k])}`);
      setInfo(head, "");
      return;
    }
    const kv = k + F.vk0;
    head.push(...cellHeader(M, Math.min(b, F.batch - 1), absQ, kv));
    head.push(verdict(A.keep[pair][q][k]));
    for (const P of panels) if (P.name !== "output") head.push(`${P.name} ${shown(A.values[P.name][pair][q][k])}`);
    const answer = explainCell(M, Math.min(b, F.batch - 1), absQ, kv, () => Boolean(A.keep[pair][q][k]), "");
    setInfo(head, answer ? answer.lines.concat([M.positions]).join("\n") : M.unexplained);
  }
  layout();
  window.addEventListener("resize", () => { layout(); draw(); });
  draw();
  show(0, 0);
}
