"""A difference of two masks in words, as a table or an exact map coloured by category, as JSON and as a figure."""

from __future__ import annotations

import json

import numpy as np
from rich.text import Text

from maskcli.diff import Difference, block_counts, categories, row_words
from maskcli.render.density import cell_block, choose_blocks, map_text, shade
from maskcli.render.masks import axis_labels, shape_text

CELL = {0: ("·", "dim"), 1: ("1", "green"), 2: ("A", "bold red"), 3: ("B", "bold blue")}
LEGEND = "A = only in A  B = only in B  1 = in both  · = in neither"
MAP_LEGEND = "A = some cells only in A  B = some only in B  X = both; else the share in both: █ all  ▓ over half  ░ some  · none"
ONLY_B_RGB = (44, 160, 44)  # green
BOTH_KINDS_RGB = (148, 103, 189)  # purple


def header(difference: Difference) -> str:
    a, b = difference.a, difference.b
    where = "" if a.frame.is_plain() else f" · {a.frame.describe()}"
    verdict = "equal" if difference.equal else "they differ"
    return (
        f"A: {a.title}\nB: {b.title}\n{shape_text(a if a.batch >= b.batch else b)}{where} · {verdict} ({difference.how})\n"
        f"only A allows {difference.only_a:,} cells · only B allows {difference.only_b:,} · both allow {difference.both:,}"
    )


def views(difference: Difference, console, progress=None, map_width: int | None = None) -> list:
    """Header and words, then per batch row a table (small) or an exact map (large, `map_width` wide where
    given, else the console's) of the categories."""
    from maskcli.render import hanging, labelled

    out: list = [labelled(line, "bold") for line in header(difference).split("\n")]  # wrapped never to column 0
    if difference.rows:
        shown = row_words(difference)
        more = "" if len(shown) < 5 else " (the first 5; --json lists them too)"
        out += [Text("first rows that differ" + more + ":", style="yellow"), *(hanging("  ", Text(line), "yellow") for line in shown)]
    a = difference.a
    f = a.frame
    few = f.q_len <= 256 and 3 * f.k_len <= console.width  # (labels made only for a table: a map of 1M rows has none)
    rows_labels, cols_labels = axis_labels(a, 0) if few else ([], [])
    label_width = max(map(len, rows_labels)) if few else len(str(f.q_end - 1))
    small = few and label_width + 2 + 3 * f.k_len <= console.width
    if small and a.tokens is not None:  # the words on both axes where they fit, else on the rows
        from maskcli.render.tables import fits, grid_table

        for labels in (axis_labels(a), axis_labels(a, word_columns=False), None):
            if labels is None:
                out.append(Text("--tokens not shown: the words do not fit this width", style="dim"))
            elif fits(console, grid_table(None, *labels, lambda i, j: Text("·"))):
                rows_labels, cols_labels = labels
                break
    elif a.tokens is not None:
        out.append(Text("--tokens not shown: a density map has no room for words", style="dim"))
    from maskcli.render.masks import MAX_PANELS, rows_left_out

    batch = max(a.batch, difference.b.batch)
    for b in range(batch):
        if b == MAX_PANELS:
            out.append(Text(f"{MAX_PANELS} batch rows shown; {rows_left_out(b, batch)} not shown: --json counts every one", style="dim"))
            break
        if batch > 1:
            out.append(Text(f"batch {b}", style="bold"))
        if small:
            from maskcli.render.structure import table_marks
            from maskcli.render.tables import fits, grid_table

            cells = categories(difference, b, 0, 0, f.q_len)
            styled = {value: Text(symbol, style=style) for value, (symbol, style) in CELL.items()}
            marks = table_marks(_labelled_structure(difference, b))
            table = grid_table(None, rows_labels, cols_labels, lambda i, j: styled[int(cells[i, j])], marks=marks)
            if not fits(console, table):  # the label column and rules need room too
                marks, table = None, grid_table(None, rows_labels, cols_labels, lambda i, j: styled[int(cells[i, j])])
            out.append(table)
            out.append(Text(LEGEND + (f" · {marks.legend()}" if marks is not None and marks.legend() else ""), style="dim"))
            continue
        lines = max(8, console.height - 8) if console.is_terminal else 48
        blocks = choose_blocks(f.q_len, f.k_len, (map_width or console.width) - label_width - 2, lines)
        grids = block_counts(difference, b, 0, blocks.rows, blocks.cols, progress)
        sizes = np.diff(np.minimum(np.arange(0, f.q_len + blocks.rows, blocks.rows), f.q_len))[: grids["both"].shape[0], None] * \
            np.diff(np.minimum(np.arange(0, f.k_len + blocks.cols, blocks.cols), f.k_len))[None, : grids["both"].shape[1]]
        symbols = shade(grids["both"] / sizes)
        symbols = np.where(grids["only_a"] > 0, "A", symbols)
        symbols = np.where(grids["only_b"] > 0, np.where(grids["only_a"] > 0, "X", "B"), symbols)
        caption = f"rows: query position, ruler: key position; one character = {cell_block(blocks.rows, blocks.cols)} ({difference.how})\n{MAP_LEGEND}"
        from maskcli.render.structure import map_marks

        marks = map_marks(_labelled_structure(difference, b), blocks.rows, blocks.cols)
        out.append(map_text(symbols, blocks.rows, blocks.cols, f.q_len, f.q_start, f.k_start, caption, marks))
    if map_width is not None and not small:  # piped maps: their words wrapped as wide as the maps, not 512 columns
        from rich.constrain import Constrain

        out = [Constrain(view, map_width) for view in out]
    return out


