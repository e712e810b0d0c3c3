"""A text density map for masks wider than the terminal: one character per block of cells."""

from __future__ import annotations

from dataclasses import dataclass

from rich.text import Text

FULL, MOST, SOME, NONE = "█", "▓", "░", "·"
LEGEND = f"{FULL} all visible  {MOST} over half  {SOME} some  {NONE} none"
MAX_LINES = 48


@dataclass(frozen=True)
class Blocks:
    """How many queries (rows) and keys (cols) one character covers."""

    rows: int
    cols: int


def choose_blocks(q_len: int, k_len: int, width: int) -> Blocks:
    """Block size so the map fits `width` characters and MAX_LINES lines.

    A terminal cell is about twice as tall as it is wide, so a block covers twice
    as many queries as keys and a square mask looks square.
    """
    cols = max(1, -(-k_len // max(1, width)))
    rows = max(1, min(2 * cols, q_len), -(-q_len // MAX_LINES))
    return Blocks(rows=rows, cols=cols)


def density_text(shares, blocks: Blocks, q_len: int, k_len: int, q_offset: int = 0, k_offset: int = 0, how: str = "exact") -> Text:
    """The map: a key-position ruler, then one line per block of queries, labelled by its first query.

    `shares` holds the exact visible share (0..1) of each block; `how` says how it was counted.
    """
    grid_rows, grid_cols = shares.shape
    label_width = len(str(q_offset + q_len - 1))
    text = Text()
    ruler = [" "] * grid_cols
    free = 0  # first column after the last mark and its gap: long numbers must not run together
    for col in range(0, grid_cols, 10):
        mark = str(k_offset + col * blocks.cols)
        if col >= free and col + len(mark) <= grid_cols:
            ruler[col : col + len(mark)] = mark
            free = col + len(mark) + 1
    text.append(" " * (label_width + 1) + "".join(ruler).rstrip() + "\n", style="dim")
    for row in range(grid_rows):
        first_q = row * blocks.rows
        text.append(f"{q_offset + first_q:>{label_width}} ", style="bold")
        for col in range(grid_cols):
            share = float(shares[row, col])
            if share == 1:
                text.append(FULL, style="green")
            elif share == 0:
                text.append(NONE, style="red dim")
            elif share > 0.5:
                text.append(MOST, style="yellow")
            else:
                text.append(SOME, style="yellow")
        text.append("\n")
    noun_q = "query" if blocks.rows == 1 else "queries"
    noun_k = "key" if blocks.cols == 1 else "keys"
    text.append(
        f"rows: query position, ruler: key position; one character = {blocks.rows:,} {noun_q} x "
        f"{blocks.cols:,} {noun_k} ({how})\n" + LEGEND,
        style="dim",
    )
    return text
