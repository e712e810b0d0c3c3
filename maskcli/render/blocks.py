"""The block view of a mask: counts, a map of full, partial and empty blocks, JSON, a figure."""

from __future__ import annotations

import json

import numpy as np

from maskcli.blockmask import EMPTY, FULL, PARTIAL, Blocks
from maskcli.render.density import Blocks as Grouping
from maskcli.render.density import choose_blocks, map_text
from maskcli.render.masks import shape_text

SYMBOLS = {FULL: "█", PARTIAL: "▒", EMPTY: "·"}
MIXED = "▓"  # a character over several blocks, full and empty but none partial
LEGEND = "█ full  ▒ partial (some cells masked)  · empty"


def header(blocks: Blocks) -> str:
    mask, f = blocks.mask, blocks.mask.frame
    where = "" if f.is_plain() else f" · {f.describe()}"
    return (
        f"blocks of {mask.title} · {shape_text(mask)}{where}\n"
        f"block {blocks.q_block} x {blocks.kv_block} (queries x keys): {blocks.n_q:,} x {blocks.n_kv:,} blocks\n"
        f"sparsity {blocks.sparsity():.2f}% (BlockMask.sparsity(): the share of cells in blocks FlexAttention skips"
        + ("; below 0 where the blocks, padded past the sequence, hold more cells than the mask" if blocks.sparsity() < 0 else "") + ")"
    )


def counts_line(blocks: Blocks, b: int, h: int = 0) -> str:
    full, partial, empty = blocks.counts(b, h)
    total = blocks.n_q * blocks.n_kv
    return f"full {full:,} ({full / total:.2%}) · partial {partial:,} ({partial / total:.2%}) · empty {empty:,} ({empty / total:.2%})"


def _planes(blocks: Blocks):
    """(b, h) of each distinct plane: every head where they differ, else head 0 for all."""
    heads = blocks.kv_num_blocks.shape[1]
    return [(b, h) for b in range(blocks.mask.batch) for h in range(heads)]


def _row_stats(blocks: Blocks, b: int, h: int) -> dict:
    """Blocks per query-block row (full, partial, computed), O(query blocks)."""
    full, partial = blocks.full_kv_num_blocks[b, h], blocks.kv_num_blocks[b, h]
    both = full + partial
    stats = {name: {"min": int(v.min()), "median": float(np.median(v)), "max": int(v.max())} for name, v in
             (("full", full), ("partial", partial), ("computed", both))}
    stats["rows_with_no_block"] = int((both == 0).sum())
    return stats


def _described(blocks: Blocks) -> dict:
    """What names the mask and its blocks, JSON-ready: the head of blocks --json and --summary --json."""
    mask = blocks.mask
    return {
        **mask.json(),
        "block_size": [blocks.q_block, blocks.kv_block],
        "seq_lengths": [mask.frame.q_len, mask.frame.k_len],
        "num_blocks": [blocks.n_q, blocks.n_kv],
        "sparsity": blocks.sparsity(),
    }


def _cover(blocks: Blocks) -> str:
    """What one entry of the per-(batch, head) counts stands for."""
    heads = blocks.mask.heads
    if blocks.kv_num_blocks.shape[1] == heads:
        return "one batch row and head each"
    return f"one batch row each, in head 0, which stands for all {heads:,} heads: they hold the same mask"


def summary_json(blocks: Blocks) -> str:
    """Counts, sparsity and per-row statistics: no index tensors, so any length fits."""
    return json.dumps({
        **_described(blocks),
        "planes": [
            {"batch": b, "head": h, **dict(zip(("full", "partial", "empty"), blocks.counts(b, h))), "per_query_block_row": _row_stats(blocks, b, h)}
            for b, h in _planes(blocks)
        ],
        "planes_cover": _cover(blocks),
    })


def summary_text(blocks: Blocks) -> str:
    lines = [header(blocks)]
    planes = _planes(blocks)
    for b, h in planes[:24]:
        where = ", ".join(p for p in (f"batch {b}" if blocks.mask.batch > 1 else "", f"head {h}" if blocks.kv_num_blocks.shape[1] > 1 else "") if p)
        prefix = f"{where}: " if where else ""
        stats = _row_stats(blocks, b, h)
        per = " · ".join(f"{name} {s['min']:,}-{s['max']:,} (median {s['median']:,g})" for name, s in stats.items() if name != "rows_with_no_block")
        lines.append(f"{prefix}{counts_line(blocks, b, h)}")
        lines.append(f"{'  ' if prefix else ''}blocks per query-block row: {per}; rows with no block: {stats['rows_with_no_block']:,}")
    if len(planes) > 24:
        lines.append(f"24 of {len(planes):,} batch rows and heads shown: --summary --json has every one")
    return "\n".join(lines)


