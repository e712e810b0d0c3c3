"""From a Mask to what the user sees: a header, tables or exact density maps, JSON, a figure.

Renderers build objects (rich renderables, a JSON string, a matplotlib Figure); the
commands print or save them. Nothing here imports torch.
"""

from __future__ import annotations

import json
import math

import numpy as np

from maskcli.conventions import cell_texts, describe
from maskcli.counting import block_shares, how_counted
from maskcli.mask import Mask
from maskcli.text import shortened
from maskcli.memory import check_dense_fits
from maskcli.render import JSON_MAX_VALUES, check_json_size

FIGURE_MAX_CELLS = 512  # per side; a longer mask is drawn as the share of visible cells per block
TABLE_MAX_ROWS = 256  # a taller mask is a density map even when it is narrow
HEAD_COMPARE_CELLS = 1 << 22
MAX_PANELS = 24  # a terminal shows this many batch rows and heads; --summary and --json cover every one
FIGURE_MAX_PANELS = 8  # a figure's panels stand in one row


def shape_text(mask: Mask) -> str:
    batch, heads, q_len, k_len = mask.shape
    return f"shape (B={batch}, H={heads}, Lq={q_len}, Lk={k_len})"


def header(mask: Mask, convention: str, dtype: str) -> str:
    where = "" if mask.frame.is_plain() else f" · {mask.frame.describe()}"
    text = f"{mask.title} · {shape_text(mask)}{where}\nconvention: {describe(convention, dtype)}"
    if convention != "block" and _reads_triu_as_block(mask):
        # triu's 1-cells are the masked ones, so shown as keep it looks like tril
        text += "\nthe raw torch.triu matrix (1 = masked) is what --as block shows"
    return text


def _reads_triu_as_block(mask: Mask) -> bool:
    from maskcli import terms

    return mask.tree is not None and any(
        term.kind.name == "triu" and term.values.get("means") == "block" for term in terms.terms(mask.tree)
    )


def head_groups(mask: Mask, batch: int) -> list:
    """Heads with identical masks, grouped; an expression ignores h, so all heads are one group (a range:
    --heads 1000000000 is one group, not a list of a billion)."""
    heads = mask.shape[1]
    if heads == 1 or mask.keep is None or mask.keep.shape[1] == 1 or mask.shape[2] * mask.shape[3] * heads > HEAD_COMPARE_CELLS:
        return [range(heads)]
    keep = mask.keep[batch if mask.keep.shape[0] > 1 else 0]
    groups: list[list[int]] = []
    for h in range(heads):
        for group in groups:
            if np.array_equal(keep[group[0]], keep[h]):
                group.append(h)
                break
        else:
            groups.append([h])
    return groups


def rows_left_out(first: int, total: int) -> str:
    """'batch rows 24-99' (or 'batch row 99'): what a view that stops at row `first` leaves out."""
    return f"batch rows {first}-{total - 1}" if first < total - 1 else f"batch row {first}"


def panels_shown(mask: Mask, most: int) -> tuple[list[tuple[int, list[int]]], str | None]:
    """The first `most` (batch row, head group) panels, and a note naming what is left out (None: nothing)."""
    shown: list[tuple[int, list[int]]] = []
    for b in range(mask.batch):
        for group in head_groups(mask, b):
            if len(shown) == most:
                partly = f" (from head {group[0]})" if group[0] > 0 else ""
                return shown, f"{most} panels shown; {rows_left_out(b, mask.batch)}{partly} not shown"
            shown.append((b, group))
    return shown, None


def panel_title(mask: Mask, batch: int, group: list[int]) -> str:
    parts = []
    if mask.shape[0] > 1:
        parts.append(f"batch {batch}")
        row = batch if batch < mask.frame.batch else 0  # one --ids/--lengths row serves every label row
        if mask.frame.lengths is not None:
            parts[-1] += f" (length {mask.frame.lengths[row]})"
        elif mask.frame.ids is not None:
            parts[-1] += f" (ids {shortened(','.join(map(str, mask.frame.ids[row].tolist())), 40)})"
    if mask.shape[1] > 1:
        parts.append(f"head {group[0]}" if len(group) == 1 else f"heads {_ranges(group)} (identical)")
    return ", ".join(parts)


def _ranges(values) -> str:
    if isinstance(values, range) and len(values) > 2:
        return f"{values[0]}-{values[-1]}"
    if values == list(range(values[0], values[-1] + 1)) and len(values) > 2:
        return f"{values[0]}-{values[-1]}"
    return ",".join(map(str, values))


