// maskcli serve's page: one request's mask at a time in page.js's viewer (a selector, a click on a table row or on
// a finding picks it), its logical blocks as a strip coloured by what happens to their pages, every request's
// positions and page map in a table, and the findings. The data is DATA.serve (maskcli/render/servepage.py).
"use strict";

const TABLE_ROWS = 512; // requests listed in the table (the page's JSON holds every one)
const STRIP_CELL = 22; // pixels per logical block in the strip, where they fit
const KIND_ORDER = ["unread", "read", "written", "shared", "null"]; // a pixel over several blocks shows the last of these
const KIND_WORDS = {unread: "not read (before the window or chunk)", read: "read", written: "written this step",
  shared: "shared with another request", null: "the null page"};

function span(lo, hi) { return hi <= lo ? "none" : hi - lo === 1 ? `${lo}` : `${lo}-${hi - 1}`; }
function ids(values, most) { return values.length ? values.slice(0, most).join(", ") + (values.length > most ? `, … (${values.length})` : "") : "none"; }
function element(tag, text, className) {
  const e = document.createElement(tag);
  if (text !== undefined) e.textContent = text;
  if (className) e.className = className;
  return e;
}
// Each logical block's kind, as the terminal's page map and the figure say it (render/serve.py's strip).
function blockKinds(R) {
  const kinds = R.pages.map(() => "read");
  for (const j of R.unread) kinds[j] = "unread";
  for (const j of R.written) kinds[j] = "written";
  for (const j of R.shared) kinds[j] = "shared";
  for (const j of R.null) kinds[j] = "null";
  return kinds;
}

function servePage() {
  const S = DATA.serve, all = DATA.masks, holder = document.getElementById("panels");
  const select = element("select"), label = element("label", "request ");
  select.id = "request";
  S.drawn.forEach((r, i) => select.add(new Option(`request ${r}: ${S.requests[r].expression}`, String(i))));
  label.appendChild(select);
  document.getElementById("viewer-bar").prepend(label);
  const strip = stripFigure(), table = requestTable(), found = findingList();
  holder.append(strip.figure, found, table);
  holder.style.display = "block";
  let current = -1;
  function show(r, cell) {
    const i = S.drawn.indexOf(r);
    current = r;
    strip.draw(r);
    for (const tr of table.querySelectorAll("tbody tr")) tr.classList.toggle("chosen", Number(tr.dataset.request) === r);
    document.getElementById("plot").hidden = i < 0;
    if (i < 0) { // a request with no mask to draw (no keys, more queries than keys), or past the masks embedded
      const R = S.requests[r];
      setInfo([`request ${r}`], R.expression ? `request ${r}'s mask is not embedded: ${S.undrawn} requests past the first ${S.drawn.length} are not drawn (serve --json lists them)`
        : `request ${r} has no mask to draw: ${R.keys[1] === 0 ? "it has no keys" : "it has more queries than keys"}`);
      return;
    }
    select.value = String(i);
    DATA.masks = [all[i]];
    const old = document.getElementById("mask"), fresh = old.cloneNode(false); // a fresh canvas: no earlier listeners
    old.replaceWith(fresh);
    maskPage();
    if (cell) { // centre the finding's cell, a few cells around it, and read it
      const F = all[i].frame, v = window.maskcliViewer, n = Math.min(17, Math.max(F.lq, F.lk));
      v.setView(cell[0] - F.vq0 - (n - 1) / 2, cell[1] - F.vk0 - (n - 1) / 2, n, n);
      v.hover(v.canvas.width / 2, v.canvas.height / 2);
    }
  }
  select.addEventListener("change", () => show(S.drawn[Number(select.value)]));
  table.addEventListener("click", (ev) => { const tr = ev.target.closest("tr[data-request]"); if (tr) show(Number(tr.dataset.request)); });
  found.addEventListener("click", (ev) => {
    const li = ev.target.closest("li[data-request]");
    if (li) show(Number(li.dataset.request), li.dataset.cell ? JSON.parse(li.dataset.cell) : null);
  });
  window.addEventListener("resize", () => { if (current >= 0) strip.draw(current); });
  if (S.drawn.length) show(S.drawn[0]);
  else {
    label.hidden = true;
    if (S.requests.length) show(0);
    window.__maskcliFirstDraw = performance.now();
  }
}

