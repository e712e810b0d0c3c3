"""Heatmap figures (matplotlib, headless). One function builds every figure maskcli draws."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

# Colours are fixed so that tests can read cells back from the image.
VISIBLE_RGB = (31, 119, 180)  # matplotlib's tab:blue
MASKED_RGB = (224, 224, 224)  # light grey, off any value colour map
LEAK_RGB = (214, 39, 40)  # red, off viridis too: a masked cell that still carries weight
CROSS_RGB = LEAK_RGB  # on mask panels (which draw no weights): a visible cell that should not be, as pack counts them
# a block view's partial block is drawn half way between the two mask colours, where the mask colour map puts 0.5
FIGURE_COLOURS = {
    "visible": VISIBLE_RGB,
    "masked": MASKED_RGB,
    "partial": tuple(round((a + b) / 2) for a, b in zip(VISIBLE_RGB, MASKED_RGB)),
}
GRID_LINES_UP_TO = 48  # draw cell borders when a panel has at most this many rows and columns
VALUES_UP_TO = 12  # write values in the cells up to this size


@dataclass(frozen=True)
class Panel:
    """One heatmap: a keep mask, and optionally values to colour its visible cells with."""

    title: str
    keep: np.ndarray  # bool [Lq, Lk], True = may attend; or the share visible per block, 0..1
    row_labels: Sequence[str] | None  # None: numeric axes from `extent`
    col_labels: Sequence[str] | None
    values: np.ndarray | None = None  # float [Lq, Lk]; masked cells are never coloured by value
    extent: tuple[float, float, float, float] | None = None  # (left, right, bottom, top) in positions
    x_label: str = "key position (kv)"
    before_mask: bool = False  # values exist under masked cells too (scores): show them, hatched over
    show_leaks: bool = False  # weights: a masked cell with a nonzero weight is drawn in LEAK_RGB, with its value
    scale: tuple[float, float] | None = None  # the colour scale's (low, high); None: this panel's own values
    shared: str | None = None  # panels with the same key share one colour bar, labelled with the key
    marks: object | None = None  # Structure: labels, boundaries, cached keys, padding and the diagonal to draw
    cross: np.ndarray | None = None  # bool like keep: cells to draw in CROSS_RGB (pack: a token sees another document)

    def leaks(self) -> np.ndarray:
        """Bool [Lq, Lk]: masked cells whose value is finite and not zero, where show_leaks asks for them."""
        if not self.show_leaks or self.values is None:
            return np.zeros(self.keep.shape, dtype=bool)
        return ~self.keep.astype(bool) & np.isfinite(self.values) & (self.values != 0)


WIDE = 8  # keys per query past which a mask panel fills its box instead of keeping square cells


def _span(panel: Panel, axis: int) -> float:
    """Positions a mask panel covers: rows (axis 0) or keys (axis 1), from its extent where it has one."""
    if panel.extent is None:
        return panel.keep.shape[axis]
    left, right, bottom, top = panel.extent
    return abs(bottom - top) if axis == 0 else abs(right - left)


def _position(value: float) -> str:
    """A tick's position, short: 950, 12.5k, 200k, 1.05M."""
    value = round(value)
    if abs(value) < 10_000:
        return f"{value}"
    if abs(value) < 1_000_000:
        return f"{value / 1000:.4g}k"
    return f"{value / 1_000_000:.4g}M"


ROUND_STEPS = [1, 2, 5, 10]  # tick steps: 200k, 400k (matplotlib's default steps also give 150k, 250k)


def position_extent(k_start: int, k_end: int, q_start: int, q_end: int) -> tuple[float, float, float, float]:
    """imshow's extent for a panel drawn on positions: each position's cell centred on the position itself, as
    column k of a small panel is centred on k, so that a tick labelled 200k stands at key 200,000's centre."""
    return (k_start - 0.5, k_end - 0.5, q_end - 0.5, q_start - 0.5)


def position_ticks(ax) -> None:
    """Ticks of a panel drawn on positions (position_extent): round positions as 200k, 1.05M, never a 1e6 offset."""
    from matplotlib.ticker import FuncFormatter, MaxNLocator

    for axis in (ax.xaxis, ax.yaxis):
        axis.set_major_locator(MaxNLocator(nbins=8, integer=True, min_n_ticks=2, steps=ROUND_STEPS))
        axis.set_major_formatter(FuncFormatter(lambda value, _: _position(value)))


