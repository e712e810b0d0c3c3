"""A packed batch's check as rich tables (readable from 60 columns), JSON, and a figure of each path's mask."""

from __future__ import annotations

import json

import numpy as np

from maskcli.checks.registry import severity
from maskcli.diff import row_words
from maskcli.pack.findings import Report
from maskcli.render import STYLES, hanging

SHOWN_STARTS = 12  # document starts listed per row in the table (--json lists every one)
TABLE_ROWS = 8  # batch rows listed per field in the table
FIGURE_ROWS = 4  # batch rows drawn
LONGEST_COMMAND = 10_000  # characters: a longer command (a huge --ids) is left out of --json


def _too_long(path) -> str:
    """What makes a path's command long, in terms of the field the user gave: its documents, or its padding."""
    text, ids = path.expression, path.options.ids or ""
    if len(ids) > len(text):
        return f"its --ids would list each of the {path.options.length:,} tokens to say where the padding is"
    documents = text.count(",") + text.count(";") + 1
    return f"its {text.partition('(')[0]}(sizes=[...]) would list each of the {documents:,} documents {path.reads} gives"


def _list(values, most: int = SHOWN_STARTS) -> str:
    values = [int(v) for v in values]
    if not values:
        return "none"
    text = ", ".join(map(str, values[:most]))
    return text + (f", … ({len(values)} in all)" if len(values) > most else "")


def _runs(flags: np.ndarray) -> list[tuple[int, int]]:
    edges = np.flatnonzero(np.diff(np.concatenate(([0], flags.astype(np.int8), [0]))))
    return [(int(a), int(b)) for a, b in zip(edges[::2], edges[1::2])]


def _run_text(runs: list[tuple[int, int]]) -> str:
    if not runs:
        return "none"
    text = ", ".join(f"{a}" if b - a == 1 else f"{a}-{b - 1}" for a, b in runs[:6])
    return text + (f", … ({len(runs)} runs)" if len(runs) > 6 else "")


def _starts(report: Report, bound, row: int) -> np.ndarray:
    """Where a field starts documents on tokens that no field calls padding (a padded position_id of 0 starts none)."""
    return np.flatnonzero(bound.starts[row] & ~report.pad[row])


def header(report: Report, source: str) -> str:
    b = report.batch
    names = ", ".join(b.where(name) for name in b.fields) + (", attention_mask (4-D)" if b.keep_4d is not None else "")
    names += ", position_ids (mRoPE, 3 rows)" if b.mrope is not None and "position_ids" not in b.fields else ""
    ref = f"documents as {report.reference.name} says" if report.reference is not None else "no field says where documents are"
    if report.majority:
        others = [x.name for x in report.fields if x.documents and x.name not in report.majority and x.name != "eos"]
        ref = f"documents as {' and '.join(report.majority)} say (the majority; {' and '.join(others)} disagree{'s' * (len(others) == 1)})"
    return f"{source}: B={b.rows} rows × L={b.length:,} tokens\nfields: {names}\n{ref}\ntransformers: {report.model.text}"