def axis_labels(mask: Mask, word_width: int | None = None, word_columns: bool = True) -> tuple[list[str], list[str]]:
    """Row labels (absolute query positions, with their words) and column labels (key positions or words).

    `word_width` cuts each word to that many characters (0: no words, positions only);
    `word_columns` False labels the columns by position and keeps the words for the rows.
    """
    f = mask.frame
    width = len(str(f.q_end - 1))
    positions = [f"{q:>{width}}" for q in range(f.q_start, f.q_end)]
    keys = [str(k) for k in range(f.k_start, f.k_end)]
    if mask.tokens is None or word_width == 0:
        return positions, keys
    words = [w if word_width is None or len(w) <= word_width else w[: word_width - 1] + "…" for w in mask.tokens]
    rows = [f"{position} {words[f.q_start + i]}" for i, position in enumerate(positions)]
    return rows, words[f.k_start : f.k_end] if word_columns else keys


def _table_labels(mask: Mask, texts, console, marks=None):
    """The fullest labels whose table fits the console: words on both axes, on the rows only, cut short,
    or none; and a note of what was given up."""
    from maskcli.render.tables import fits, mask_table

    texts = (max(texts, key=len),) * 2  # measured with every cell at the wider of the two texts
    choices = [(None, True, "")]
    if mask.tokens is not None:
        choices += [
            (None, False, "--tokens label the rows: the columns, too narrow for the words, are key positions"),
            (10, False, "--tokens cut to 10 characters and label the rows only, to fit"),
            (0, True, "--tokens not shown: the words do not fit the width"),
        ]
    f = mask.frame
    for word_width, word_columns, note in choices:
        rows, cols = axis_labels(mask, word_width, word_columns)
        if fits(console, mask_table([[True] * f.k_len] * f.q_len, None, rows, cols, texts, marks=marks)):
            return rows, cols, note, False
    if max(map(len, texts)) == 1:  # one character a cell: pack the columns, key positions written downwards
        words = mask.tokens is not None
        for word_width, note in ((None, "--tokens label the rows: the columns are key positions"),
                                 (10, "--tokens cut to 10 characters and label the rows only, to fit"),
                                 (0, "--tokens not shown: the words do not fit the width")):
            rows, cols = axis_labels(mask, word_width, word_columns=False)
            if fits(console, mask_table([[True] * f.k_len] * f.q_len, None, rows, cols, texts, compact=True, marks=marks)):
                return rows, cols, note if words else "", True
            if not words:
                break
    return None


def mask_views(mask: Mask, convention: str, dtype: str, console, progress=None, map_width: int | None = None) -> list:
    """Rich renderables: a header, then per batch row (and head group) a table or an exact density map.

    A table is used whenever every cell fits the console's width (never one cut short);
    `map_width` (default the console's) sizes a map where one does not.
    """
    from rich.text import Text

    from maskcli.render.density import MAX_LINES, choose_blocks, density_text
    from maskcli.render.tables import fits, mask_table

    from maskcli.render.structure import aligned, map_marks, structure, table_marks

    batch, _, q_len, k_len = mask.shape
    texts = cell_texts(convention, dtype)
    label_width = len(str(mask.frame.q_end - 1)) + 1
    shown, left_out = panels_shown(mask, MAX_PANELS)
    rows_shown = shown[-1][0] + 1
    # every cell takes at least two columns: decide before building labels (or marks) for a long mask
    small = 2 * k_len + label_width + 1 <= console.width and q_len <= TABLE_MAX_ROWS
    marks = aligned([table_marks(structure(mask, b)) for b in range(rows_shown)]) if small else None
    labels = _table_labels(mask, texts, console, marks[0]) if small else None
    shorter = None
    if small and labels is None and max(map(len, texts)) > 1:  # wide values (-3.4e+38): a table of 1 and 0 still fits
        shorter = f"cells shown as 1 / 0 (1 = may attend): {texts[0]} / {texts[1]} do not fit {console.width} columns"
        texts = ("1", "0")
        labels = _table_labels(mask, texts, console, marks[0])
    maybe_table = labels is not None
    from maskcli.render.breaking import Dotted

    # the header and legend wrap between their ' · ' parts, further lines two cells in (at column 0, a header's last
    # words, 'keys' / '0-5', read as a row of the table under it)
    views: list = [Dotted(Text(header(mask, convention, dtype), style="bold"))]
    if maybe_table:
        row_labels, col_labels, note, compact = labels
        for line in (shorter, note):
            if line:
                views.append(Dotted(Text(line, style="dim")))
        legend = max((m.legend() for m in marks), key=len)
        if legend:
            views.append(Dotted(Text(legend, style="dim")))
    elif mask.tokens is not None:
        views.append(Text("--tokens not shown: a density map has no room for words", style="dim"))
    tabled = False
    for b, group in shown:
        title = panel_title(mask, b, group)
        if title:  # its own line: a table title would wrap to the table's width
            views.append(Text(title, style="bold"))
        if maybe_table:
            table = mask_table(mask.cells(b, group[0]).tolist(), None, row_labels, col_labels, texts, compact=compact, marks=marks[b])
            if fits(console, table):
                views.append(table)
                tabled = True
                continue
        lines = max(8, console.height - 6) if console.is_terminal else MAX_LINES
        blocks = choose_blocks(q_len, k_len, (map_width or console.width) - label_width - 2, lines)
        shares = block_shares(mask, b, group[0], blocks.rows, blocks.cols, progress)
        marks = map_marks(structure(mask, b), blocks.rows, blocks.cols)
        views.append(density_text(shares, blocks, q_len, k_len, mask.q_offset, mask.kv_offset, how_counted(mask), marks))
    if left_out:
        views.append(Text(f"{left_out}: --summary counts every one, --json or --save has every cell", style="dim"))
    if map_width is not None and not tabled:
        return piped_map(views, map_width, mask, console.width)
    return views