def diff_json(difference: Difference) -> str:
    return json.dumps({
        "a": {**difference.a.json(), "name": difference.a.title},
        "b": {**difference.b.json(), "name": difference.b.title},
        "equal": difference.equal,
        "only_a": difference.only_a,
        "only_b": difference.only_b,
        "both": difference.both,
        "counted": difference.how,
        "rows": [
            {
                "batch": r.batch, "head": r.head, "query": r.query,
                "a": [list(x) for x in r.a], "b": [list(x) for x in r.b],
                "only_a": [list(x) for x in r.only_a], "only_b": [list(x) for x in r.only_b],
            }
            for r in difference.rows
        ],
        "words": row_words(difference),
    })


def _labelled_structure(difference: Difference, b: int):
    """The structure to draw for batch row b: A's, unless only B has labels."""
    from maskcli.render.structure import structure

    a, other = difference.a, difference.b
    mine = structure(a, min(b, a.batch - 1))
    if mine.segments:
        return mine
    theirs = structure(other, min(b, other.batch - 1))
    return theirs if theirs.segments else mine


def diff_figure(difference: Difference):
    """One panel per batch row: both (blue), only A (red), only B (green), neither (grey); long masks per block."""
    from matplotlib.figure import Figure

    from maskcli.render.heatmaps import LEAK_RGB, MASKED_RGB, VISIBLE_RGB, mark_handles, position_extent, position_ticks, setup_matplotlib, wrapped_title
    from maskcli.render.masks import FIGURE_MAX_PANELS, rows_left_out
    from maskcli.render.structure import draw_marks

    setup_matplotlib()
    a = difference.a
    f = a.frame
    every = max(a.batch, difference.b.batch)
    batch = min(every, FIGURE_MAX_PANELS)
    rows, cols = max(1, -(-f.q_len // 512)), max(1, -(-f.k_len // 512))
    figure = Figure(figsize=(5.2 * batch, 5.6), layout="constrained")
    axes = figure.subplots(1, batch, squeeze=False)[0]
    marks = []
    colours = {name: np.array(rgb) / 255 for name, rgb in (("masked", MASKED_RGB), ("visible", VISIBLE_RGB), ("a", LEAK_RGB), ("b", ONLY_B_RGB), ("x", BOTH_KINDS_RGB))}
    for b, ax in enumerate(axes):
        grids = block_counts(difference, b, 0, rows, cols)
        sizes = np.diff(np.minimum(np.arange(0, f.q_len + rows, rows), f.q_len))[: grids["both"].shape[0], None] * \
            np.diff(np.minimum(np.arange(0, f.k_len + cols, cols), f.k_len))[None, : grids["both"].shape[1]]
        share = (grids["both"] / sizes)[..., None]
        image = colours["masked"] * (1 - share) + colours["visible"] * share
        image[grids["only_a"] > 0] = colours["a"]
        image[grids["only_b"] > 0] = colours["b"]
        image[(grids["only_a"] > 0) & (grids["only_b"] > 0)] = colours["x"]
        ax.imshow(image, interpolation="nearest", extent=position_extent(f.k_start, f.k_end, f.q_start, f.q_end), aspect="equal")
        position_ticks(ax)
        marks.append(_labelled_structure(difference, b))  # where the differences fall against the documents, ...
        draw_marks(ax, marks[-1], absolute=True)
        ax.set_xlabel("key position (kv)")
        ax.set_ylabel("query position (q)")
        if batch > 1:
            ax.set_title(f"batch {b}", fontsize=10)
    import matplotlib.patches as mpatches

    handles = [mpatches.Patch(facecolor=colours[key], edgecolor="black", label=label) for key, label in
               (("visible", "both allow"), ("a", "only A allows"), ("b", "only B allows"), ("masked", "neither"))]
    handles += mark_handles(marks, [True] * len(marks))
    fit = 4 if len(handles) == 4 else max(1, int(figure.get_figwidth() // 2.6))  # as many side by side as fit
    figure.legend(handles=handles, loc="outside lower center", ncols=min(len(handles), fit), frameon=False, fontsize=9)
    per = "" if rows == cols == 1 else f" · one pixel = {rows} x {cols} cells (a difference anywhere in it colours it)"
    left_out = f"\n{batch} panels shown; {rows_left_out(batch, every)} not shown" if batch < every else ""
    title = f"A: {a.title}\nB: {difference.b.title}\n{difference.only_a:,} cells only A allows, {difference.only_b:,} only B{per}{left_out}"
    wrapped_title(figure, title, 10)
    return figure
