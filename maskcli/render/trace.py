"""The trace report as rich renderables: one row per group of calls with the same mask, then each group's findings."""

from __future__ import annotations

from rich.text import Text

from maskcli.checks.registry import severity
from maskcli.errors import MaskError
from maskcli.expression import Call, Ints, call_text, parse, print_tree, value_text
from maskcli.expression import Text as Word
from maskcli.render import STYLES, hanging, labelled
from maskcli.render.breaking import Breaking, Fitted



def _status(status: int) -> str:
    """sys.exit(300) as the shell sees it: the low byte of a C long (255 past it), as python's exit does."""
    seen = status & 0xFF if -(2**63) <= status < 2**63 else 255
    return str(status) if seen == status else f"{status} (the shell sees {seen})"


def views(groups: list, calls: int, program: str, status: int, expected: list | None = None) -> list:
    """A title line, the table of groups, the findings under their group's number, and the --expect results."""
    head = hanging(f"maskcli trace {program}: ", Text(f"{calls} attention call{'s' if calls != 1 else ''}"
                   f"{f' in {len(groups)} group' + ('s' if len(groups) != 1 else '') if groups else ''}"
                   + (f"; the program exited with status {_status(status)}" if status else "")), style="bold")
    out: list = [head]
    if groups:
        rows, lines = [], []
        for number, group in enumerate(groups):
            if not group.named:  # (past the first NAMED: said in one line below)
                continue
            first = group.first
            shape = "(" + ",".join(map(str, first.shape)) + ")"
            where = f"{group.where} ×{len(group.calls)}" if len(group.calls) > 1 else group.where
            mask = Text(_brief(group.name, group.expression), style="green" if group.expression else "yellow")
            # each cell breaks between tokens (after a path's '.', a list's ','), its wrapped lines a cell in; where
            # even that does not fit, each group is a line of its own as in model's report: no column loses a word
            rows.append([Text(str(number)), *(Breaking(cell, indent=1) for cell in (Text(where), Text(first.api), Text(group.steps), Text(shape), mask))])
            lines.append(hanging(f"#{number} ", Text.assemble(mask, f" · {first.api} {group.steps} {shape} · {where}")))
        columns = [("#", {"justify": "right"}), ("calls", {}), ("api", {}), ("step", {}), ("shape", {}), ("mask", {})]
        out.append(Fitted(columns, rows, lines))
    for number, group in enumerate(groups):
        for finding in group.findings if group.named else ():
            style = STYLES[severity(finding)]
            out.append(hanging(f"{number}: ", Text(f"{finding.code}: {_brief(finding.message, group.expression)}"), style=style))
    from maskcli.trace.report import unnamed

    rest = unnamed(groups)
    if rest is not None:
        out.append(labelled(rest, style="yellow"))
    for line in expected or []:
        out.append(labelled(line, style="red"))
    return out


def _brief(text: str, expression: str | None) -> str:
    """`text` with the group's expression in brief (a document mask's 1,000 labels as its sizes and count);
    --json keeps every label."""
    return text if expression is None else text.replace(expression, brief(expression))


PARTS = {"document": "documents", "segment": "segments", "chunk": "chunks", "local": "documents", "blocks": "blocks"}


def brief(text: str, most: int = 12) -> str:
    """`text` with each list of more than `most` integers summarised, for a report's line:
    document(0,0,0,1,1,...) -> document(sizes=[3,2,...], 40 documents); up to `most` documents their sizes in full,
    document(sizes=[90,110,56]), which is the same mask and pastes back. The text itself is the mask's name
    (--json keeps it whole); this is only for reading. Text that does not parse is returned as it is."""
    try:
        tree = parse(text)
    except MaskError:
        return text

    def leaf(call) -> str:
        if not isinstance(call, Call) or not call.called:
            return call_text(call) if isinstance(call, Call) else str(call)
        parts = []
        for name, value in ((None, call.positional), *call.keywords):
            if value is None:
                continue
            shown = value_text(value) if isinstance(value, Word) else _brief_ints(call.name, name, value, most)
            parts.append(shown if name is None else f"{name}={shown}")
        return f"{call.name}({', '.join(parts)})"

    return print_tree(tree, leaf)


def _brief_ints(kind: str, keyword: str | None, value: Ints, most: int) -> str:
    values = [v for row in value.rows for v in row]
    if len(values) <= most:
        return value_text(value)
    part = PARTS.get(kind)
    if keyword == "sizes" and len(value.rows) == 1:
        return f"[{','.join(map(str, values[:6]))},...], {len(values):,} {part or 'sizes'}"
    if part is not None and len(value.rows) == 1 and keyword is None:  # labels: their runs, as sizes
        starts = [0] + [i for i in range(1, len(values)) if values[i] != values[i - 1]]
        runs = [b - a for a, b in zip(starts, starts[1:] + [len(values)])]
        if len(set(values[i] for i in starts)) == len(starts) and len(runs) <= most:  # the sizes say it all, as
            return f"sizes=[{','.join(map(str, runs))}]"  # a name that pastes back: document(sizes=[90,110,56])
        if len(set(values[i] for i in starts)) == len(starts):  # each label one run: the first sizes, and how many
            return f"sizes=[{','.join(map(str, runs[:6]))},...], {len(runs):,} {part}"
    rows = f" in {len(value.rows)} rows" if len(value.rows) > 1 else ""
    return f"{','.join(map(str, values[:6]))},..., {len(values):,} values{rows}"
