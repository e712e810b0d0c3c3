"""The verify table: one row per attention backend."""

from __future__ import annotations

from rich.table import Table
from rich.text import Text


def _diff_text(max_diff: float | None, atol: float) -> Text:
    if max_diff is None:
        return Text("-", style="dim")
    if max_diff != max_diff:  # NaN
        return Text("nan", style="bold red")
    return Text(f"{max_diff:.2e}", style="green" if max_diff <= atol else "bold red")


def backends_table(results, atol: float) -> Table:
    """One row per backend; refusal and error reasons become numbered notes in the caption."""
    from rich import box

    notes = [f"max |diff| is against maskcli's float64 reference on rows that see a key; tolerance {atol:g}"]
    rows = []
    for result in results:
        if result.status == "ok":
            status = Text("agrees", style="green") if result.agrees(atol) else Text("DISAGREES", style="bold red")
            ms = None if result.seconds is None else result.seconds * 1e3
            # at most 4 characters below 10 s a call (0.24, 9.56, 35.9, 863, 1634), so that a narrow table fits
            seconds = "-" if ms is None else f"{ms:.2f}" if ms < 1 else f"{ms:.3g}" if ms < 100 else f"{ms:.0f}"
            rows.append((result.name, status, _diff_text(result.max_diff, atol), result.masked_rows, seconds))
        else:
            notes.append(f"[{len(notes)}] {result.name}: {result.reason}")
            rows.append((result.name, Text(f"{result.status} [{len(notes) - 1}]", style="yellow"), "-", "-", "-"))
    # numbers are never cut short: their columns are as wide as their longest value, and the
    # words (backend names, headers) wrap between words when the terminal is narrow
    widths = [max(len(str(row[i])) for row in rows) if rows else 1 for i in range(5)]
    table = Table(caption_justify="left", box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True)
    table.add_column("backend", style="bold", overflow="fold")
    table.add_column("result", width=max(widths[1], 6))
    table.add_column("max |diff|", justify="right", width=max(widths[2], 6))
    table.add_column("fully masked rows", justify="center", width=max(widths[3], 6))
    table.add_column("ms / call", justify="right", width=max(widths[4], 4))
    for row in rows:
        table.add_row(*row)
    table.caption = "\n".join(notes)
    return table