// The strip of a request's logical blocks: one cell per block (a pixel over several shows the most telling kind),
// hover names the block's keys, its page, its fill and its kind.
function stripFigure() {
  const S = DATA.serve, figure = element("figure"), canvas = element("canvas"), legend = element("p", undefined, "legend");
  figure.id = "pagemap";
  canvas.id = "pages"; canvas.height = 28; canvas.tabIndex = 0;
  const caption = element("figcaption");
  for (const kind of KIND_ORDER) {
    const swatch = element("span", undefined, "swatch");
    swatch.style.background = S.colours[kind];
    legend.append(swatch, `page ${kind === "unread" ? "not read" : kind}`);
  }
  figure.append(caption, canvas, legend);
  let R = null, kinds = [], r = 0;
  function blockAt(x) { return Math.min(kinds.length - 1, Math.floor(x * kinds.length / canvas.width)); }
  canvas.addEventListener("mousemove", (ev) => {
    if (!R || !kinds.length) return;
    const j = blockAt(ev.offsetX), ps = S.page_size, lo = j * ps, hi = Math.min((j + 1) * ps, R.keys[1]);
    const sharers = [];
    if (kinds[j] === "shared") S.requests.forEach((other, o) => { if (o !== r && other.pages.includes(R.pages[j])) sharers.push(o); });
    setInfo([`request ${r} · logical block ${j} → page ${R.pages[j]}`, `keys ${span(lo, hi)} · fill ${Math.max(0, hi - lo)}/${ps}`],
      `${KIND_WORDS[kinds[j]]}${sharers.length ? `: request${sharers.length > 1 ? "s" : ""} ${sharers.join(", ")} also read${sharers.length > 1 ? "" : "s"} page ${R.pages[j]}` : ""}`);
  });
  return {figure: figure, draw: function (request) {
    r = request; R = S.requests[r];
    if (!S.page_size) { figure.hidden = true; return; }
    kinds = blockKinds(R);
    caption.textContent = `request ${r}'s pages (logical block → page of ${S.page_size}): ${ids(R.pages, 8)} · last page ${R.last_fill}/${S.page_size}`;
    const room = Math.max(120, document.querySelector("main").clientWidth - 24);
    canvas.width = Math.max(1, Math.min(room, kinds.length * STRIP_CELL));
    const ctx = canvas.getContext("2d"), shown = new Int8Array(canvas.width).fill(-1);
    kinds.forEach((kind, j) => { // each block's pixels [j W / n, (j + 1) W / n): the most telling kind wins a pixel
      const a = Math.floor(j * canvas.width / kinds.length), z = Math.max(a + 1, Math.floor((j + 1) * canvas.width / kinds.length));
      for (let x = a; x < z; x++) shown[x] = Math.max(shown[x], KIND_ORDER.indexOf(kind));
    });
    ctx.clearRect(0, 0, canvas.width, canvas.height);
    for (let x = 0; x < canvas.width; x++) {
      if (shown[x] < 0) continue;
      ctx.fillStyle = S.colours[KIND_ORDER[shown[x]]];
      ctx.fillRect(x, 0, 1, canvas.height);
    }
    if (canvas.width >= kinds.length * 6) { // block edges where blocks are wide enough to tell apart
      ctx.strokeStyle = "rgba(0, 0, 0, 0.35)"; ctx.beginPath();
      for (let j = 1; j < kinds.length; j++) { const x = Math.round(j * canvas.width / kinds.length) + 0.5; ctx.moveTo(x, 0); ctx.lineTo(x, canvas.height); }
      ctx.stroke();
    }
  }};
}

function requestTable() {
  const S = DATA.serve, table = element("table"), head = element("thead"), body = element("tbody"), paged = S.page_size > 0;
  table.id = "requests";
  const names = ["req", "queries", "keys", "mask"].concat(paged ? ["pages", "last", "shared", "null", "written"] : []);
  const tr = element("tr");
  for (const name of names) tr.append(element("th", name));
  head.append(tr);
  S.requests.slice(0, TABLE_ROWS).forEach((R) => {
    const row = element("tr");
    row.dataset.request = String(R.request);
    const cells = [R.request, span(Math.max(R.queries[0], 0), R.queries[1]), span(R.keys[0], R.keys[1]),
      R.expression || (R.keys[1] === 0 ? "none (no keys)" : "none (more queries than keys)")];
    if (paged) cells.push(ids(R.pages, 6), `${R.last_fill}/${S.page_size}`, ids(R.shared, 3), ids(R.null, 3), ids(R.written, 3));
    for (const c of cells) row.append(element("td", String(c)));
    body.append(row);
  });
  table.append(element("caption", `requests (absolute positions${paged ? "; shared, null, written: logical blocks" : ""})` +
    (S.requests.length > TABLE_ROWS ? ` · ${S.requests.length - TABLE_ROWS} more not listed (serve --json lists every one)` : "")), head, body);
  return table;
}

function findingList() {
  const S = DATA.serve, box = element("section"), list = element("ul");
  box.id = "findings";
  box.append(element("h2", S.findings.length ? `findings (${S.findings.length})` : "no findings: the lengths, pages, writes and masks agree"));
  for (const f of S.findings) {
    const where = f.request === null ? "" : ` (request ${f.request}${f.cell ? `, query ${f.cell[0]} key ${f.cell[1]}` : ""})`;
    const li = element("li", `${f.severity} ${f.code}${where}: ${f.message}`, f.severity);
    if (f.request !== null && f.request < S.requests.length) {
      li.dataset.request = String(f.request);
      if (f.cell) li.dataset.cell = JSON.stringify(f.cell);
    }
    list.append(li);
  }
  box.append(list);
  return box;
}