def symbols(categories: np.ndarray, rows: int, cols: int) -> np.ndarray:
    """One character per rows x cols blocks: █ all full, · all empty, ▒ any partial, ▓ full and empty."""
    n_q, n_kv = categories.shape
    grid_q, grid_kv = -(-n_q // rows), -(-n_kv // cols)
    padded = np.full((grid_q * rows, grid_kv * cols), -1, dtype=np.int8)  # -1: past the end, none of the three
    padded[:n_q, :n_kv] = categories
    tiles = padded.reshape(grid_q, rows, grid_kv, cols)

    def any_of(value):
        return (tiles == value).any(axis=(1, 3))

    full, partial, empty = any_of(FULL), any_of(PARTIAL), any_of(EMPTY)
    return np.where(partial, SYMBOLS[PARTIAL], np.where(full & empty, MIXED, np.where(full, SYMBOLS[FULL], SYMBOLS[EMPTY])))


def block_map(blocks: Blocks, b: int, h: int, width: int, lines: int):
    """A rich Text map of batch row b, head h: one character per block where they fit."""
    f = blocks.mask.frame
    label_width = len(str(f.q_end - 1)) + 1
    room = width - label_width - 1
    per = Grouping(1, 1) if blocks.n_kv <= room and blocks.n_q <= lines else choose_blocks(blocks.n_q, blocks.n_kv, room, lines)
    one = per.rows == 1 and per.cols == 1
    caption = (
        "rows: query position, ruler: key position; one character = "
        + ("one block" if one else f"{per.rows:,} x {per.cols:,} blocks")
        + f" of {blocks.q_block} queries x {blocks.kv_block} keys\n{LEGEND}" + ("" if one else f"  {MIXED} full and empty")
    )
    chars = symbols(blocks.categories(b, h), per.rows, per.cols)
    return map_text(chars, per.rows * blocks.q_block, per.cols * blocks.kv_block, f.q_len, f.q_start, f.k_start, caption)


def views(found: Blocks, width: int, lines: int) -> list:
    """Rich renderables: the header, then per batch row and head its counts and block map (up to MAX_PANELS)."""
    from rich.text import Text

    from maskcli.render.masks import MAX_PANELS, rows_left_out

    out: list = [Text(header(found), style="bold")]
    batch, heads = found.mask.batch, found.kv_num_blocks.shape[1]
    for index in range(batch * heads):
        b, h = divmod(index, heads)
        if index == MAX_PANELS:
            rest = rows_left_out(b, batch) if h == 0 else f"from batch row {b}, head {h}, on"
            out.append(Text(f"{MAX_PANELS} maps shown; {rest} not shown: --json or --save has every block", style="dim"))
            break
        where = ", ".join(p for p in (f"batch {b}" if batch > 1 else "", f"head {h}" if heads > 1 else "") if p)
        out.append(Text((where + ": " if where else "") + counts_line(found, b, h), style="bold"))
        out.append(block_map(found, b, h, width, lines))
    return out


def blocks_json(blocks: Blocks) -> str:
    arrays = blocks.arrays()
    return json.dumps({
        **_described(blocks),
        "counts": [dict(zip(("batch", "head", "full", "partial", "empty"), (b, h, *blocks.counts(b, h)))) for b, h in _planes(blocks)],
        "counts_cover": _cover(blocks),
        **{name: value.tolist() for name, value in arrays.items()},
    })


def blocks_figure(blocks: Blocks):
    """One panel per batch row: full, partial and empty blocks (a pixel over many blocks shows their mix)."""
    from maskcli.render.heatmaps import FIGURE_COLOURS, Panel, heatmap_figure, position_extent
    from maskcli.render.masks import FIGURE_MAX_PANELS, rows_left_out
    from maskcli.render.structure import structure

    f, mask = blocks.mask.frame, blocks.mask
    step_q, step_kv = max(1, -(-blocks.n_q // 512)), max(1, -(-blocks.n_kv // 512))
    panels = []
    shown = min(mask.batch, FIGURE_MAX_PANELS)
    for b in range(shown):
        categories = blocks.categories(b)
        values = np.add.reduceat(np.add.reduceat(categories.astype(np.float64) / 2, np.arange(0, blocks.n_q, step_q), axis=0),
                                 np.arange(0, blocks.n_kv, step_kv), axis=1)
        sizes = np.add.reduceat(np.add.reduceat(np.ones_like(categories, dtype=np.float64), np.arange(0, blocks.n_q, step_q), axis=0),
                                np.arange(0, blocks.n_kv, step_kv), axis=1)
        title = (f"batch {b}: " if mask.batch > 1 else "") + counts_line(blocks, b)
        extent = position_extent(f.k_start, f.k_start + blocks.n_kv * blocks.kv_block, f.q_start, f.q_start + blocks.n_q * blocks.q_block)
        # the mask's own structure (label boundaries, the cache's end, padding) over its blocks
        panels.append(Panel(title, values / sizes, None, None, extent=extent, marks=structure(mask, b)))
    title = f"blocks of {mask.title} · {blocks.q_block} x {blocks.kv_block}\n{shape_text(mask)}, sparsity {blocks.sparsity():.2f}%"
    if shown < mask.batch:
        title += f"\n{shown} panels shown; {rows_left_out(shown, mask.batch)} not shown"
    legend = [(FIGURE_COLOURS["visible"], "full block"), (FIGURE_COLOURS["partial"], "partial block"), (FIGURE_COLOURS["masked"], "empty block")]
    return heatmap_figure([panels], title, legend)
