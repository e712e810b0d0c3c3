"""The self-contained HTML page of --html: one file, its script, styles and data inline, that any browser opens.

    mask_page(mask)  diff_page(a, b)  blocks_page(mask, 128, 128)  attend_page(run, names, pairs)  ->  str

The page draws the mask on a canvas from its rows' key intervals (pagedata.py: runs of affine rows), exactly at
every zoom, with the structure marks the figures draw; hover shows the cell, its labels and positions, its value
or category and --why's explanation (why.js words it as each kind does). The script lives in page.js, why.js and
attend.js, the styles in page.css: package data, read here and inlined. Nothing is fetched from anywhere.
"""

from __future__ import annotations

import html
import json
from importlib import resources

import numpy as np

from maskcli.mask import Mask
from maskcli.render.diff import ONLY_B_RGB
from maskcli.render.heatmaps import LEAK_RGB, MASKED_RGB, VISIBLE_RGB
from maskcli.render.pagedata import mask_data
from maskcli.render.structure import CACHE_RGB, MARK_RGB

MAX_STAGE_CELLS = 1 << 20  # numbers of attend's stages a page embeds (attend is small-L: its tables are dense)
MAX_PAGE_BLOCKS = 1 << 18  # blocks (over batch rows) whose category a blocks page embeds, one character each
# the blocks page tints each block over its cells in the hues blocks' terminal map gives its symbols (render/blocks.py
# STYLES: green █ full, yellow ▒ partial, red · empty): the figure's blue and grey are the cells' own colours here
BLOCK_TINTS = ((44, 160, 44), (255, 190, 0), (214, 39, 40))  # full, partial, empty: the page data's '0', '1', '2'
BLOCK_ALPHA = 0.35


def _rgb(unit) -> list[int]:
    return [round(255 * c) for c in unit]


COLOURS = {
    "visible": list(VISIBLE_RGB), "masked": list(MASKED_RGB), "onlyA": list(LEAK_RGB), "onlyB": list(ONLY_B_RGB),
    "outside": [255, 255, 255], "mark": "rgb({},{},{})".format(*_rgb(MARK_RGB)), "cache": "rgb({},{},{})".format(*_rgb(CACHE_RGB)),
    "grid": "rgba(0, 0, 0, 0.35)", "cells": "rgba(0, 0, 0, 0.13)",
    "blockTint": ["rgb({},{},{})".format(*rgb) for rgb in BLOCK_TINTS], "blockAlpha": BLOCK_ALPHA,
}
DARK = {"masked": [58, 58, 62], "outside": [24, 24, 27], "mark": "rgb(235,235,235)", "grid": "rgba(255, 255, 255, 0.35)",
        "cells": "rgba(255, 255, 255, 0.12)"}


def _asset(name: str) -> str:
    return resources.files("maskcli.render").joinpath(name).read_text(encoding="utf-8")


def _legend(data: dict) -> str:
    page = data["page"]
    def swatch(r, g, b, text):  # the masked grey follows the page's light or dark colours (page.css)
        kind = " masked" if (r, g, b) == MASKED_RGB else ""
        return f'<span class="swatch{kind}" style="background: rgb({r},{g},{b})"></span>{text}'

    if page == "diff":
        items = [(VISIBLE_RGB, "in both"), (LEAK_RGB, "only in A"), (ONLY_B_RGB, "only in B"), (MASKED_RGB, "in neither")]
    elif page == "attend":
        items = [(MASKED_RGB, "masked (hidden)"), (LEAK_RGB, "masked, yet weighted")]
    else:
        items = [(VISIBLE_RGB, "kept (may attend)"), (MASKED_RGB, "masked")]
    marks = "" if page == "attend" else (" · lines: label boundaries · hatched: padding · orange dashes: the KV cache edge"
                                          + (" · grey dashes: blocks" if page == "blocks" else ""))
    shown = " ".join(swatch(*rgb, html.escape(text)) for rgb, text in items) + html.escape(marks)
    if page == "blocks":
        blocks = data["blocks"]
        tints = " ".join(f'<span class="swatch" style="background: rgb({r},{g},{b}); opacity: {BLOCK_ALPHA}"></span>{name}'
                         for (r, g, b), name in zip(BLOCK_TINTS, ("full", "partial", "empty")))
        shown += ("<br>blocks tinted over their cells: " + tints if blocks["map"] is not None
                  else "<br>" + html.escape(blocks["untinted"]))
    return shown


