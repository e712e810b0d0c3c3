"""Text that wraps only between tokens: at spaces, and inside a word too long for its line after a `.` of a module
path, a `/` of a file path or a `,` of a list; its wrapped lines stand `indent` cells in, under the text."""

from __future__ import annotations

import re

_EXTENSION = re.compile(r"\w{1,5}(?::\d+)?(?![\w.])")  # what follows a file name's '.': py, py:19


def tokens(text: str) -> list[str]:
    """`text` cut where a line may break: after a run of spaces, a ',', a '/' of a file path or a '.' of a module
    path (not a decimal point's, not one inside '...', not a file name's before its extension: decode.py:19 stays
    whole), each piece keeping the spaces after it."""
    def after_dot(i: int) -> bool:
        return not (text[i - 2:i - 1].isdigit() and text[i].isdigit()) and not _EXTENSION.match(text, i)

    cuts = [i for i in range(1, len(text)) if not text[i].isspace() and (text[i - 1].isspace() or (
        text[i] not in ".,/" and (text[i - 1] in ",/" or (text[i - 1] == "." and after_dot(i)))))]
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])] if text else []


def break_points(line: str, width: int, indent: int = 0) -> list[int]:
    """Offsets at which to break `line` so that its first piece fits `width` cells and the others `width - indent`:
    at spaces where the words fit, inside a word longer than a line after its '.' or ',', and only inside a token
    that no line holds, at a cell (nothing is ever dropped)."""
    from rich.cells import cell_len, chop_cells

    breaks: list[int] = []
    used, room = 0, width

    def new_line(at: int) -> None:
        nonlocal used, room
        if at:
            breaks.append(at)
        used, room = 0, max(1, width - indent)

    for match in re.finditer(r"\S+\s*", line):
        start, word = match.start(), match.group(0)
        if used and cell_len(word.rstrip()) > room - used:
            if cell_len(word.rstrip()) <= max(1, width - indent):
                new_line(start)  # the word fits a line of its own: it goes there whole
        for token in tokens(word):
            size = cell_len(token.rstrip())
            if used and size > room - used:
                new_line(start)
            while size > room:  # one token wider than any line: the only place it is cut
                piece = chop_cells(token, room)[0]
                start += len(piece)
                token = token[len(piece):]
                new_line(start)
                size = cell_len(token.rstrip())
            used += cell_len(token)
            start += len(token)
    return breaks


class Breaking:
    """A rich renderable of `text` (a rich Text) wrapped at break_points, its wrapped lines `indent` cells in; lines
    the text's own newlines start are not indented. Its narrowest width keeps every token whole."""

    strip = False  # (a wrapped line's leading spaces dropped before its indent: Dotted's)

    def __init__(self, text, indent: int = 0):
        from rich.text import Text

        self.text = text if isinstance(text, Text) else Text(text)
        self.indent = indent

    def breaks(self, plain: str, width: int) -> list[int]:
        return break_points(plain, width, self.indent)

    def __rich_console__(self, console, options):
        from rich.segment import Segment
        from rich.text import Text

        width = options.max_width
        for line in self.text.split("\n", allow_blank=True):
            for number, piece in enumerate(line.divide(self.breaks(line.plain, width))):
                if number and self.strip:
                    piece = piece[len(piece.plain) - len(piece.plain.lstrip(" ")):]
                if number and self.indent:
                    piece = Text(" " * self.indent, end="") + piece
                piece.rstrip()
                piece.end = ""
                yield from piece.render(console)
                yield Segment.line()

    def __rich_measure__(self, console, options):
        from rich.cells import cell_len
        from rich.measure import Measurement

        lines = self.text.plain.split("\n")
        widest = max(cell_len(line) for line in lines)
        token = max((cell_len(t.rstrip()) for line in lines for t in tokens(line)), default=0)
        narrowest = min(widest, token + (self.indent if widest > token else 0))
        return Measurement(narrowest, widest).clamp(max_width=options.max_width)


