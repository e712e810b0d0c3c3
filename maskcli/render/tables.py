"""Rich tables of masks and of attention stages. Renderers build objects; the CLI prints them."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from rich.console import Console, Group
from rich.measure import Measurement
from rich.table import Table
from rich.text import Text

from maskcli.checks.registry import severity
from maskcli.render import STYLES
from maskcli.text import Finding

VISIBLE_STYLE = "bold green"
MASKED_STYLE = "red dim"


def grid_table(
    title: str | None,
    row_labels: Sequence[str],
    col_labels: Sequence[str],
    cell: Callable[[int, int], Text],
    caption: str | None = None,
    corner: str = "q \\ kv",
    justify: str = "center",
    compact: bool = False,
    marks=None,
) -> Table:
    """A queries x keys table; `cell(i, j)` gives each cell's styled text.

    `compact` packs single-character cells two columns apart, with each key position written
    down its column (tens above ones), so that a 20-key mask reads at 60 columns. `marks`
    (structure.TableMarks) adds each key's label above its position, each query's beside it, and
    rules at label boundaries and at the cache's end.
    """
    if compact:
        col_labels = stacked(col_labels)
    tops = marks.key_tops if marks is not None else None
    if tops is not None:
        col_labels = [f"{top}\n{label}" for top, label in zip(tops, col_labels)]
    breaks = marks.col_breaks if marks is not None else {}
    table = Table(title=title, caption=caption, title_justify="left", caption_justify="left", box=None,
                  padding=(0, 1, 0, 0) if compact else (0, 1))
    depth = max((label.count("\n") for label in col_labels), default=0) + 1
    table.add_column(corner if tops is None else "\n" * (depth - 1) + corner, justify="left", style="bold", no_wrap=True)
    tags = marks.row_tags if marks is not None else None
    if tags is not None:
        table.add_column("\n" * (depth - 1) + (marks.word or ""), justify="left", style="dim", no_wrap=True)
    for j, label in enumerate(col_labels):
        if j in breaks:
            table.add_column("\n".join(breaks[j] * depth), justify="center", no_wrap=True, style="dim")
        table.add_column(Text(label), justify=justify, no_wrap=True, header_style="bold")  # Text: a word like [/] is no markup
    def ruled(cells, rule=None):  # the cells of a row, with the rule column before each boundary
        out = []
        for j, shown in enumerate(cells):
            if j in breaks:
                out.append(Text(rule or breaks[j], style="dim"))
            out.append(shown)
        return out

    for i, label in enumerate(row_labels):
        if marks is not None and i in marks.row_breaks:
            table.add_row("", *([""] if tags is not None else []), *ruled([Text("─", style="dim")] * len(col_labels), "┼"))
        cells = [cell(i, j) for j in range(len(col_labels))]
        if marks is not None and marks.diagonal[i] is not None:
            shown = cells[marks.diagonal[i]]
            cells[marks.diagonal[i]] = Text(shown.plain, style=f"{shown.style} underline")
        table.add_row(Text(label), *([tags[i]] if tags is not None else []), *ruled(cells))
    return table


def mask_table(
    keep: Sequence[Sequence[bool]],
    title: str | None,
    row_labels: Sequence[str],
    col_labels: Sequence[str],
    texts: tuple[str, str],
    caption: str | None = None,
    compact: bool = False,
    marks=None,
) -> Table:
    """One 2-D mask: visible and masked cells differ by symbol and by colour."""
    visible = Text(texts[0], style=VISIBLE_STYLE)
    masked = Text(texts[1], style=MASKED_STYLE)
    return grid_table(title, row_labels, col_labels, lambda i, j: visible if keep[i][j] else masked, caption, compact=compact, marks=marks)


def stacked(labels: Sequence[str]) -> list[str]:
    """Labels written down their columns, right-aligned: ['9', '10'] -> [' \n9', '1\n0']."""
    height = max((len(label) for label in labels), default=1)
    return ["\n".join(label.rjust(height)) for label in labels]


def fits(console: Console, renderable, width: int | None = None) -> bool:
    """True when the renderable's natural width fits `width` (the console's) without wrapping or cutting a column.

    Measured without the console's own limit: rich clamps a measurement to the width it
    is given, and a table clamped to fit drops columns silently.
    """
    natural = Measurement.get(console, console.options.update(max_width=1 << 20), renderable).maximum
    return natural <= (console.width if width is None else width)


def findings_text(findings: list[Finding]):
    """The findings as a bulleted list whose wrapped lines keep their indent, each coloured by its severity."""
    if not findings:
        return Text("findings: none (every query sees at least one key; every weight row sums to 1)", style="green")
    bullets = Table.grid(padding=(0, 1))
    bullets.add_column(no_wrap=True)
    bullets.add_column()
    for finding in findings:
        bullets.add_row("  •", Text(finding.message, style=STYLES[severity(finding)]))
    return Group(Text("findings:", style="bold yellow"), bullets)
