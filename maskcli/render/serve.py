"""A serving batch as rich tables (readable from 60 columns), JSON, and a figure of each request's mask and pages."""

from __future__ import annotations

import json

import numpy as np

from maskcli.checks.pagemap import PageMap
from maskcli.checks.registry import severity, wrong
from maskcli.serve.batch import ServeBatch

TABLE_REQUESTS = 16  # requests listed in the tables (--json lists every one)
FIGURE_REQUESTS = 6  # requests drawn
SHOWN_PAGES = 6


def _span(lo: int, hi: int) -> str:
    return "none" if hi <= lo else (f"{lo}" if hi - lo == 1 else f"{lo}-{hi - 1}")


def _ids(values, most: int = SHOWN_PAGES) -> str:
    values = [int(v) for v in values]
    if not values:
        return "none"
    return ", ".join(map(str, values[:most])) + (f", … ({len(values)})" if len(values) > most else "")


def header(b: ServeBatch, source: str, title: str) -> str:
    from maskcli.checks.pagemap import page_map

    pages = f"pages of {b.page_size} token{'s' if b.page_size != 1 else ''}, {page_map(b).distinct:,} distinct" if b.page_size else "no page table (contiguous keys)"
    layer = ("custom masks (draft trees)" if b.trees else "causal" if b.causal else "bidirectional") + (f", window {b.window}" if b.window else "") + (f", chunks of {b.chunk}" if b.chunk else "")
    return (f"{source}: {title}\n{b.requests} request{'s' if b.requests != 1 else ''}, {int(b.q_indptr[-1]):,} new tokens, "
            f"{pages}; {layer}")


def request_rows(b: ServeBatch, m: PageMap, limit: int | None = None) -> list[dict]:
    """Per request what the views show: positions, expression and its page map, as plain values; the first `limit`
    requests only, where only those are shown (the tables list TABLE_REQUESTS)."""
    rows = []
    bounds = np.searchsorted(m.owner, np.arange(b.requests + 1))
    for r in range(b.requests if limit is None else min(limit, b.requests)):
        q0, q_len, seq = b.frame(r)
        at = slice(bounds[r], bounds[r + 1])
        pages, fill = b.pages[at], m.fill[at]
        rows.append({
            "request": r, "queries": [max(q0, 0), q0 + q_len], "keys": [0, seq], "expression": b.expression(r),
            "pages": pages.tolist(), "last_fill": int(fill[-1]) if fill.size else 0,
            "shared": m.column[at][m.shared[at]].tolist(), "null": m.column[at][m.null[at]].tolist(),
            "written": m.column[at][m.written[at]].tolist(), "unread": m.column[at][~m.read[at]].tolist(),
        })
    return rows


def views(b: ServeBatch, rows: list[dict], findings, source: str, title: str, width: int = 120) -> list:
    from rich import box
    from rich.table import Table
    from rich.text import Text

    out: list = [Text(header(b, source, title), style="bold")]
    title_masks = "requests (absolute positions)"
    # a table's title wraps at the table's own width: keep it at least as wide as its title
    masks = Table(title=title_masks, title_justify="left", box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False,
                  min_width=min(len(title_masks), width))
    for name in ("req", "queries", "keys", "mask"):
        masks.add_column(name, overflow="fold")
    for row in rows[:TABLE_REQUESTS]:
        masks.add_row(str(row["request"]), _span(*row["queries"]), _span(*row["keys"]), row["expression"] or ("none (no keys)" if row["keys"][1] == 0 else "none (more queries than keys)"))
    out.append(masks)
    if b.page_size:
        title_pages = f"page map (logical block → page of {b.page_size})"
        pages = Table(title=title_pages, title_justify="left", box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False,
                      min_width=min(len(title_pages), width))
        for name in ("req", "pages", "last", "shared", "null", "written"):
            pages.add_column(name, overflow="fold")
        for row in rows[:TABLE_REQUESTS]:
            pages.add_row(str(row["request"]), _ids(row["pages"], SHOWN_PAGES if width >= 100 else 3), f"{row['last_fill']}/{b.page_size}",
                          _ids(row["shared"], 3), _ids(row["null"], 3), _ids(row["written"], 3))
        out.append(pages)
        out.append(Text("shared, null, written: logical blocks" + ("; blocks before the window are not read" if b.window else "")))
    if b.requests > TABLE_REQUESTS:
        out.append(Text(f"requests {TABLE_REQUESTS}-{b.requests - 1} not listed (--json lists every one)"))
    for note in b.notes:
        out.append(Text(f"note: {note}"))
    return out + findings_text(findings)


