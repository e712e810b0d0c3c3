// Why one cell is kept or masked, in the page: each kind's reason exactly as maskcli/kinds/*.py words it (Kind.why),
// combined and laid out as maskcli/render/why.py does, so the page agrees with `maskcli show EXPR --why B,Q,KV`
// (tests/test_render_html.py compares the two for random expressions and cells).
"use strict";

function decodeArray(p) {
  const bin = atob(p.b);
  const bytes = new Uint8Array(bin.length);
  for (let i = 0; i < bin.length; i++) bytes[i] = bin.charCodeAt(i);
  return p.t === "i4" ? new Int32Array(bytes.buffer) : new Float64Array(bytes.buffer);
}

// Labels as runs per row ({at, v}, decoded once): the label at position i, and where its run starts.
function labelRuns(table) {
  if (!table) return null;
  if (!table.decoded) table.decoded = table.map((r) => ({at: decodeArray(r.at), v: decodeArray(r.v)}));
  return table.decoded;
}
function runIndex(at, i) {
  let lo = 0, hi = at.length - 1;
  while (lo < hi) { const mid = (lo + hi + 1) >> 1; if (at[mid] <= i) lo = mid; else hi = mid - 1; }
  return lo;
}
function labelAt(table, b, i) {
  const rows = labelRuns(table), row = rows[rows.length > 1 ? b : 0];
  return row.v[runIndex(row.at, i)];
}
function runStartAt(table, b, i) {
  const rows = labelRuns(table), row = rows[rows.length > 1 ? b : 0];
  return row.at[runIndex(row.at, i)];
}

const later = (q, kv) => `kv ${kv} > q ${q}: a later key`;

function firstReal(F, b) {
  if (F.ids === null && F.padSide === "right") return 0;
  const row = labelRuns(F.valid)[F.valid.length > 1 ? b : 0];
  for (let i = 0; i < row.v.length; i++) if (row.v[i] === 1) return row.at[i];
  return F.n;
}

function readCell(ones, matrix, means) {
  const cell = `a ${ones ? 1 : 0}-cell of ${matrix}, read as ${means}`;
  return [means === "keep" ? ones : !ones, cell + (means === "block" ? " (1 = masked)" : "")];
}

