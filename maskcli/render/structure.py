"""The structure that makes a mask, for figures and tables: label segments (chunk, document, segment,
block ids and Llama 4 chunks) with their boundaries, the cached keys before the queries, padded keys
and queries, and the diagonal (a query at its own position, bottom-right aligned).

Everything is on absolute positions and computed per segment, not per cell.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from maskcli.mask import Mask

LABELLED = {"chunk": "chunk", "document": "doc", "segment": "seg", "blocks": "block"}
MARK_RGB = (0.1, 0.1, 0.1)  # boundaries: near black, drawn over both mask colours
CACHE_RGB = (0.85, 0.45, 0.0)  # the cache line: orange, off the mask and value colours
DIAGONAL_RGB = (0.45, 0.0, 0.55)  # purple, off the mask and value colours
MOST_SEGMENTS = 64
PAD_BAND = {"facecolor": "white", "hatch": "////", "edgecolor": (0.3, 0.3, 0.3), "linewidth": 0.8}  # more boundaries than this would hide the mask itself


@dataclass(frozen=True)
class Structure:
    q_start: int
    q_end: int
    k_start: int
    k_end: int
    word: str | None = None  # "doc", "chunk", ...: what the segments are
    segments: tuple[tuple[int, int, int], ...] = ()  # (start, end, label) over absolute positions
    pad_keys: tuple[tuple[int, int], ...] = ()  # [start, end) runs of padded key positions
    pad_queries: tuple[tuple[int, int], ...] = ()
    first_query: int | None = None  # the whole mask's first query, where a region shows part of it
    edge_by: str = "--offset"  # what put the cache edge there, for the legend (maskcli model: the cache itself)

    @property
    def cache_edge(self) -> int:
        """The first key that is not in the KV cache: the (whole mask's) first query."""
        return self.q_start if self.first_query is None else self.first_query

    @property
    def cached(self) -> bool:
        """Keys before the first query are already in the KV cache (and the edge falls inside the keys shown)."""
        return self.k_start < self.cache_edge < self.k_end or (self.first_query is None and self.q_start > self.k_start)

    def label_of(self, position: int) -> int | None:
        for start, end, label in self.segments:
            if start <= position < end:
                return label
        return None


def structure(mask: Mask, batch: int) -> Structure:
    """The structure of batch row `batch` of `mask` (a tensor or a mask_mod has none but its positions)."""
    f = mask.frame
    word, segments = _segments(mask, batch, f)
    pad_keys: tuple = ()
    pad_queries: tuple = ()
    if f.key_valid is not None:
        valid = f.key_valid[batch if f.key_valid.shape[0] > 1 else 0]
        pad_keys = _runs(~valid[f.k_start : f.k_end], f.k_start)
        pad_queries = _runs(~valid[f.q_start : f.q_end], f.q_start)
    first = mask.whole.q_start if mask.whole is not None else None
    return Structure(f.q_start, f.q_end, f.k_start, f.k_end, word, segments, pad_keys, pad_queries, first)


def _segments(mask: Mask, batch: int, f) -> tuple[str | None, tuple]:
    if mask.tree is None:
        return None, ()
    from maskcli import terms

    for term in terms.terms(mask.tree):
        word = LABELLED.get(term.kind.name)
        if word is not None:
            labels = term.values["labels"].array
            row = labels[batch if labels.shape[0] > 1 else 0][: f.n]
            return word, _label_runs(row)
        if term.kind.name == "local":  # chunks from the row's first real token and each document, as the kind counts them
            from maskcli.kinds.local import chunk_starts

            starts = chunk_starts(term.values, f, np.arange(f.n, dtype=np.int64))
            pad = int(f.left_padding()[batch if f.batch > 1 else 0])
            runs = _label_runs(starts[batch if starts.shape[0] > 1 else 0][pad:])
            if runs:
                return "chunk", tuple((pad + s, pad + e, i) for i, (s, e, _) in enumerate(runs))
    return None, ()


def run_starts(row: np.ndarray) -> np.ndarray:
    """Where each run of equal labels in `row` starts (none for an empty row), from the change points."""
    if row.size == 0:
        return np.zeros(0, dtype=np.int64)
    return np.concatenate(([0], np.flatnonzero(row[1:] != row[:-1]) + 1))


def _label_runs(row: np.ndarray) -> tuple[tuple[int, int, int], ...]:
    """(start, end, label) for each run of equal labels: computed from the change points, not per token."""
    starts = run_starts(row)
    if starts.size == 0 or starts.size > MOST_SEGMENTS:
        return ()
    ends = np.concatenate((starts[1:], [row.size]))
    return tuple((int(s), int(e), int(row[s])) for s, e in zip(starts, ends))


def _runs(flags: np.ndarray, offset: int) -> tuple[tuple[int, int], ...]:
    if not flags.any():
        return ()
    edges = np.flatnonzero(np.diff(np.concatenate(([0], flags.astype(np.int8), [0]))))
    return tuple((int(a) + offset, int(b) + offset) for a, b in zip(edges[::2], edges[1::2]))


BAND_PTS = 6  # thickness of a padding band, in points


def draw_marks(ax, s: Structure, absolute: bool = False) -> None:
    """Boundaries and labels of segments, the cache line, padding hatched, and the diagonal, on a mask panel.

    Cell (i, j) is centred at (j, i); `absolute` panels are drawn on positions instead (long masks).
    """
    x0 = 0 if absolute else s.k_start  # cell j is centred at x = j: key position x0 + j (position_extent)
    y0 = 0 if absolute else s.q_start
    half = 0.5

    def kx(position):  # the left edge of key `position`
        return position - x0 - half

    def qy(position):  # the top edge of query `position`
        return position - y0 - half

    left, right, top, bottom = kx(s.k_start), kx(s.k_end), qy(s.q_start), qy(s.q_end)
    # padding: a hatched band outside the cells, along the keys (below) and the queries (left of the tick
    # labels would crowd them: right), so that the cells keep their colours; BAND_PTS thick whatever the
    # panel's size, with the tick labels moved out past it (a share of a tall panel covered them)
    figure, box = ax.figure, ax.get_position()
    tall, wide = max(1.0, box.height * figure.get_figheight() * 72), max(1.0, box.width * figure.get_figwidth() * 72)
    if s.pad_keys:
        ax.tick_params(axis="x", pad=BAND_PTS + 4)
    for start, end in s.pad_keys:
        ax.axvspan(kx(start), kx(end), ymin=-(BAND_PTS + 1) / tall, ymax=-1 / tall, clip_on=False, **PAD_BAND)
    for start, end in s.pad_queries:
        ax.axhspan(qy(end), qy(start), xmin=1 + 1 / wide, xmax=1 + (BAND_PTS + 1) / wide, clip_on=False, **PAD_BAND)
    boundaries = sorted({start for start, _, _ in s.segments[1:]})
    for position in boundaries:
        if s.k_start < position < s.k_end:
            ax.axvline(kx(position), color=MARK_RGB, linewidth=1.6)
        if s.q_start < position < s.q_end:
            ax.axhline(qy(position), color=MARK_RGB, linewidth=1.6)
    if s.cached:
        ax.axvline(kx(s.cache_edge), color=CACHE_RGB, linewidth=1.5, linestyle="--")
    # the diagonal: each query's own position (bottom-right aligned: absolute positions line up), drawn as
    # the staircase along the right edge of each (q, q) cell, so that no cell's colour is hidden under it
    first, last = max(s.q_start, s.k_start), min(s.q_end, s.k_end)
    if first < last and not absolute:  # on a long mask's pixels a line would hide the band it runs along
        steps = np.arange(first, last + 1)
        xs = np.repeat(kx(steps + 1), 2)[:-1]
        ys = np.repeat(qy(steps), 2)[1:]
        ax.plot(xs, ys, color=DIAGONAL_RGB, linewidth=1.2, linestyle=(0, (2, 1.5)))
    ax.set_xlim(left, right)
    ax.set_ylim(bottom, top)
    if s.segments:
        centres = [((max(a, s.k_start) + min(b, s.k_end)) / 2, label) for a, b, label in s.segments if b > s.k_start and a < s.k_end]
        centres = spaced(centres, wide / max(1, s.k_end - s.k_start), across=True)
        top_axis = ax.secondary_xaxis("top")
        top_axis.set_xticks([kx(c) for c, _ in centres], [str(label) for _, label in centres], fontsize=LABEL_PTS)
        top_axis.tick_params(length=0, pad=1)
        top_axis.set_xlabel(f"{s.word} of each key", fontsize=8)
        rows = [((max(a, s.q_start) + min(b, s.q_end)) / 2, label) for a, b, label in s.segments if b > s.q_start and a < s.q_end]
        rows = spaced(rows, tall / max(1, s.q_end - s.q_start), across=False)
        right_axis = ax.secondary_yaxis("right")
        right_axis.set_yticks([qy(c) for c, _ in rows], [str(label) for _, label in rows], fontsize=LABEL_PTS)
        right_axis.tick_params(length=0, pad=BAND_PTS + 4 if s.pad_queries else 3)


LABEL_PTS = 10  # segment labels' font size


def spaced(centres: list[tuple[float, int]], points_per_position: float, across: bool) -> list[tuple[float, int]]:
    """The labels that fit without meeting the one kept before (narrow segments lose theirs): `across`, a label
    takes its text's width (about 0.6 em a digit), else one line's height, with 3 points between."""
    kept: list[tuple[float, int]] = []
    for centre, label in centres:
        size = (0.6 * LABEL_PTS * len(str(label)) if across else LABEL_PTS) + 3
        if kept:
            last_size = (0.6 * LABEL_PTS * len(str(kept[-1][1])) if across else LABEL_PTS) + 3
            if (centre - kept[-1][0]) * points_per_position < (size + last_size) / 2:
                continue
        kept.append((centre, label))
    return kept


@dataclass(frozen=True)
class TableMarks:
    """Structure for a table of cells: what each key column and query row is labelled with, where rules go."""

    word: str | None  # "doc", "chunk", ...: the labels' header
    key_tops: tuple[str, ...] | None  # a line above the key positions: each key's label, "p" on padding
    row_tags: tuple[str, ...] | None  # each query row's label, "pad" on padding
    col_breaks: dict  # key column index -> the rule before it: "│" a label boundary, "║" the cache's end
    row_breaks: frozenset  # query row indices a rule goes above
    diagonal: tuple[int | None, ...]  # per query row, the column of its own position (None: not among the keys)
    keys: int = 0  # key columns

    def legend(self) -> str:
        parts = []
        if "│" in self.col_breaks.values() or self.row_breaks:
            parts.append(f"│ ─ {self.word} boundaries (labels above the keys, beside the queries)")
        if "║" in self.col_breaks.values():
            parts.append("║ cached keys | new keys")
        if self.key_tops and "p" in self.key_tops or self.row_tags and any(tag.strip() == "pad" for tag in self.row_tags):
            parts.append("p / pad: padding")
        if parts and any(d is not None for d in self.diagonal):  # on its own, the underline needs no words
            parts.append("underlined: the diagonal")
        return " · ".join(parts)


def aligned(marks: list[TableMarks]) -> list[TableMarks]:
    """The tables' marks with the same label column and line in every one, so that the batch rows' tables
    start their columns at the same place (a row without padding gets blank tags)."""
    import dataclasses

    tags = [m.row_tags for m in marks if m.row_tags is not None]
    width = max((len(tag) for row in tags for tag in row), default=0)
    tops = any(m.key_tops is not None for m in marks)
    return [
        dataclasses.replace(
            m,
            # each tag as wide as the widest: the label column is then as wide in every table
            row_tags=tuple(tag.ljust(width) for tag in m.row_tags or ("",) * len(m.diagonal)) if tags else None,
            key_tops=m.key_tops if m.key_tops is not None or not tops else ("",) * m.keys,
        )
        for m in marks
    ]


def table_marks(s: Structure) -> TableMarks:
    """Labels, rules, padding and the diagonal of `s`, for a table of its queries x keys."""
    keys, queries = range(s.k_start, s.k_end), range(s.q_start, s.q_end)
    pad_keys = {k for a, b in s.pad_keys for k in range(a, b)}  # a table is small: positions one by one
    pad_queries = {q for a, b in s.pad_queries for q in range(a, b)}
    labelled = bool(s.segments)
    key_tops = None
    if labelled or pad_keys:
        key_tops = tuple("p" if k in pad_keys else str(s.label_of(k)) if labelled else "" for k in keys)
    row_tags = None
    if labelled or pad_queries:
        row_tags = tuple("pad" if q in pad_queries else str(s.label_of(q)) if labelled else "" for q in queries)
    starts = {start for start, _, _ in s.segments[1:]}
    col_breaks = {k - s.k_start: "│" for k in keys if k in starts and k != s.k_start}
    if s.cached:
        col_breaks[s.cache_edge - s.k_start] = "║"
    row_breaks = frozenset(q - s.q_start for q in queries if q in starts and q != s.q_start)
    diagonal = tuple(q - s.k_start if s.k_start <= q < s.k_end else None for q in queries)
    return TableMarks(s.word if labelled else None, key_tops, row_tags, col_breaks, row_breaks, diagonal, len(keys))


def map_marks(s: Structure, rows_per: int, keys_per: int):
    """The structure of `s` on a terminal map whose characters are blocks of rows_per queries x keys_per keys:
    label boundaries and the cache edge under the ruler, label starts beside the rows, and (one query a line)
    the diagonal. O(boundaries), never per position."""
    from maskcli.render.density import MapMarks

    starts = np.array([start for start, _, _ in s.segments[1:]], dtype=np.int64)
    keys = starts[(starts > s.k_start) & (starts < s.k_end)]
    key_breaks = {int(col): "│" for col in np.unique((keys - s.k_start) // keys_per)}
    if s.cached:
        key_breaks[(s.cache_edge - s.k_start) // keys_per] = "║"
    queries = starts[(starts > s.q_start) & (starts < s.q_end)]
    row_breaks = frozenset(int(row) for row in np.unique((queries - s.q_start) // rows_per))
    diagonal: tuple = ()
    if rows_per == 1:
        q = np.arange(s.q_start, s.q_end)
        diagonal = tuple(int((p - s.k_start) // keys_per) if s.k_start <= p < s.k_end else None for p in q)
    parts = []
    if "│" in key_breaks.values() or row_breaks:
        parts.append(f"│ ─ {s.word} boundaries")
    if "║" in key_breaks.values():
        parts.append("║ cached keys | new keys")
    if parts and any(d is not None for d in diagonal):
        parts.append("underlined: the diagonal")
    return MapMarks(key_breaks, row_breaks, diagonal, " · ".join(parts))


def legend_entries(found: list[Structure], absolute: list[bool] | None = None) -> list[tuple[str, dict]]:
    """(label, style) for what `draw_marks` drew on any panel: the legend explains only what is there
    (`absolute[i]`: panel i is a long mask's pixels, where no diagonal is drawn)."""
    absolute = [False] * len(found) if absolute is None else absolute
    entries = []
    words = sorted({s.word for s in found if s.segments})
    if words:
        entries.append((f"{' / '.join(words)} boundary (labels on the top and right edges)", {"line": MARK_RGB}))
    cached = sorted({s.edge_by for s in found if s.cached})
    if cached:
        entries.append((f"cached keys | new keys ({' / '.join(cached)})", {"line": CACHE_RGB, "dashed": True}))
    if any(s.pad_keys or s.pad_queries for s in found):
        entries.append(("padding (a hatched band beside its keys and queries)", {"hatch": True}))
    if any(max(s.q_start, s.k_start) < min(s.q_end, s.k_end) and not far for s, far in zip(found, absolute)):
        entries.append(("diagonal: right of this edge, later keys", {"line": DIAGONAL_RGB, "dotted": True}))
    return entries