def finding_json(finding) -> dict:
    """code, severity (its rule's where it states none), the request and first (query, key) cell, null where there is
    none, and the message."""
    return {"code": finding.code, "severity": severity(finding), "request": finding.request,
            "cell": None if finding.cell is None else list(finding.cell), "message": finding.message}


def serve_dict(b: ServeBatch, rows: list[dict], findings, source: str, title: str) -> dict:
    return {
        "source": source, "engine": b.engine, "names": title, "page_size": b.page_size, "causal": b.causal, "window": b.window,
        "chunk": b.chunk, "requests": rows, "findings": [finding_json(f) for f in findings], "ok": not wrong(findings),
        "notes": list(b.notes),  # how a field was read (the table prints them as note: lines)
    }


def steps_json(reports: list[dict], findings) -> str:
    """One report per step file, and what the steps together say."""
    if len(reports) == 1:
        return json.dumps(reports[0])
    ok = all(r["ok"] for r in reports) and not wrong(findings)
    return json.dumps({"steps": reports, "findings": [finding_json(f) for f in findings], "ok": ok})


def findings_text(findings) -> list:
    """Each finding as a line (red for wrong), or the line that says there are none."""
    from rich.text import Text

    from maskcli.render.trace import STYLES  # coloured by severity, as trace's findings are

    if not findings:
        return [Text("no findings: the lengths, pages, writes and masks agree", style="green")]
    out = []
    for f in findings:
        where = f" (request {f.request}" + (f", query {f.cell[0]} key {f.cell[1]}" if f.cell else "") + ")" if f.request is not None else ""
        level = severity(f)
        out.append(Text(f"• {level} {f.code}{where}: {f.message}", style=STYLES[level]))
    return out


PAGE_COLOURS = {"read": (0.55, 0.45, 0.75), "shared": (0.93, 0.55, 0.15), "null": (0.35, 0.35, 0.35), "written": (0.2, 0.65, 0.3),
                "unread": (0.96, 0.96, 0.96)}