def piped_map(views: list, map_width: int, mask: Mask, table_width: int) -> list:
    """Piped maps as a terminal of `map_width` columns shows them (words wrapped there too), then a line
    saying how to get the cells, which did not fit a table `table_width` columns wide."""
    from rich.constrain import Constrain
    from rich.text import Text

    f = mask.frame
    cells = "--json or --save has every cell" if math.prod(mask.shape) <= JSON_MAX_VALUES else "--summary counts them exactly"
    if f.q_len <= TABLE_MAX_ROWS:
        why = f"{f.k_len:,} keys do not fit a table {table_width} columns wide: --keys A:B shows some of them as one"
    else:
        why = f"{f.q_len:,} queries are more than a table shows: --rows A:B with --keys C:D shows some of them as one"
    views = [*views, Text(f"a density map, not the cells: {why}, {cells}", style="dim")]
    return [Constrain(view, map_width) for view in views]


JSON_FIX = "use a smaller --len, or --summary --json for exact counts at any length"


def check_mask_json(mask: Mask) -> None:
    """Refuse the cells of `mask` as JSON that would not fit in memory, or that are more than --json prints."""
    check_json_size(math.prod(mask.shape), "mask cells", JSON_FIX + " (--save writes the cells to a .npy or .pt file)")
    check_dense_fits(mask.shape, 12, "as JSON", fix=JSON_FIX)  # (the fixed cap first: more memory would not lift it)


def mask_json(mask: Mask, convention: str = "keep", dtype: str = "float32") -> str:
    """One JSON object; `mask` is nested [B][H][Lq][Lk] lists in `convention`: keep and int 0/1 (1 = may attend),
    block 0/1 (1 = masked), additive 0 / "-inf", min 0 / finfo(dtype).min."""
    from maskcli.conventions import FLOAT_MIN

    check_mask_json(mask)
    keep = np.broadcast_to(mask.dense(), mask.shape)
    data = {**mask.json(), "name": mask.slug, "convention": convention}
    if convention in ("keep", "int", "block"):
        data["mask"] = (keep if convention != "block" else ~keep).astype(np.uint8).tolist()
    else:
        data["dtype"] = dtype
        masked = "-inf" if convention == "additive" else FLOAT_MIN[dtype]  # JSON has no -inf: the house spells it
        data["mask"] = np.where(keep, np.array(0.0, dtype=object), np.array(masked, dtype=object)).tolist()
    return json.dumps(data)


def mask_figure(mask: Mask, name: str | None = None):
    """One panel per batch row (and distinct head); long masks show the exact visible share per block.
    `name` replaces the title's first line (the mask's name), as inspect names the file it read."""
    from maskcli.render.density import cell_block
    from maskcli.render.heatmaps import Panel, heatmap_figure, position_extent
    from maskcli.render.structure import structure

    batch, _, q_len, k_len = mask.shape
    rows = max(1, -(-q_len // FIGURE_MAX_CELLS))
    cols = max(1, -(-k_len // FIGURE_MAX_CELLS))
    f = mask.frame
    panels = []
    shown, left_out = panels_shown(mask, FIGURE_MAX_PANELS)
    tabled = False
    for b, group in shown:
        title = panel_title(mask, b, group)
        if rows == 1 and cols == 1:
            panels.append(Panel(title, mask.cells(b, group[0]), *axis_labels(mask), marks=structure(mask, b)))
            continue
        share = block_shares(mask, b, group[0], rows, cols)
        # a pixel with any visible cell is never drawn as empty: shares above 0 start a third of the way to blue
        share = np.where(share > 0, 0.3 + 0.7 * share, 0.0)
        title = (title + "\n" if title else "") + (
            f"one pixel = {cell_block(rows, cols)}\n(shade = share visible, any visible cell at least light blue;\n"
            f"{how_counted(mask)})"
        )
        panels.append(Panel(title, share, None, None, extent=position_extent(f.k_start, f.k_end, f.q_start, f.q_end), marks=structure(mask, b)))
    where = "" if f.is_plain() else f", {f.describe()}"
    figure_title = f"{name or mask.title}\n{shape_text(mask)}{where}, keep convention" + (f"\n{left_out}" if left_out else "")
    return heatmap_figure([panels], figure_title, ("may attend (True)", "masked (False)"))