class Fitted:
    """A table of Breaking cells whose columns are never narrower than their longest token (rich's own narrowing
    ignores a column's minimum and cuts words); `lines` instead where those minimums do not fit the width, or where
    a row of the table wraps and the lines say it in no more lines (a path wrapped over four lines a row reads worse)."""

    def __init__(self, columns: list[tuple[str, dict]], rows: list[list], lines: list):
        self.columns, self.rows, self.lines = columns, rows, lines

    def __rich_console__(self, console, options):
        from rich import box
        from rich.measure import Measurement
        from rich.table import Table

        width = options.max_width
        cells = [[Breaking(name), *(row[i] for row in self.rows)] for i, (name, _) in enumerate(self.columns)]
        ranges = [[Measurement.get(console, options, cell) for cell in column] for column in cells]
        low = [max(r.minimum for r in column) for column in ranges]
        high = [max(r.maximum for r in column) for column in ranges]
        room = width - 2 * len(self.columns)  # a space of the box's edge or divider and one of padding per column
        if sum(low) > room:
            yield from self.lines
            return
        widths, spare = list(low), room - sum(low)
        wanting = sorted(range(len(low)), key=lambda i: high[i] - low[i])
        for place, i in enumerate(wanting):  # the columns that want least get all they want, the rest share the room
            given = min(high[i] - low[i], spare // (len(wanting) - place))
            widths[i] += given
            spare -= given
        table = Table(box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True)
        for (name, column_options), column_width in zip(self.columns, widths):
            table.add_column(name, width=column_width, **column_options)
        for row in self.rows:
            table.add_row(*row)
        body = len(console.render_lines(table, options, pad=False)) - 4  # less its edges' blank lines, header and rule
        if body > len(self.rows) and body >= sum(len(console.render_lines(line, options, pad=False)) for line in self.lines):
            yield from self.lines
        else:
            yield table


def dotted_breaks(line: str, width: int, indent: int = 2) -> list[int]:
    """Offsets at which to break `line`, a list of parts joined by ' · ' (a view's header: 'causal · shape (...) ·
    queries 4-5 · keys 0-5'), so that its first line fits `width` cells and the others `width - indent`: between
    parts, each part whole on its line where it fits (at a space, 'keys' / '0-5' read as a row of the table below),
    and a part wider than its line at break_points."""
    from rich.cells import cell_len

    sep = " · "
    parts, at = [], 0
    pieces = line.split(sep)
    for number, piece in enumerate(pieces):
        end = at + len(piece) + (len(sep) - 1 if number < len(pieces) - 1 else 0)  # ' ·' ends each part but the last
        parts.append((at, end))
        at += len(piece) + len(sep)
    breaks: list[int] = []
    start, room = 0, width
    for a, e in parts:
        if cell_len(line[start:e]) <= room:
            continue  # the part joins its line
        if a > start and cell_len(line[a:e]) <= max(1, width - indent):  # a new line for it, after this line's parts
            breaks.append(a)
            start, room = a, max(1, width - indent)
            continue
        inner = break_points(line[start:e], room, room - max(1, width - indent))  # wider than a line: at its spaces
        breaks += [start + b for b in inner]
        if inner:
            start, room = start + inner[-1], max(1, width - indent)
    return breaks


class Dotted(Breaking):
    """A rich renderable of `text` (a rich Text) whose lines wrap at dotted_breaks, their further lines `indent`
    cells in."""

    strip = True

    def __init__(self, text, indent: int = 2):
        super().__init__(text, indent)

    def breaks(self, plain: str, width: int) -> list[int]:
        return dotted_breaks(plain, width, self.indent)


class FirstThatFits:
    """The renderables of the first of `choices`, each (the cells it needs on one line, its renderables), that fits the
    line; a need of 0 always fits (the last resort). A command is shown whole after its lead where both fit, on a line
    of its own where it alone fits, and wraps only where it is wider than any line (inspect's rebuild, kinds' example)."""

    def __init__(self, *choices: tuple[int, list]):
        self.choices = choices

    def __rich_console__(self, console, options):
        for needed, shown in self.choices:
            if needed <= options.max_width:
                break
        yield from shown