def _rgb(colour: tuple[int, int, int]) -> tuple[float, float, float]:
    return tuple(c / 255 for c in colour)


def _round_positions(first: int, count: int) -> list[int]:
    """Round positions among first .. first + count - 1 to put ticks at: every one up to 24, else multiples of a
    step (1, 2, 5 times a power of ten, as matplotlib picks them), so an axis behind a cache reads 1000, 1010."""
    if count <= 24:
        return list(range(first, first + count))
    from matplotlib.ticker import MaxNLocator

    values = MaxNLocator(nbins=8 if count > 48 else 24, integer=True, steps=ROUND_STEPS).tick_values(first, first + count - 1)
    return [int(v) for v in values if first <= v < first + count]


def _ticks(ax, labels: Sequence[str], axis: str) -> None:
    """Ticks at the centres of cells (column i is centred on i): at round positions where the labels are the
    consecutive positions, else (words) at every cell, or every few cells where they would crowd."""
    count = len(labels)
    stripped = [label.strip() for label in labels]
    if all(label.lstrip("-").isdigit() for label in stripped) and int(stripped[-1]) - int(stripped[0]) == count - 1:
        first = int(stripped[0])
        indices = [p - first for p in _round_positions(first, count)]
        names = [_position(first + i) for i in indices]
    else:
        step = max(1, -(-count // 24))
        indices = list(range(0, count, step))
        names = [labels[i] for i in indices]
    if axis == "x":
        ax.set_xticks(indices, names, rotation=90 if len(indices) == count and count > 1 and max(map(len, names)) > 2 else 0)
    else:
        ax.set_yticks(indices, names)


def _draw(ax, panel: Panel) -> object | None:
    import matplotlib
    import matplotlib.colors as mcolors

    q_len, k_len = panel.keep.shape
    image = None
    if panel.values is None:
        # 0 and 1 land exactly on the two colours; a summarised long mask shades between them.
        cmap = mcolors.LinearSegmentedColormap.from_list("mask", [_rgb(MASKED_RGB), _rgb(VISIBLE_RGB)])
        # a short, wide mask (a prefill chunk behind a long cache) fills its box: at equal aspect each row would be
        # a pixel tall
        aspect = "equal" if _span(panel, 1) <= WIDE * _span(panel, 0) else "auto"
        ax.imshow(panel.keep.astype(np.float32), cmap=cmap, vmin=0, vmax=1, interpolation="nearest", aspect=aspect, extent=panel.extent)
        if panel.cross is not None and panel.cross.any():
            overlay = np.zeros((*panel.cross.shape, 4))
            overlay[panel.cross] = (*_rgb(CROSS_RGB), 1.0)
            ax.imshow(overlay, interpolation="nearest", aspect=aspect, extent=panel.extent)
        if panel.extent is not None:
            position_ticks(ax)
        if max(q_len, k_len) > GRID_LINES_UP_TO:
            # cells of a pixel or two: the axes' frame, drawn over the image's edge, would hide the first and last
            # rows and columns (a sink's column at 4,096 keys is 1.4 pixels wide); the grey of the masked cells
            # already bounds the panel
            for spine in ax.spines.values():
                spine.set_visible(False)
    else:
        finite = np.isfinite(panel.values)
        leaks = panel.leaks()
        hidden = ~finite if panel.before_mask else ~panel.keep | ~finite
        # hidden cells become NaN, not just masked: a fill like finfo.min would overflow the colour scaling
        values = np.ma.masked_invalid(np.where(hidden, np.nan, panel.values))
        cmap = matplotlib.colormaps["viridis"].with_extremes(bad=_rgb(MASKED_RGB))
        # value panels fill their boxes: a row of panels (keys, and an output's head dims) then shares one
        # height, so query rows line up across it; the figure's widths keep the cells near square
        aspect = "auto"
        if values.count():
            low, high = panel.scale if panel.scale is not None else (None, None)
            image = ax.imshow(values, cmap=cmap, interpolation="nearest", aspect=aspect, vmin=low, vmax=high)
        else:  # nothing on the value scale: no colour bar to mislead
            ax.imshow(np.zeros((q_len, k_len, 3)) + _rgb(MASKED_RGB), interpolation="nearest", aspect=aspect)
        overlay = np.zeros((q_len, k_len, 4))
        if panel.before_mask:
            # the cells the mask will hide: hatched, so the value under them stays readable
            overlay[~panel.keep] = (*_rgb(MASKED_RGB), 0.65)
        overlay[leaks] = (*_rgb(LEAK_RGB), 1.0)
        if overlay[..., 3].any():
            ax.imshow(overlay, interpolation="nearest", aspect=aspect)
        if q_len <= VALUES_UP_TO and k_len <= VALUES_UP_TO:
            if panel.scale is not None:
                low, high = panel.scale
            else:
                low, high = (values.min(), values.max()) if values.count() else (0.0, 1.0)
            for i in range(q_len):
                for j in range(k_len):
                    value = panel.values[i, j]
                    shown = panel.keep[i, j] or panel.before_mask or leaks[i, j]
                    text = ("nan" if np.isnan(value) else f"{value:.2f}") if shown else "×"
                    if not panel.keep[i, j] and shown:
                        text += "×"
                    if leaks[i, j]:
                        colour = "white"
                    elif hidden[i, j] or not panel.keep[i, j]:  # drawn grey
                        colour = "#555555"
                    else:
                        colour = "black" if high > low and (value - low) / (high - low) > 0.6 else "white"
                    ax.text(j, i, text, ha="center", va="center", fontsize=7, color=colour)
    if panel.extent is None and q_len <= GRID_LINES_UP_TO and k_len <= GRID_LINES_UP_TO:
        ax.set_xticks(np.arange(-0.5, k_len, 1), minor=True)
        ax.set_yticks(np.arange(-0.5, q_len, 1), minor=True)
        ax.grid(which="minor", color="white", linewidth=1)
        ax.tick_params(which="minor", length=0)
    if panel.col_labels is not None:
        _ticks(ax, panel.col_labels, "x")
    if panel.row_labels is not None:
        _ticks(ax, panel.row_labels, "y")
    if panel.marks is not None:
        from maskcli.render.structure import draw_marks

        draw_marks(ax, panel.marks, absolute=panel.extent is not None)
    ax.set_xlabel(panel.x_label)
    ax.set_ylabel("query position (q)")
    ax.set_title(panel.title, fontsize=10)
    return image


def setup_matplotlib() -> None:
    """The Agg backend, and text drawn as written: a word like $x$ from --tokens is not TeX maths."""
    import matplotlib

    matplotlib.use("Agg")
    matplotlib.rcParams["text.parse_math"] = False


def heatmap_figure(grid: Sequence[Sequence[Panel]], title: str, legend_labels):
    """A figure with one axes per panel (rows x columns of the grid), a title and a legend.

    legend_labels names the visible and masked colours of mask panels; None (value
    panels) names only the masked colour, which lies off every value colour map; a list
    of (rgb, label) names those colours.
    """
    setup_matplotlib()
    import matplotlib.patches as mpatches
    from matplotlib.figure import Figure

    n_rows = len(grid)
    n_cols = max(len(row) for row in grid)
    q_len, k_len = grid[0][0].keep.shape
    cell = min(0.45, 7.0 / max(q_len, k_len, 1))
    # each column as wide as its widest panel needs: an output panel (head dims) is not a keys panel
    columns = [max(row[c].keep.shape[1] for row in grid if c < len(row)) for c in range(n_cols)]
    widths = [max(3.2, min(columns[c], 4 * max(q_len, k_len)) * cell + 1.6) for c in range(n_cols)]
    height = max(2.6, q_len * cell + 1.6)
    marked = any(panel.marks is not None for row in grid for panel in row)
    # room for the legend's longest entry (and a title of a few words a line) beside a small panel
    figure = Figure(figsize=(max(sum(widths), 5.6 if marked else 0), height * n_rows + (1.4 if marked else 0.8)), layout="constrained")
    axes = figure.subplots(n_rows, n_cols, squeeze=False, width_ratios=widths)
    if n_rows > 1:  # the layout makes room for a panel's labels before its equal aspect moves it inside its box, so
        figure.get_layout_engine().set(h_pad=0.15, hspace=0.06)  # one row's axis label could meet the next row's title
    shared: dict[str, tuple[object, list]] = {}  # key -> (an image on the shared scale, the axes that use it)
    for r, row in enumerate(grid):
        for c in range(n_cols):
            ax = axes[r][c]
            if c >= len(row):
                ax.set_visible(False)
                continue
            image = _draw(ax, row[c])
            panel_q, panel_k = row[c].keep.shape
            if n_cols > 1 and row[c].values is None and row[c].extent is None and panel_q < panel_k:
                # a decode step's row of a few keys beside a prefill: one cell tall as its column's cells are wide,
                # whatever its own number of keys (at equal aspect, 4 keys drew a row twice as tall as 7 keys did)
                ax.set_aspect("auto")
                ax.set_box_aspect(max(panel_q / columns[c], 1 / (2 * WIDE)))
            if image is None:
                continue
            if row[c].shared is None:
                figure.colorbar(image, ax=ax, shrink=0.8)
            else:
                found = shared.setdefault(row[c].shared, (image, []))
                found[1].append(ax)
    for label, (image, group) in shared.items():  # one bar for every panel on that scale, beside the last of them
        bar = figure.colorbar(image, ax=group, shrink=0.8, location="right")
        bar.set_label(label.split("#")[0], fontsize=9)
    wrapped_title(figure, title, 11)
    if legend_labels is None:
        handles = [mpatches.Patch(facecolor=_rgb(MASKED_RGB), edgecolor="black", label="grey: masked, this query may not look at this key (×)")]
        if any(panel.before_mask for row in grid for panel in row):
            handles.append(mpatches.Patch(facecolor=_rgb(MASKED_RGB), alpha=0.65, edgecolor="black", label="faded: a score the mask will hide"))
        if any(panel.leaks().any() for row in grid for panel in row):
            handles.append(mpatches.Patch(facecolor=_rgb(LEAK_RGB), edgecolor="black", label="masked, yet weighted (a row that sees no key)"))
    elif isinstance(legend_labels, list):
        handles = [mpatches.Patch(facecolor=_rgb(colour), edgecolor="black", label=label) for colour, label in legend_labels]
    else:
        handles = [
            mpatches.Patch(facecolor=_rgb(VISIBLE_RGB), edgecolor="black", label=legend_labels[0]),
            mpatches.Patch(facecolor=_rgb(MASKED_RGB), edgecolor="black", label=legend_labels[1]),
        ]
    with_marks = [panel for row in grid for panel in row if panel.marks is not None]
    handles += mark_handles([panel.marks for panel in with_marks], [panel.extent is not None for panel in with_marks])
    fit = max(1, int(figure.get_figwidth() // 4.2))  # legend entries side by side, as many as the figure is wide for
    figure.legend(handles=handles, loc="outside lower center", ncols=min(len(handles), fit, 3), frameon=False, fontsize=9)
    return figure


def wrapped_title(figure, title: str, size: int) -> None:
    """The figure's title, each line wrapped to the figure's width (a long expression is never cut off)."""
    import textwrap

    per_line = max(30, int(figure.get_figwidth() * 11))  # characters of a title line across the figure
    figure.suptitle("\n".join(textwrap.fill(line, per_line) for line in title.split("\n")), fontsize=size)


def mark_handles(found: list, absolute: list[bool]) -> list:
    """Legend entries for the structure marks drawn on any panel (`absolute`: drawn on a long mask's pixels)."""
    if not found:
        return []
    import matplotlib.patches as mpatches
    from matplotlib.lines import Line2D

    from maskcli.render.structure import legend_entries

    handles = []
    for label, style in legend_entries(found, absolute):
        if style.get("hatch"):
            handles.append(mpatches.Patch(facecolor="white", hatch="///", edgecolor=(0.35, 0.35, 0.35), label=label))
        else:
            linestyle = "--" if style.get("dashed") else ":" if style.get("dotted") else "-"
            handles.append(Line2D([0], [0], color=style["line"], linestyle=linestyle, linewidth=2, label=label))
    return handles


def save_figure(figure, path: Path) -> None:
    """Write PNG, SVG or PDF (by extension) whole, or leave nothing."""
    from maskcli.files import atomic_write

    fmt = path.suffix.lower().lstrip(".")
    atomic_write(path, lambda temp: figure.savefig(temp, format=fmt, dpi=100))
