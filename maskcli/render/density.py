"""Text maps for masks wider than the terminal: one character per block of cells (or of blocks)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from rich.text import Text

FULL, MOST, SOME, NONE = "█", "▓", "░", "·"
LEGEND = f"{FULL} all visible  {MOST} over half  {SOME} some  {NONE} none"
STYLES = {FULL: "green", MOST: "yellow", SOME: "yellow", NONE: "red dim", "▒": "yellow"}
MAX_LINES = 48


@dataclass(frozen=True)
class Blocks:
    """How many queries (rows) and keys (cols) one character covers."""

    rows: int
    cols: int


def choose_blocks(q_len: int, k_len: int, width: int, lines: int = MAX_LINES) -> Blocks:
    """Block size so the map fits `width` characters and `lines` lines.

    A terminal cell is about twice as tall as it is wide, so a block covers twice
    as many queries as keys and a square mask looks square, unless one key a character
    fits, or every query has a line of its own (a prefill chunk or decode step behind a
    long cache: short and wide): then one query a line keeps every row exact.
    """
    cols = max(1, -(-k_len // max(1, width)))
    rows = -(-q_len // max(1, lines))
    if cols > 1 and q_len > lines:  # a square mask looks square
        rows = max(rows, min(2 * cols, q_len))
    return Blocks(rows=max(1, rows), cols=cols)


@dataclass(frozen=True)
class MapMarks:
    """Where a map's structure falls: characters under the ruler (│ a label boundary, ║ the cache edge) by column,
    the rows whose block starts a new label (─ beside them), and per row the column of its diagonal cell."""

    key_breaks: dict
    row_breaks: frozenset
    diagonal: tuple
    legend: str

    @property
    def any(self) -> bool:
        return bool(self.key_breaks or self.row_breaks)


def shade(shares: np.ndarray) -> np.ndarray:
    """The character for each share: a block with any visible cell is never `·`, a full one is `█`."""
    return np.where(shares == 1, FULL, np.where(shares == 0, NONE, np.where(shares > 0.5, MOST, SOME)))


def map_text(symbols: np.ndarray, rows_per: int, keys_per: int, q_len: int, q_offset: int, k_offset: int, caption: str,
             marks: MapMarks | None = None) -> Text:
    """A key-position ruler, then one line of `symbols` per block of queries labelled by its first query, then the
    caption; `marks` adds a line of boundaries under the ruler, ─ beside the rows where a label starts, and
    underlines each row's diagonal cell."""
    grid_rows, grid_cols = symbols.shape
    label_width = len(str(q_offset + q_len - 1)) + (1 if marks is not None and marks.any else 0)
    text = Text()
    ruler = [" "] * grid_cols
    free = 0  # first column after the last mark and its gap: long numbers must not run together
    for col in range(0, grid_cols, 10):
        mark = str(k_offset + col * keys_per)
        if col >= free and col + len(mark) <= grid_cols:
            ruler[col : col + len(mark)] = mark
            free = col + len(mark) + 1
    text.append(" " * (label_width + 1) + "".join(ruler).rstrip() + "\n", style="dim")
    if marks is not None and marks.key_breaks:
        line = [" "] * grid_cols
        for col, char in marks.key_breaks.items():
            line[col] = char
        text.append(" " * (label_width + 1) + "".join(line).rstrip() + "\n", style="bold")
    for row in range(grid_rows):
        if marks is not None and marks.any:
            text.append(f"{q_offset + row * rows_per:>{label_width - 1}}", style="bold")
            text.append("─" if row in marks.row_breaks else " ", style="bold")
            text.append(" ")
        else:
            text.append(f"{q_offset + row * rows_per:>{label_width}} ", style="bold")
        diagonal = marks.diagonal[row] if marks is not None and row < len(marks.diagonal) else None
        for col, symbol in enumerate(symbols[row]):
            style = STYLES.get(symbol, "")
            text.append(symbol, style=f"{style} underline".strip() if col == diagonal else style)
        text.append("\n")
    if marks is not None and marks.legend:
        caption += "\n" + marks.legend
    text.append(caption, style="dim")
    return text


def cell_block(rows: int, cols: int) -> str:
    """'1 query x 8 keys': what one character or pixel of a map stands for."""
    return f"{rows:,} {'query' if rows == 1 else 'queries'} x {cols:,} {'key' if cols == 1 else 'keys'}"


def density_text(shares, blocks: Blocks, q_len: int, k_len: int, q_offset: int = 0, k_offset: int = 0, how: str = "exact",
                 marks: MapMarks | None = None) -> Text:
    """The density map of exact visible shares per block; `how` says how they were counted."""
    caption = f"rows: query position, ruler: key position; one character = {cell_block(blocks.rows, blocks.cols)} ({how})\n" + LEGEND
    return map_text(shade(np.asarray(shares)), blocks.rows, blocks.cols, q_len, q_offset, k_offset, caption, marks)
