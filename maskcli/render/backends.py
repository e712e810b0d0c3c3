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


def backends_table(results, atol: float, title: str) -> Table:
    """One row per backend; refusal and error reasons become numbered notes in the caption."""
    notes = [f"max |diff| is against maskcli's float64 reference on rows that see a key; tolerance {atol:g}"]
    table = Table(title=title, title_justify="left", caption_justify="left")
    table.add_column("backend", style="bold", no_wrap=True)
    table.add_column("result", no_wrap=True)
    table.add_column("max |diff|", justify="right")
    table.add_column("fully masked rows", justify="center")
    table.add_column("time / call", justify="right")
    for result in results:
        if result.status == "ok":
            status = Text("agrees", style="green") if result.agrees(atol) else Text("DISAGREES", style="bold red")
            seconds = "-" if result.seconds is None else f"{result.seconds * 1e3:.3f} ms"
            table.add_row(result.name, status, _diff_text(result.max_diff, atol), result.masked_rows, seconds)
        else:
            notes.append(f"[{len(notes)}] {result.name}: {result.reason}")
            table.add_row(result.name, Text(f"{result.status} [{len(notes) - 1}]", style="yellow"), "-", "-", "-")
    table.caption = "\n".join(notes)
    return table