const KIND_WHY = {
  full: () => [true, "every query sees every key"],
  causal: (p, F, b, q, kv) => (kv <= q ? [true, `kv ${kv} <= q ${q}`] : [false, later(q, kv)]),
  window: (p, F, b, q, kv) => {
    if (kv > q) return [false, later(q, kv)];
    const d = q - kv, w = p.window;
    return [d < w, `${q} - ${kv} = ${d} ${d < w ? "<" : ">="} ${w}`];
  },
  lookback: (p, F, b, q, kv) => {
    const d = q - kv, w = p.window, edge = kv > q ? " (no causal edge: a later key is kept)" : "";
    return [d < w, `${q} - ${kv} = ${d} ${d < w ? "<" : ">="} ${w}${edge}`];
  },
  band: (p, F, b, q, kv) => {
    const d = Math.abs(q - kv), w = p.window;
    return [d < w, `|${q} - ${kv}| = ${d} ${d < w ? "<" : ">="} ${w}`];
  },
  prefix: (p, F, b, q, kv) => {
    const size = p.prefix;
    if (kv < size) return [true, `kv ${kv} < ${size}: in the prefix, seen both ways`];
    return [kv <= q, `kv ${kv} >= ${size}, past the prefix; ` + (kv <= q ? `kv ${kv} <= q ${q}` : later(q, kv))];
  },
  sink: (p, F, b, q, kv) => {
    const size = p.sink, k = kv < size;
    return [k, `kv ${kv} ${k ? "<" : ">="} ${size}: ${k ? "one" : "not one"} of the first ${size} keys`];
  },
  chunk: (p, F, b, q, kv) => {
    const aq = labelAt(p.labels.runs, b, q), ak = labelAt(p.labels.runs, b, kv);
    return [ak <= aq, `label ${aq} at q ${q}, label ${ak} at kv ${kv}: ${ak} ${ak <= aq ? "<=" : ">"} ${aq}`];
  },
  document: (p, F, b, q, kv) => {
    const aq = labelAt(p.labels.runs, b, q), ak = labelAt(p.labels.runs, b, kv);
    if (aq !== ak) return [false, `label ${aq} at q ${q}, label ${ak} at kv ${kv}: another document`];
    return [kv <= q, `label ${aq} at q ${q} and kv ${kv}, ` + (kv <= q ? "kv <= q" : "but kv > q: a later key")];
  },
  segment: (p, F, b, q, kv) => {
    const aq = labelAt(p.labels.runs, b, q), ak = labelAt(p.labels.runs, b, kv);
    if (aq !== ak) return [false, `label ${aq} at q ${q}, label ${ak} at kv ${kv}: another segment`];
    return [true, `label ${aq} at q ${q} and kv ${kv}: one segment, seen both ways`];
  },
  blocks: (p, F, b, q, kv) => {
    const aq = labelAt(p.labels.runs, b, q), ak = labelAt(p.labels.runs, b, kv);
    if (aq < 0) return [false, `id ${aq} at q ${q}: no block`];
    if (aq !== ak) return [false, `block ${aq} at q ${q}, ${ak < 0 ? "no block" : `block ${ak}`} at kv ${kv}`];
    return [true, `block ${aq} at q ${q} and kv ${kv}: one block, seen both ways`];
  },
  tril: (p, F, b, q, kv) => {
    const d = p.diagonal, ones = kv - q <= d, [keep, cell] = readCell(ones, `torch.tril(ones, ${d})`, p.means);
    return [keep, `kv - q = ${kv - q} ${ones ? "<=" : ">"} ${d}: ${cell}`];
  },
  triu: (p, F, b, q, kv) => {
    const d = p.diagonal, ones = kv - q >= d, [keep, cell] = readCell(ones, `torch.triu(ones, ${d})`, p.means);
    return [keep, `kv - q = ${kv - q} ${ones ? ">=" : "<"} ${d}: ${cell}`];
  },
  local: (p, F, b, q, kv) => {
    const size = p.chunk_size, first = firstReal(F, b), docs = p.documents ? p.documents.runs : null;
    const chunk = (i) => {
      const start = docs === null ? first : Math.max(first, runStartAt(docs, b, i));
      return start + size * Math.floor((i - start) / size);
    };
    const counted = docs !== null ? "each document's start" : `${first ? "the first real token " : "position "}${first}`;
    const qc = chunk(q), kc = chunk(kv);
    const where = `chunks of ${size} from ${counted}: q ${q} in the chunk from ${qc}, kv ${kv} in the chunk from ${kc}`;
    if (qc !== kc) return [false, where];
    return [kv <= q, where + (kv <= q ? "" : "; " + later(q, kv))];
  },
  tree: (p, F, b, q, kv) => {
    const first = F.q0;
    if (!p.parentsList) {
      const row = labelRuns(p.parents.runs)[0], out = [];
      for (let i = 0; i < row.at.length; i++) {
        const end = i + 1 < row.at.length ? row.at[i + 1] : p.parents.length;
        for (let j = row.at[i]; j < end; j++) out.push(row.v[i]);
      }
      p.parentsList = out;
    }
    const parents = p.parentsList;
    if (kv < first) return [true, `kv ${kv} < ${first}: in the cached prefix`];
    const token = q - first, draft = kv - first, line = [token];
    while (parents[line[line.length - 1]] >= 0 && line.length <= parents.length) line.push(parents[line[line.length - 1]]);
    const shown = line.slice(0, 8).join(" <- ") + (line.length > 8 ? " <- ..." : "");
    const where = `q ${q} is draft ${token}, its line (itself <- ancestors) ${shown}`;
    if (draft >= parents.length) return [false, `${where}; kv ${kv} is past the drafts`];
    const on = line.includes(draft);
    return [on, `${where}; kv ${kv} is draft ${draft}, ${on ? "on" : "not on"} it`];
  },
  padding: (p, F, b, q, kv) => {
    const real = labelAt(F.valid, b, kv) === 1, row = F.valid.length > 1 ? b : 0;
    if (F.lengths !== null) {
      const length = F.lengths[row];
      if (F.padSide === "left") {
        const first = F.n - length;
        return [real, `batch row ${b} has length ${length}, padded left (real keys ${first}-${F.n - 1}): ` +
          `kv ${kv} ${real ? ">=" : "<"} ${first}` + (real ? "" : ", a pad key")];
      }
      return [real, `batch row ${b} has length ${length}: kv ${kv} ${real ? "<" : ">="} ${length}` + (real ? "" : ", a pad key")];
    }
    const token = labelAt(F.ids, b, kv);
    if (real) return [true, `ids[${b}][${kv}] = ${token}, not the pad id ${F.padId}`];
    return [false, `ids[${b}][${kv}] = ${token}, the pad id: a pad key`];
  },
};

