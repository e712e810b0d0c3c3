"""A mask split across ranks: a token -> rank strip, a per-rank table, the ring-step grid, JSON and a figure."""

from __future__ import annotations

import json
import numpy as np

from maskcli.blockmask import EMPTY, FULL, PARTIAL
from maskcli.render.blocks import SYMBOLS, symbols
from maskcli.checks.registry import severity
from maskcli.text import Finding
from maskcli.shard.layouts import Layout
from maskcli.shard.plan import Report
from maskcli.shard.work import Split

DIGITS = "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"  # a rank a character, up to 62 ranks
MIXED = "*"
SHOWN_SEQLENS = 6  # cu_seqlens numbers a table cell lists (--json has every one)
NAMES = {EMPTY: "empty", PARTIAL: "partial", FULL: "full"}


def spans(layout: Layout, count: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The positions cut into `count` equal spans (at most one a position): their edges (count + 1), the rank holding
    each span's middle (-1: none), and whether the span holds two or more changes of rank. From the runs, not per token."""
    n = layout.length
    count = min(count, n)
    edges = np.linspace(0, n, count + 1).round().astype(np.int64)
    owner = layout.owner()
    changes = np.flatnonzero(owner[1:] != owner[:-1]) + 1  # positions where the rank changes
    inside = np.searchsorted(changes, edges[1:], side="left") - np.searchsorted(changes, edges[:-1], side="right")
    return edges, owner[(edges[:-1] + edges[1:]) // 2], inside >= 2


def strip(layout: Layout, width: int) -> str:
    """One character per span of positions: the rank holding its middle (0-9a-zA-Z), * where the span holds two
    or more changes of rank (stripes narrower than a character)."""
    _, middle, mixed = spans(layout, width)
    chars = np.array(list(DIGITS[: layout.ranks]) + ["?"])
    out = np.where(mixed, MIXED, chars[np.where(middle >= 0, middle, layout.ranks)])
    return "".join(out.tolist())


def _short(values: np.ndarray) -> str:
    values = [int(v) for v in values]
    text = ",".join(map(str, values[:SHOWN_SEQLENS]))
    return text + (f",…({len(values)})" if len(values) > SHOWN_SEQLENS else "")


def _number(value: float) -> str:
    for unit, size in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(value) >= size:
            return f"{value / size:.3g}{unit}"
    return f"{value:.0f}"


def table(report: Report, split: Split, first: bool, width: int = 120) -> list:
    """Per rank: tokens, padding, the mask's cells, FLOPs, ratio to the mean, the ring steps it may skip, and (in the
    first table) its cu_seqlens, in TransformerEngine's convention and on its own tokens in local order: columns where
    the table fits `width`, else lines of their own below it (a column cut to the width would hide the numbers)."""
    from rich.text import Text

    rows = _rows(report, split)
    extra = seqlens_columns(report) if first else []
    for name, values in extra:
        rows[0].append(name)
        for r, row in enumerate(rows[1:]):
            row.append(_short(values[r]))
    if not extra:
        return [_grid(rows, 0)]
    cells = [[row[c] for row in rows] for c in range(len(rows[0]))]
    needed = sum(max(len(_plain(v)) for v in column) for column in cells) + 2 * (len(cells) - 1)
    if needed <= width:
        return [_grid(rows, len(extra))]
    digits = len(str(report.layout.ranks - 1))
    lines = [line for name, values in extra
             for line in [f"{name} per rank:"] + [f"{r:>{digits}} {_short(v)}" for r, v in enumerate(values)]]
    return [_grid([row[: len(row) - len(extra)] for row in rows], 0), Text("\n".join(lines))]


def seqlens_columns(report: Report) -> list[tuple[str, list]]:
    """The cu_seqlens the table lists: TransformerEngine's (head-tail and per-document layouts), and each rank's own
    tokens cut where the document changes (a varlen kernel's cu_seqlens on that rank) where the mask has several
    documents and they differ from TE's."""
    out = []
    if report.te is not None:
        out.append(("cu_seqlens (TE)", report.te[1]))
    local = report.local
    several = any(v.size > 2 for v in local)
    if several and (report.te is None or any(not np.array_equal(a, b) for a, b in zip(local, report.te[1]))):
        out.append(("cu_seqlens (local)", local))
    return out


def _plain(value: str) -> str:
    return value.replace("[bold red]", "").replace("[/]", "")


def _grid(rows: list, texts: int):
    """A table of right-aligned numbers, its last `texts` columns (cu_seqlens lists) left-aligned."""
    from rich.table import Table

    grid = Table(box=None, pad_edge=False, show_edge=False)
    for index, name in enumerate(rows[0]):
        grid.add_column(name, justify="left" if index >= len(rows[0]) - texts else "right")
    for row in rows[1:]:
        grid.add_row(*row)
    return grid


def _rows(report: Report, split: Split) -> list[list[str]]:
    """The header, then a row of strings per rank."""

    layout = report.layout
    tokens, slots = layout.tokens(), layout.slots()
    padded = bool((slots != tokens).any())
    steps = split.steps()
    # the work: visible cells, times the heads a rank computes them for where there are several
    cells = "cells x heads" if split.mask.heads > 1 or layout.heads is not None else "cells"
    header = [name for name, shown in (("rank", True), ("tokens", True), ("pad", padded), (cells, True), ("FLOPs", True),
                                       ("x mean", True), ("skip", steps is not None)) if shown]
    out = [header]
    ratios, work, flops = split.ratios(), split.work(), split.flops()
    worst = split.imbalance > 1.0 + 1e-9
    for r in range(layout.ranks):
        ratio = f"{ratios[r]:.3f}"
        row = [str(r), f"{tokens[r]:,}"] + ([f"{slots[r] - tokens[r]:,}"] if padded else [])
        row += [f"{int(round(work[r])):,}", _number(flops[r]), f"[bold red]{ratio}[/]" if worst and ratios[r] == ratios.max() else ratio]
        if steps is not None:
            row.append(f"{int((steps[r] == EMPTY).sum())}/{layout.ranks}")
        out.append(row)
    return out


def step_grid(split: Split, width: int, caption: bool = True) -> str:
    """Rank r's block at each ring step (keys of rank (r - i) mod N), one character per step where they fit."""
    steps = split.steps()
    n = split.ranks
    label = len(str(n - 1)) + 1
    per = max(1, -(-n // max(1, width - label - 1)))
    chars = symbols(steps, 1, per)
    lines = [f"{r:>{label - 1}} {''.join(chars[r])}" for r in range(n)]
    text = ("rows: rank; columns: ring step i (the keys of rank (r - i) mod N)"
               + (f", one character = {per} steps" if per > 1 else "") + f"\n{SYMBOLS[FULL]} full  {SYMBOLS[PARTIAL]} partial  {SYMBOLS[EMPTY]} empty (a step the rank may skip)")
    return "\n".join(lines + ([text] if caption else []))


STEP_STYLES = {FULL: "green", PARTIAL: "yellow", EMPTY: "red dim"}  # as blocks' terminal map colours them (render/density.py)


def coloured(grid: str):
    """The ring-step grid (and its legend) as rich Text, each block's symbol in its colour."""
    import re

    from rich.text import Text

    text = Text(grid)
    for category, style in STEP_STYLES.items():
        text.highlight_regex(re.escape(SYMBOLS[category]) + "+", style)
    return text


def header(report: Report) -> str:
    layout = report.layout
    names = " · ".join(split.mask.title for _, split in report.splits)
    tokens = f"{layout.length:,} token{'s' if layout.length != 1 else ''}"
    return f"shard {names}\n{tokens} over {layout.ranks} rank{'s' if layout.ranks != 1 else ''} · --layout {layout.name} ({layout.note})"


def imbalance_lines(report: Report) -> list[str]:
    out = []
    for _, split in report.splits:
        ratios = split.ratios()
        if ratios.max() == ratios.min():
            out.append(f"imbalance (max / mean work) {split.imbalance:.3f}: every rank does the same work")
            continue
        out.append(f"imbalance (max / mean work) {split.imbalance:.3f}: rank {int(ratios.argmax())} does the most, rank {int(ratios.argmin())} the least")
    return out


def finding_lines(findings: list[Finding]) -> list[str]:
    return [f"{severity(f)}: {f.code}: {f.message}" for f in findings]


def finding_json(finding: Finding) -> dict:
    """code, severity (its rule's), message, and the rank and first (query, key) cell, null where there is none."""
    return {"code": finding.code, "severity": severity(finding), "message": finding.message, "rank": finding.rank,
            "cell": list(finding.cell) if finding.cell is not None else None}


def views(report: Report, width: int) -> list:
    """Rich renderables, readable from 60 columns."""
    from rich.text import Text

    layout = report.layout
    out: list = [Text(header(report), style="bold")]
    if layout.ranks <= len(DIGITS):
        line = strip(layout, max(10, width - 2))
        per = layout.length / len(line)
        scale = (f", a character = {per:,.0f} positions" if per == int(per) else f", a character ~{per:,.0f} positions") if per > 1 else ""
        mixed = f"; {MIXED} = several ranks in one character" if MIXED in line else ""
        mixed += "; ? = on no rank" if "?" in line else ""
        out.append(Text(f"token -> rank, positions 0-{layout.length - 1:,}{scale}{mixed}:"))
        out.append(Text(line))
    else:
        out.append(Text(f"token -> rank: {layout.ranks} ranks are more than a character each can name; --png draws the strip"))
    lines = imbalance_lines(report)
    for index, (label, split) in enumerate(report.splits):
        if len(report.splits) > 1:
            named = label if label == split.mask.title else f"{label} ({split.mask.title})"  # a layer type names its mask
            out.append(Text(f"{named}:", style="bold"))
        out.extend(table(report, split, index == 0, width))
        out.append(Text(lines[index]))
        if split.steps() is not None:
            out.append(Text("ring steps:", style="bold"))
            out.append(coloured(step_grid(split, width, caption=index == len(report.splits) - 1)))
    if layout.heads is not None:
        out.append(Text("ulysses: no ring steps; every rank attends over all tokens for its heads after an all-to-all"))
    for line, finding in zip(finding_lines(report.findings), report.findings):
        out.append(Text(line, style={"wrong": "bold red", "suspicious": "yellow"}.get(severity(finding), "")))
    if not report.wrong:
        out.append(Text("the ranks' parts add up to the global mask exactly", style="green"))
    return out


def report_json(report: Report) -> str:
    return json.dumps(report_data(report))


def report_data(report: Report) -> dict:
    """The layout, each mask's per-rank cells, work, FLOPs, ratios, ring-step grid and steps, cu_seqlens, findings."""
    layout = report.layout
    data = {
        "layout": {"name": layout.name, "ranks": layout.ranks, "length": layout.length, "note": layout.note,
                   "runs": int(layout.rank.size), "tokens": layout.tokens().tolist(), "slots": layout.slots().tolist(),
                   "heads": list(layout.heads) if layout.heads is not None else None},
        "masks": [],
        "cu_seqlens": {"local": [v.tolist() for v in report.local]},
        "findings": [finding_json(f) for f in report.findings],
    }
    if report.te is not None:
        data["cu_seqlens"]["te"] = {"cu_seqlens_padded_local": report.te[0].tolist(), "cu_seqlens_on_rank": [v.tolist() for v in report.te[1]]}
    for label, split in report.splits:
        steps = split.steps()
        data["masks"].append({
            "label": label, **split.mask.json(), "cells": split.cells.tolist(), "work": split.work().tolist(),
            "flops": split.flops().tolist(), "head_dim": split.head_dim, "ratio": split.ratios().tolist(), "imbalance": split.imbalance,
            "grid": split.grid.tolist() if split.grid is not None else None,
            "steps": [[NAMES[int(v)] for v in row] for row in steps] if steps is not None else None,
        })
    return data


FIGURE_STEPS = 3  # ring-step panels drawn, one per mask (layer type)


def figure(report: Report):
    """The token -> rank strip, each rank's work against the mean, and each mask's ring steps (up to FIGURE_STEPS)."""
    from maskcli.render.heatmaps import FIGURE_COLOURS, setup_matplotlib, wrapped_title

    setup_matplotlib()
    import matplotlib.patches as mpatches
    from matplotlib import colormaps
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    layout = report.layout
    n = layout.ranks
    stepped = [(label, split) for label, split in report.splits if split.steps() is not None][:FIGURE_STEPS]
    panels = ["work"] + [f"steps{i}" for i in range(len(stepped))] if stepped else ["work", "none"]
    fig = Figure(figsize=(4.2 * len(panels) + 1.4, 6.8), layout="constrained")
    axes = fig.subplot_mosaic([["strip"] * len(panels), panels], height_ratios=[1, 4])
    spans = min(2048, layout.length)
    edges = np.linspace(0, layout.length, spans + 1).round().astype(np.int64)
    owner = layout.owner()[edges[:-1]]
    colours = colormaps["viridis"].resampled(max(n, 2))
    image = axes["strip"].imshow(np.ma.masked_less(owner[None, :], 0), aspect="auto", cmap=colours, vmin=-0.5, vmax=n - 0.5,
                                 interpolation="nearest", extent=(0, layout.length, 0, 1))
    axes["strip"].set_yticks([])
    axes["strip"].set_xlabel("position")
    axes["strip"].set_title(f"token -> rank ({layout.name}: {layout.note})", fontsize=10)
    bar = fig.colorbar(image, ax=axes["strip"], pad=0.01, aspect=8)  # which colour is which rank
    bar.set_label("rank", fontsize=9)
    bar.ax.yaxis.set_major_locator(MaxNLocator(integer=True, nbins=min(n, 8)))
    bar.ax.tick_params(labelsize=8)
    ax = axes["work"]
    width = 0.8 / len(report.splits)
    for index, (label, split) in enumerate(report.splits):
        ax.bar(np.arange(n) + index * width - 0.4 + width / 2, split.ratios(), width, label=f"{label}: imbalance {split.imbalance:.3f}")
    ax.axhline(1.0, color="black", linewidth=1, linestyle="--")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("rank")
    ax.set_ylabel("work / mean")
    # the legend sits in headroom above the tallest bar, never over a bar (a row of text per mask)
    top = max(float(split.ratios().max()) for _, split in report.splits)
    ax.set_ylim(0, top * (1.12 + 0.09 * len(report.splits)))
    ax.legend(fontsize=8, loc="upper left")
    ax.set_title("each rank's attention work against the mean", fontsize=10)
    rgb = np.array([FIGURE_COLOURS["masked"], FIGURE_COLOURS["partial"], FIGURE_COLOURS["visible"]], dtype=np.float64) / 255
    for index, (label, split) in enumerate(stepped):
        ax = axes[f"steps{index}"]
        ax.imshow(rgb[split.steps()], interpolation="nearest", aspect="auto", extent=(-0.5, n - 0.5, n - 0.5, -0.5))
        for axis in (ax.xaxis, ax.yaxis):
            axis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("ring step i (keys of rank (r - i) mod N)")
        ax.set_ylabel("rank r")
        ax.set_title(f"ring steps of {label}", fontsize=10)
    if not stepped:
        axes["none"].set_axis_off()
        axes["none"].text(0.5, 0.5, "ulysses: no ring steps", ha="center", va="center")
    else:
        fig.legend(handles=[mpatches.Patch(facecolor=rgb[v], edgecolor="black", label=text) for v, text in
                            ((FULL, "full block"), (PARTIAL, "partial block"), (EMPTY, "empty: the rank may skip the step"))],
                   loc="outside lower center", ncols=3, fontsize=9, frameon=False)
    wrapped_title(fig, header(report), 11)
    return fig
