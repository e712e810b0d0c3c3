"""serve's --html page: one request's mask at a time in the page's viewer, its logical blocks as a strip coloured by
what happens to their pages, every request's positions and page map in a table, and the findings.

The masks are embedded as html.py's other pages embed them (pagedata.py: runs of affine key-interval rows, so a
request of 32k keys is a few numbers); the requests and findings are the same dicts `serve --json` prints.
"""

from __future__ import annotations

from maskcli.errors import MaskError
from maskcli.render.serve import PAGE_COLOURS, header
from maskcli.serve.batch import ServeBatch

PAGE_MASKS = 1024  # requests whose masks a page embeds (the table and the JSON list every request)
PAGE_NUMBERS = 3_000_000  # numbers of interval runs and page ids a page embeds (about 16 MB), as pagedata.BUDGET


def serve_page(b: ServeBatch, rows: list[dict], findings: list[dict], source: str, title: str) -> str:
    """The whole page; `rows` are render.serve.request_rows, `findings` the JSON dicts of the findings."""
    from maskcli.render.html import page
    from maskcli.render.pagedata import mask_data

    pages = sum(len(row["pages"]) for row in rows)
    if pages > PAGE_NUMBERS:
        raise MaskError(f"--html: the batch's page tables hold {pages:,} pages, past the {PAGE_NUMBERS:,} a page embeds: "
                        f"use --json (it lists every page) or --png")
    drawn, masks, numbers = [], [], pages
    for r in range(b.requests):
        mask = b.mask(r)
        if mask is None:
            continue
        data = mask_data(mask)
        numbers += sum(run["n"] * (1 + 4 * run["k"]) for run in data["rows"])
        if len(drawn) == PAGE_MASKS or numbers > PAGE_NUMBERS:
            break
        drawn.append(r)
        masks.append(data)
    more = sum(b.mask(r) is not None for r in range(drawn[-1] + 1 if drawn else 0, b.requests))
    serve = {
        "requests": rows, "drawn": drawn, "undrawn": more, "findings": findings, "page_size": b.page_size,
        "null_page": b.null_page, "window": b.window, "chunk": b.chunk,
        "colours": {kind: "rgb({},{},{})".format(*(round(255 * c) for c in rgb)) for kind, rgb in PAGE_COLOURS.items()},
    }
    first, _, rest = header(b, source, title).partition("\n")
    return page({"page": "serve", "masks": masks, "serve": serve}, f"serve: {first}", rest.replace("\n", " "))
