"""Renderers: what the user sees of a mask (tables, maps, figures, JSON); commands print or save what they build."""

from __future__ import annotations

import re

from maskcli.errors import MaskError

STYLES = {"wrong": "red", "suspicious": "yellow", "note": "dim"}  # a finding is coloured by its severity, not its code
JSON_MAX_VALUES = 1 << 22  # numbers --json prints at most (a few seconds, about 12 MB); past it, a file or counts


def check_json_size(count: int, what: str, fix: str) -> None:
    """Refuse --json that would list more than JSON_MAX_VALUES `what`, up front: before anything is built or written."""
    if count > JSON_MAX_VALUES:
        raise MaskError(f"--json would list {count:,} {what}, past the {JSON_MAX_VALUES:,} it prints: {fix}")


def hanging(lead: str, text, style: str | None = None):
    """A rich renderable of `lead` then `text`, whose wrapped lines stand under the text, not under `lead`; a word
    longer than the line (a command's expression, a module path) is broken after a '.' or ',' (Breaking), never cut
    short. A lead wider than a third of the line (a long program name) leaves the text too narrow to read under it:
    there the whole line wraps two cells in, as `labelled` does for a long label."""
    return _Hanging(lead, text, style or "")


class _Hanging:
    """`hanging`'s renderable: which layout is decided at render time, when the width is known."""

    def __init__(self, lead: str, text, style: str):
        self.lead, self.text, self.style = lead, text, style

    def __rich_console__(self, console, options):
        from rich.cells import cell_len
        from rich.table import Table
        from rich.text import Text

        from maskcli.render.breaking import Breaking

        text = self.text if isinstance(self.text, Text) else Text(str(self.text))
        if cell_len(str(self.lead)) > max(24, options.max_width // 3):  # a Text lead (a styled label) too
            yield Breaking(Text.assemble(self.lead, text, style=self.style), indent=2)
            return
        grid = Table.grid()
        grid.style = self.style
        grid.add_column(no_wrap=True)
        grid.add_column()
        grid.add_row(self.lead, Breaking(text))
        yield grid


def labelled(line: str, style: str = ""):
    """A report's line ('cache: ...'), its wrapped lines under the text after its label, or two cells in where its
    label is long or it has none: never at column 0."""
    from rich.text import Text

    from maskcli.render.breaking import Breaking

    label, colon, rest = line.partition(": ")
    if not colon or len(label) > 24:
        return Breaking(Text(line, style=style), indent=2)
    return hanging(label + colon, Text(rest), style=style)


_LEAD = re.compile(r"maskcli: warning: |[ │├└─•]*(?:[AB]: )?")  # what a line's wrapped lines stand under


def wrapped(text: str, stream) -> str:
    """`text` wrapped for `stream` with a newline at the end: on a terminal (or under COLUMNS) each line is broken at
    its width, with its further lines under the line's text (after its indent, tree branches, bullet, short label, or
    `maskcli: warning: `; two cells in where it has none) rather than at column 0 where the terminal would put them;
    piped, it is left as it is."""
    import os

    columns = os.environ.get("COLUMNS", "").strip()
    if columns.isascii() and columns.isdigit():
        width = int(columns)
    elif getattr(stream, "isatty", lambda: False)():
        import shutil

        width = shutil.get_terminal_size().columns
    else:
        return text + "\n"
    import io

    from rich.console import Console

    console = Console(file=io.StringIO(), width=width, no_color=True, highlight=False, emoji=False, markup=False)
    for line in text.split("\n"):
        lead = _LEAD.match(line).group(0)
        if len(line) <= width or len(lead) > width // 2:  # a lead that wide would leave too narrow a column
            console.out(line, highlight=False)
        elif not lead:  # under its text after a short label ('visible cells: '), else two cells in: never column 0
            console.print(labelled(line))
        else:
            console.print(hanging(lead, line[len(lead):]))
    return "".join(line.rstrip() + "\n" for line in console.file.getvalue().splitlines())