def views(report: Report, source: str, width: int = 120) -> list:
    """The report as rich renderables; under 100 columns each row lists its first few document starts only."""
    from rich import box
    from rich.table import Table
    from rich.text import Text

    from maskcli.render import labelled

    out: list = [labelled(line, "bold") for line in header(report, source).split("\n")]  # wrapped never to column 0
    fields = Table(title="document boundaries per field", title_justify="left", box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
    for name, style in (("field", "bold"), ("row", None), ("document starts", None), ("padding", None), ("agrees", None)):
        fields.add_column(name, style=style, overflow="fold")
    differs = {d.field: d for d in report.disagreements}
    for bound in report.fields:
        agrees = "reference" if bound is report.reference else "padding only" if not bound.documents else (
            f"no: {differs[bound.name].count:,} tokens" if bound.name in differs else "yes")
        for row in range(min(report.batch.rows, TABLE_ROWS)):
            pad = _run_text(_runs(bound.pad[row])) if bound.pad is not None else "—"
            starts = _list(_starts(report, bound, row), SHOWN_STARTS if width >= 100 else 4) if bound.documents else "—"
            fields.add_row(bound.name if row == 0 else "", str(row), starts, pad, agrees if row == 0 else "")
    if report.batch.rows > TABLE_ROWS:
        fields.caption = f"rows {TABLE_ROWS}-{report.batch.rows - 1} not listed: --json has every row"
    out.append(fields if report.fields else Text("document boundaries: no field marks any"))
    paths = Table(title="attention paths", title_justify="left", box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
    for name in ("path", "reads", "cross-doc cells", "sees padding"):
        paths.add_column(name, overflow="fold", style="bold" if name == "path" else None)
    masks = []
    for c in report.checks:
        p = c.path
        if not p.applies:
            paths.add_row(p.name, p.reads, Text("does not apply", style="dim"), "")
            continue
        cross = "—" if c.cross_cells is None else f"{c.cross_cells:,}"
        paths.add_row(p.name, p.reads, Text(cross, style="red" if c.cross_cells else None),
                      Text(f"{c.pad_cells:,}", style="red" if c.pad_cells else None))
        command = p.command()
        if command is None:
            command = "the 4-D attention_mask as given (no expression rebuilds it)"
        elif len(command) > LONGEST_COMMAND:  # whole or not at all: a command cut short would not run
            command = f"{_too_long(p)}: a command of {len(command):,} characters, left out here and in --json"
        masks.append(hanging(f"  {p.name}: ", Text(command)))
    out.append(paths)
    out.append(Text("the mask each path builds:"))
    out += masks
    unequal = [d for d in report.differences if not d.equal]
    if not report.differences:
        out.append(Text("paths: only one applies", style="dim"))
    elif not unequal:
        out.append(Text("paths: all agree (exact, from key intervals, on real tokens)", style="green"))
    said: dict[tuple, str] = {}
    for d in unequal:
        a, b = d.a.text.split(":")[0], d.b.text.split(":")[0]
        same = (d.only_a, d.only_b, tuple((r.batch, r.query, tuple(r.a), tuple(r.b)) for r in d.rows))
        if same in said:  # a path that builds the same mask as one already compared
            out.append(Text(f"{a} and {b} disagree the same way as {said[same]}", style="yellow"))
            continue
        said[same] = f"{a} and {b}"
        out.append(Text(f"{a} and {b} disagree: only {a} allows {d.only_a:,} cells, only {b} {d.only_b:,}", style="yellow"))
        out += [hanging("  ", Text(line), style="yellow") for line in row_words(d, a, b)]
    if report.findings:
        worst = "red" if any(severity(f) == "wrong" for f in report.findings) else "yellow"
        out += [Text("findings:", style=worst), *(hanging("• ", Text(f.message), style=STYLES[severity(f)]) for f in report.findings)]
    else:
        out.append(Text("findings: none", style="green"))
    if report.notes:
        out += [Text("notes:", style="dim"), *(hanging("• ", Text(n), style="dim") for n in report.notes)]
    return out


def pack_json(report: Report, source: str) -> str:
    b = report.batch
    fields = {name: {"key": b.sources[name], "shape": list(array.shape)} for name, array in b.fields.items()}
    if b.keep_4d is not None:
        fields["attention_mask"] = {"key": b.sources["attention_mask"], "shape": list(b.keep_4d.shape), "convention": b.mask_convention}
    data = {
        "batch": {"source": source, "rows": b.rows, "length": b.length, "tokens": b.tokens, "fields": fields},
        "reference": report.reference.name if report.reference is not None else None,
        "use_cache": {"value": report.model.use_cache, "from": report.model.said_by},
        "majority": report.majority,  # the fields that outvoted another to say where the documents are (else [])
        "boundaries": [
            {"field": x.name, "how": x.how, "documents": x.documents,
             "rows": [{"starts": _starts(report, x, r).tolist(), "padding": _runs(x.pad[r]) if x.pad is not None else None} for r in range(b.rows)]}
            for x in report.fields
        ],
        "fields_agree": not report.disagreements,
        "disagreements": [
            {"field": d.field, "reference": d.reference, "count": d.count,
             "first": [{"row": r, "position": c, "reference_starts": s} for r, c, s in d.first]}
            for d in report.disagreements
        ],
        "paths": [_path_json(c) for c in report.checks],
        "paths_agree": report.paths_agree,
        "differences": [
            {"a": d.a.text.split(":")[0], "b": d.b.text.split(":")[0], "equal": d.equal, "only_a": d.only_a, "only_b": d.only_b, "both": d.both,
             "rows": [{"row": r.batch, "query": r.query, "a": r.a, "b": r.b, "only_a": r.only_a, "only_b": r.only_b} for r in d.rows]}
            for d in report.differences
        ],
        "findings": [{"code": f.code, "severity": severity(f), "message": f.message} for f in report.findings],
        "notes": report.notes,
        "ok": report.ok,
    }
    return json.dumps(data)


def _path_json(c) -> dict:
    p = c.path
    command = p.command() if p.applies else None
    out = {"name": p.name, "title": p.title, "applies": p.applies, "reads": p.reads, "expression": p.expression,
           "command": command if command is None or len(command) <= LONGEST_COMMAND else None, "notes": p.notes}
    if p.options is not None:
        out["lengths"] = [int(v) for v in p.options.lengths.split(",")] if p.options.lengths else None
        out["padded_ids"] = p.options.ids is not None
    out["condition"] = p.condition  # what its mask rests on that nobody stated (its leak is then suspicious)
    out["cross_document_cells"] = c.cross_cells
    out["first_cross_document"] = [{"row": r, "query": q, "key": k} for r, q, k in c.first_cross]
    out["padding_cells"] = c.pad_cells if p.applies else None
    return out


def pack_figure(report: Report, source: str):
    """One panel per (batch row, applicable path), with the reference's document boundaries and the padding; the
    cells where a real token sees a real token of another document are drawn in CROSS_RGB (per block on a long
    batch: a block with any such cell)."""
    from maskcli.counting import block_shares
    from maskcli.render.heatmaps import CROSS_RGB, MASKED_RGB, VISIBLE_RGB, Panel, heatmap_figure, position_extent
    from maskcli.render.masks import FIGURE_MAX_CELLS
    from maskcli.render.structure import Structure, _label_runs, _runs as pad_runs

    b = report.batch
    length = b.length
    per = max(1, -(-length // FIGURE_MAX_CELLS))
    labels = report.reference.labels() if report.reference is not None else None
    grid = []
    crossed = False
    for row in range(min(b.rows, FIGURE_ROWS)):
        marks = Structure(0, length, 0, length, "doc" if labels is not None else None,
                          _label_runs(labels[row]) if labels is not None else (), pad_runs(report.pad[row], 0), pad_runs(report.pad[row], 0))
        panels = []
        for c in report.checks:
            if not c.path.applies:
                continue
            title = f"{c.path.name} · reads {c.path.reads}" + (f"\nbatch row {row}" if b.rows > 1 else "")
            if c.cross_cells:
                title += f"\n{c.cross_cells:,} cross-document cells" + (" in the whole batch" if b.rows > 1 else "")
            cross = cross_cells(report, c, row, per)
            crossed |= cross is not None and bool(cross.any())
            if per == 1:
                labels_axis = [str(i) for i in range(length)]
                panels.append(Panel(title, c.path.mask.cells(row), labels_axis, labels_axis, marks=marks, cross=cross))
            else:
                share = block_shares(c.path.mask, row, 0, per, per)
                share = np.where(share > 0, 0.3 + 0.7 * share, 0.0)
                panels.append(Panel(title, share, None, None, extent=position_extent(0, length, 0, length), marks=marks, cross=cross))
        grid.append(panels)
    ref = f"boundaries: documents as {report.reference.name} says" if report.reference is not None else "no field marks documents"
    title = f"{source}: each attention path's mask\n{ref}" + (f"; rows {FIGURE_ROWS}-{b.rows - 1} not drawn" if b.rows > FIGURE_ROWS else "")
    legend = [(VISIBLE_RGB, "may attend (True)"), (MASKED_RGB, "masked (False)")]
    if crossed:
        legend.append((CROSS_RGB, "may attend, across documents (a leak)" + ("; a block with any such cell" if per > 1 else "")))
    return heatmap_figure(grid, title, legend)


def cross_cells(report: Report, c, row: int, per: int) -> np.ndarray | None:
    """Bool cells (or blocks of per x per) where path `c` lets a real query see a real key of another document (as the
    reference says), for batch row `row`; None where nothing leaks or it cannot be told per block."""
    if not c.cross_cells or report.reference is None:
        return None
    labels, real = report.reference.labels()[row], ~report.pad[row]
    if per == 1:
        keep = c.path.mask.cells(row).astype(bool)
        return keep & (labels[:, None] != labels[None, :]) & real[:, None] & real[None, :]
    if c.path.expression is None or report.pad[row].any():
        return None  # padded query rows would have to be cut out of each block: no highlight rather than a wrong one
    from maskcli import expression as ex
    from maskcli.counting import block_shares
    from maskcli.mask import from_terms
    from maskcli.pack.paths import documents

    segment, _ = documents("segment", report.reference.starts, None)
    # the path's terms and-ed with not-the-reference's-segments, at its own positions: a tree, no text parsed back
    across = from_terms(ex.both(c.path.mask.expression, ex.Not(segment)), c.path.mask.frame)
    return block_shares(across, row, 0, per, per) > 0