# Inside <script> the HTML parser looks for `</script` and, after `<!--`, for `<script` (its "double escaped"
# state, which a later `</script>` only leaves): neither may appear in the JSON of labels and tokens. JSON has
# <, > and & only inside strings, where \u escapes read back the same; U+2028/9 end lines in older JavaScript.
_SCRIPT_SAFE = str.maketrans({"<": "\\u003c", ">": "\\u003e", "&": "\\u0026", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def script_json(value) -> str:
    """`value` as JSON text that can sit inside a <script> element: no character of it can end or change the element."""
    return json.dumps(value, separators=(",", ":")).translate(_SCRIPT_SAFE)


def document(title: str, subtitle: str, body: str, payload: str, scripts: tuple[str, ...]) -> str:
    """A whole page: the styles, `body`, the data as JSON in a script tag (script_json: no text can end it, and the
    dark scheme's colours merged in before any script reads it), then the scripts (package assets), all inline."""
    dark = script_json(DARK)
    script = "\n".join(_asset(name) for name in scripts)
    return f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<meta http-equiv="Content-Security-Policy" content="default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; img-src data:">
<title>{html.escape(title)}</title>
<style>
{_asset("page.css")}
</style>
</head>
<body>
<header><h1>{html.escape(title)}</h1><p class="sub">{html.escape(subtitle)}</p></header>
{body}
<script type="application/json" id="mask-data">{payload}</script>
<script>
if (window.matchMedia && window.matchMedia("(prefers-color-scheme: dark)").matches) {{
  const data = document.getElementById("mask-data");
  const parsed = JSON.parse(data.textContent);
  Object.assign(parsed.colours, {dark});
  data.textContent = JSON.stringify(parsed);
}}
</script>
<script>
{script}
</script>
</body>
</html>
"""


def page(data: dict, title: str, subtitle: str) -> str:
    """The viewer's page (show, diff, blocks, attend): the mask's canvas, rulers, panels and the hover aside."""
    body = f"""<main>
<section class="view">
<div class="bar" id="viewer-bar"><label>batch row <select id="batch"></select></label>
<span class="keys">drag or arrow keys pan · wheel or +/- zoom · 0 resets · hover (or pan to the centre) to read a cell</span></div>
<div class="plot" id="plot">
<div class="axis-name" id="name-k">key</div><div class="axis-name" id="name-q">query</div>
<div class="ruler k" id="ruler-k" aria-hidden="true"></div><div class="ruler q" id="ruler-q" aria-hidden="true"></div>
<canvas id="mask" width="480" height="480" tabindex="0" aria-label="the mask: arrow keys pan, + and - zoom, 0 resets; the cell at the centre is described beside it"></canvas>
<div class="ruler" id="marks-k"></div>
</div>
<div id="panels"></div>
</section>
<aside><div class="scroll"><pre id="cell" aria-live="polite"></pre><pre id="why"></pre>
<p id="status" aria-live="polite"></p>
<p class="legend">{_legend(data)}</p></div></aside>
</main>"""
    return document(title, subtitle, body, script_json({**data, "colours": COLOURS}), ("why.js", "attend.js", "serve.js", "page.js"))


def _sub(mask: Mask, how: str) -> str:
    f = mask.frame
    return f"{f.describe()} · {mask.batch} batch row{'s' if mask.batch > 1 else ''} · drawn from its {how}"


def mask_page(mask: Mask) -> str:
    """show's page: the mask, hover with --why."""
    data = mask_data(mask)
    return page({"page": "show", "masks": [data]}, mask.title, _sub(mask, data["how"]))


def diff_page(a: Mask, b: Mask) -> str:
    """diff's page: cells coloured by category (only in A, only in B, both, neither), each side's --why on hover."""
    from maskcli.diff import check_comparable

    check_comparable(a, b)
    first, second = mask_data(a), mask_data(b)
    title = f"A: {a.title}  vs  B: {b.title}"
    return page({"page": "diff", "masks": [first, second]}, title, _sub(a, first["how"]))


def blocks_page(mask: Mask, q_block: int, kv_block: int) -> str:
    """blocks' page: the mask with FlexAttention's block grid; hover says whether the block is full, partial or empty."""
    data = mask_data(mask)
    sub = _sub(mask, data["how"]) + f" · blocks of {q_block} queries x {kv_block} keys (padded to whole blocks, as create_block_mask)"
    return page({"page": "blocks", "masks": [data], "blocks": {"q": q_block, "kv": kv_block, **block_tints(mask, q_block, kv_block)}},
                mask.title, sub)


def block_tints(mask: Mask, q_block: int, kv_block: int) -> dict:
    """The page's block categories: per batch row a string of n_q x n_kv characters, row by row, '0' full,
    '1' partial, '2' empty (BLOCK_TINTS' order), from blockmask.layout as `blocks` counts them; past MAX_PAGE_BLOCKS,
    none, and the words the legend says instead."""
    from maskcli.blockmask import EMPTY, FULL, PARTIAL, layout

    f = mask.frame
    count = mask.batch * -(-f.q_len // q_block) * -(-f.k_len // kv_block)
    if count > MAX_PAGE_BLOCKS:
        return {"map": None, "untinted": f"blocks not tinted: {count:,} blocks, past the {MAX_PAGE_BLOCKS:,} a page tints "
                                         "(a larger --block tints them; the PNG and the terminal map show every block)"}
    found = layout(mask, q_block, kv_block)
    order = np.zeros(3, dtype=np.uint8)
    order[[FULL, PARTIAL, EMPTY]] = [0, 1, 2]
    return {"map": [(order[found.categories(b)] + ord("0")).tobytes().decode("ascii") for b in range(mask.batch)]}


def attend_page(run, names: list[str], pairs: list[tuple[int, int]]) -> str:
    """attend's page: the stages of each chosen (batch, head) pair side by side, with hover values and --why."""
    import torch

    from maskcli.errors import MaskError
    from maskcli.render.stages import json_nested, run_header

    s = run.stages
    shape = s.keep.shape
    cells = len(pairs) * shape[2] * (shape[3] * len(names) + s.output.shape[-1])
    if cells > MAX_STAGE_CELLS:
        raise MaskError(f"--html would embed {cells:,} stage values, past the {MAX_STAGE_CELLS:,} a page holds: "
                        "choose fewer with --batch-index/--head/--stages, or view --rows/--keys")

    def per_pair(tensor, last: int):
        full = torch.broadcast_to(tensor, (*shape[:3], last))
        return [json_nested(full[b, h]) for b, h in pairs]

    values = {name: per_pair(s.stage(name), s.output.shape[-1] if name == "output" else shape[3]) for name in names}
    keep = [torch.broadcast_to(s.keep, shape)[b, h].to(torch.uint8).tolist() for b, h in pairs]
    stages = {"names": names, "pairs": [list(p) for p in pairs], "lq": shape[2], "lk": shape[3], "d": s.output.shape[-1],
              "values": values, "keep": keep}
    data = {"page": "attend", "masks": [mask_data(run.mask)], "stages": stages}
    return page(data, f"attend: {run.mask.title}", run_header(run.mask, s, run.device, run.source))


def save_page(text: str, path) -> None:
    """Write the page whole, or not at all (a temporary file renamed over the path)."""
    from maskcli.files import atomic_write

    def write(temp: str) -> None:
        with open(temp, "w", encoding="utf-8") as handle:
            handle.write(text)

    atomic_write(path, write)
