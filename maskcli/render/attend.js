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

  const panels = A.names.map((name) => {
    const box = document.createElement("figure"), canvas = document.createElement("canvas"), caption = document.createElement("figcaption");
    const cols = name === "output" ? A.d : A.lk;
    const size = Math.max(4, Math.min(48, Math.floor(320 / Math.max(A.lq, cols))));
    canvas.width = cols * size; canvas.height = A.lq * size; canvas.tabIndex = 0; canvas.id = `stage-${name}`;
    canvas.setAttribute("aria-label", `${name}: arrow keys move over the cells`);
    caption.textContent = name + (name === "output" ? " (rows = queries, columns = value dimensions)" : "");
    box.append(caption, canvas); holder.append(box);
    const at = (ev) => [Math.floor(ev.offsetY / size), Math.floor(ev.offsetX / size)];
    canvas.addEventListener("mousemove", (ev) => { const [q, k] = at(ev); if (q < A.lq && k < cols) show(q, k, name); });
    canvas.addEventListener("keydown", (ev) => {
      const moves = {ArrowLeft: [0, -1], ArrowRight: [0, 1], ArrowUp: [-1, 0], ArrowDown: [1, 0]};
      if (!moves[ev.key]) return;
      ev.preventDefault();
      const q = Math.min(A.lq - 1, Math.max(0, cursor[0] + moves[ev.key][0])), k = Math.min(cols - 1, Math.max(0, cursor[1] + moves[ev.key][1]));
      show(q, k, name);
    });
    return {name: name, canvas: canvas, size: size, cols: cols};
  });

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
  draw();
  show(0, 0);
}