def serve_figure(b: ServeBatch, m: PageMap, source: str, title: str):
    """Per request (up to FIGURE_REQUESTS): its mask over absolute positions, and beside it its pages by kind."""
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    from maskcli.render.heatmaps import MASKED_RGB, VISIBLE_RGB, setup_matplotlib
    from maskcli.render.masks import FIGURE_MAX_CELLS

    setup_matplotlib()
    shown = min(b.requests, FIGURE_REQUESTS)
    figure = Figure(figsize=(10, 1.0 + 2.2 * shown))
    grid = figure.add_gridspec(max(shown, 1), 2, width_ratios=(3, 2))
    bounds = np.searchsorted(m.owner, np.arange(b.requests + 1))
    paged = b.page_size > 0
    for r in range(shown):
        ax = figure.add_subplot(grid[r, 0] if paged else grid[r, :])  # no page table: no strip to draw
        mask = b.mask(r)
        q0, q_len, seq = b.frame(r)
        if mask is not None:
            per_q, per_k = max(1, -(-q_len // FIGURE_MAX_CELLS)), max(1, -(-seq // FIGURE_MAX_CELLS))
            share = mask.intervals().block_counts(0, q_len, per_q, per_k).astype(float)
            share /= np.diff(np.minimum(np.arange(0, q_len + per_q, per_q), q_len))[:, None] * np.diff(np.minimum(np.arange(0, seq + per_k, per_k), seq))[None, :]
            rgb = (np.array(MASKED_RGB) + share[..., None] * (np.array(VISIBLE_RGB) - np.array(MASKED_RGB))) / 255
            ax.imshow(rgb, aspect="auto", interpolation="nearest", extent=(-0.5, seq - 0.5, q0 + q_len - 0.5, q0 - 0.5))
        ax.set_title(f"request {r}: {b.expression(r) or 'no mask'} · queries {_span(max(q0, 0), q0 + q_len)}", fontsize=9, loc="left")
        ax.set_ylabel("query", fontsize=8)
        ax.set_xlabel("key position", fontsize=8)
        ax.tick_params(labelsize=7)
        _integer_ticks(ax.xaxis, 0, seq)
        _integer_ticks(ax.yaxis, max(q0, 0), q0 + q_len)
        if not paged:
            continue
        strip = figure.add_subplot(grid[r, 1])
        at = slice(bounds[r], bounds[r + 1])
        kinds = np.full(bounds[r + 1] - bounds[r], "read", dtype=object)
        kinds[~m.read[at]] = "unread"
        kinds[m.written[at]] = "written"
        kinds[m.shared[at]] = "shared"
        kinds[m.null[at]] = "null"
        colours = np.array([PAGE_COLOURS[k] for k in kinds] or [(1, 1, 1)])[None]
        strip.imshow(colours, aspect="auto", interpolation="nearest")
        strip.set_yticks([])
        strip.set_title(f"pages: {_ids(b.pages[at], 4)}", fontsize=9, loc="left")
        strip.set_xlabel("logical block", fontsize=8)
        strip.tick_params(labelsize=7)
        _integer_ticks(strip.xaxis, 0, max(len(kinds), 1))
    handles = [Patch(color=np.array(VISIBLE_RGB) / 255, label="query sees key"), Patch(color=np.array(MASKED_RGB) / 255, label="masked")]
    if paged:
        handles += [Patch(color=c, label=f"page {k}") for k, c in PAGE_COLOURS.items()]
    figure.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=8, frameon=False)
    more = f" (requests {shown}-{b.requests - 1} not drawn)" if b.requests > shown else ""
    figure.suptitle(f"{source}: {title}{more}" + ("" if paged else " · no page table (contiguous keys)"), fontsize=10)
    figure.tight_layout(rect=(0, 0.04, 1, 0.97))
    return figure


def _integer_ticks(axis, lo: int, hi: int) -> None:
    """Every position where there are a few, else whole numbers only."""
    from matplotlib.ticker import FixedLocator, MaxNLocator

    axis.set_major_locator(FixedLocator(range(lo, hi)) if hi - lo <= 12 else MaxNLocator(integer=True))


def traced_steps(checked: list, followed: list = ()) -> list:
    """trace --api vllm: per captured step a line of its requests (new tokens / keys, mask) and its findings under it;
    then, per layer group of several steps, the findings across them ((layer group, findings) pairs)."""
    from rich.text import Text

    from maskcli.render import hanging

    out: list = []
    for c in checked:
        layers = f"{c.captured.layers[0]}{f' +{len(c.captured.layers) - 1} layers' if len(c.captured.layers) > 1 else ''}" if c.captured.layers else c.captured.builder
        lead = f"vllm step {c.captured.step} "
        if c.batch is None:
            out.append(hanging(lead, Text(f"({layers}) not read: {c.error}", style="yellow")))
            continue
        b = c.batch
        requests = "; ".join(_request(b, r) for r in range(min(b.requests, TABLE_REQUESTS)))
        more = f"; … ({b.requests} requests)" if b.requests > TABLE_REQUESTS else ""
        out.append(hanging(lead, Text(f"({layers}, pages of {b.page_size}) {b.requests} request{'s' if b.requests != 1 else ''}: "
                                      f"{requests}{more}")))
        out.extend(hanging("  ", line) for line in findings_text(c.findings) if c.findings)
    for where, found in followed:
        out.append(hanging("vllm steps ", Text(f"({where}) together, each request followed by its pages:")))
        out.extend(hanging("  ", line) for line in findings_text(found))
    return out


def _request(b: ServeBatch, r: int) -> str:
    q0, q_len, seq = b.frame(r)
    return f"{r}: queries {_span(max(q0, 0), q0 + q_len)} of {seq} keys, {b.expression(r) or 'no frame'}"


def traced_json(checked: list) -> list[dict]:
    """trace --api vllm's steps for --json: each as serve --json reports a file, with the fields as captured."""
    from maskcli.checks.pagemap import page_map

    out = []
    for c in checked:
        fields = {name: value.tolist() if isinstance(value, np.ndarray) else value for name, value in c.captured.fields.items()}
        head = {"step": c.captured.step, "builder": c.captured.builder, "layers": list(c.captured.layers), "fields": fields}
        if c.batch is None:
            out.append({**head, "error": c.error, "ok": False})
        else:
            out.append({**head, **serve_dict(c.batch, request_rows(c.batch, page_map(c.batch)), c.findings, c.source, "vLLM CommonAttentionMetadata")})
    return out