function names(children, keep) {
  const named = children.filter((c) => c.keep === keep).map((c) => c.t40);
  return named.slice(0, 3).join(", ") + (named.length > 3 ? ` and ${named.length - 3} more` : "");
}

// The tree at one cell: {keep, reason, op, t40, t60, children}, as maskcli/why.py's _node.
function whyNode(node, F, b, q, kv) {
  if (node.op === undefined) {
    const [keep, reason] = KIND_WHY[node.kind](node.p, F, b, q, kv);
    return {keep: keep, reason: reason, t40: node.t40, t60: node.t60, children: []};
  }
  const children = node.items.map((item) => whyNode(item, F, b, q, kv));
  let keep, reason;
  if (node.op === "~") {
    const inner = children[0];
    keep = !inner.keep;
    reason = `${inner.t40} ${inner.keep ? "keeps" : "masks"} it, and ~ flips that`;
  } else if (node.op === "&") {
    keep = children.every((c) => c.keep);
    const masking = children.filter((c) => !c.keep).length;
    reason = keep ? `all ${children.length} parts keep it` : `${names(children, false)} mask${masking === 1 ? "s" : ""} it`;
  } else {
    const keeping = children.filter((c) => c.keep).length;
    keep = keeping > 0;
    reason = keep ? `${names(children, true)} keep${keeping === 1 ? "s" : ""} it` : `none of its ${children.length} parts keeps it`;
  }
  return {keep: keep, reason: reason, op: node.op, t40: node.t40, t60: node.t60, children: children};
}

const verdict = (keep) => (keep ? "kept" : "masked");

function treeLines(node, lead, last, top) {
  const branch = top ? "" : (last ? "└─ " : "├─ ");
  const line = node.op === undefined
    ? `${lead}${branch}${node.t60}: ${node.reason} -> ${verdict(node.keep)}`
    : `${lead}${branch}${top ? node.op : node.t60} -> ${verdict(node.keep)}: ${node.reason}`;
  let out = [line];
  const inner = lead + (top ? "" : (last ? "   " : "│  "));
  node.children.forEach((child, i) => { out = out.concat(treeLines(child, inner, i === node.children.length - 1, false)); });
  return out;
}

function whereText(M, b, q, kv) {
  const F = M.frame;
  let text = `query ${q}, key ${kv}` + (F.batch > 1 ? `, batch row ${b}` : "");
  const qi = q - F.vq0, ki = kv - F.vk0;
  if (qi !== q || ki !== kv) text += ` (q_idx ${qi}, kv_idx ${ki} in the tensor)`;
  return text;
}

// One mask's answer at (b, q, kv) in absolute positions: {keep, lines} (lines as why_text prints, without positions);
// `keepOf` gives the cell of a tensor, which has no tree. null where the page cannot explain (a mask_mod).
function explainCell(M, b, q, kv, keepOf, label) {
  if (M.unexplained) return null;
  if (M.tree === null) {
    const keep = keepOf(b, q, kv);
    return {keep: keep, lines: [`${label}${whereText(M, b, q, kv)} of ${M.text80}: ${verdict(keep)}`, `  ${M.note}`]};
  }
  const node = whyNode(M.tree, M.frame, b, q, kv);
  return {keep: node.keep, lines: [`${label}${whereText(M, b, q, kv)} of ${M.text80}: ${verdict(node.keep)}`].concat(treeLines(node, "  ", true, true))};
}

function keepAt(M, b, q, kv) {
  return whyNode(M.tree, M.frame, b, q, kv).keep;
}
