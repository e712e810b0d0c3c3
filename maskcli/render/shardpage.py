"""shard's --html page: the token -> rank strip, a table per mask (layer type), each rank's ring steps, the findings.

One self-contained file as the other pages are (html.document: its data, script and styles inline, nothing
fetched). The data is `--json`'s report plus what the page draws from: the strip's spans (the rank holding each
span's middle, and the spans where the rank changes more than once) and the cu_seqlens columns the table lists.
The ring-step grid is coloured as `blocks` colours full, partial and empty blocks (html.BLOCK_TINTS).
"""

from __future__ import annotations

from maskcli.render.html import BLOCK_TINTS, document, script_json
from maskcli.render.shard import header, report_data, seqlens_columns, spans
from maskcli.shard.plan import Report

STRIP_SPANS = 2048  # spans the strip is drawn from: a pixel column each at most, whatever the length
SEVERITY_RGB = {"wrong": (214, 39, 40), "suspicious": (191, 135, 0), "note": (110, 110, 118)}

BODY = """<main class="shard">
<section>
<h2>token &rarr; rank</h2>
<canvas id="strip" width="960" height="36" tabindex="0" aria-label="which rank holds each position: hover for the positions and their rank"></canvas>
<div class="strip-axis"><span id="strip-first"></span><span id="strip-last"></span></div>
<p class="legend" id="rank-legend"></p>
<pre id="strip-cell" aria-live="polite">hover the strip for the positions and their rank</pre>
</section>
<section id="masks"></section>
<section><h2>findings</h2><ul id="findings"></ul></section>
</main>"""


def page_data(report: Report) -> dict:
    """What the page shows, as JSON: the report (as --json prints it), the strip, the cu_seqlens columns, colours."""
    edges, owner, mixed = spans(report.layout, STRIP_SPANS)
    data = report_data(report)
    data["page"] = "shard"
    data["strip"] = {"edges": edges.tolist(), "owner": owner.tolist(), "mixed": mixed.astype(int).tolist()}
    data["columns"] = [{"name": name, "values": [[int(v) for v in row] for row in values]} for name, values in seqlens_columns(report)]
    data["colours"] = {"blockTint": ["rgb({},{},{})".format(*rgb) for rgb in BLOCK_TINTS],
                       "severity": {name: "rgb({},{},{})".format(*rgb) for name, rgb in SEVERITY_RGB.items()}}
    return data


def shard_page(report: Report) -> str:
    title, _, subtitle = header(report).partition("\n")
    return document(title, subtitle, BODY, script_json(page_data(report)), ("attend.js", "shard.js"))
