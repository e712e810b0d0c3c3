"""The trace report as rich renderables: one row per group of calls with the same mask, then each group's findings."""

from __future__ import annotations

from rich import box
from rich.table import Table
from rich.text import Text


def views(groups: list, calls: int, program: str, status: int, expected: list | None = None) -> list:
    """A title line, the table of groups, the findings under their group's number, and the --expect results."""
    head = Text(f"maskcli trace {program}: {calls} attention call{'s' if calls != 1 else ''}"
                f"{f' in {len(groups)} group' + ('s' if len(groups) != 1 else '') if groups else ''}"
                + (f"; the program exited with status {status}" if status else ""), style="bold")
    out: list = [head]
    if groups:
        table = Table(box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True)
        for name, options in (("#", {"justify": "right"}), ("calls", {}), ("api", {}), ("step", {}), ("shape", {}), ("mask", {})):
            table.add_column(name, overflow="fold", **options)
        for number, group in enumerate(groups):
            first = group.first
            shape = "(" + ",".join(map(str, first.shape)) + ")"
            table.add_row(str(number), Text(f"{group.where} ×{len(group.calls)}" if len(group.calls) > 1 else group.where),
                          first.api, group.steps, shape, Text(_brief(group.name, group.expression), style="green" if group.expression else "yellow"))
        out.append(table)
    for number, group in enumerate(groups):
        for finding in group.findings:
            out.append(Text(f"{number}: {finding.code}: {_brief(finding.message, group.expression)}", style="red" if finding.code in ("fully-masked", "sees-later", "polarity") else ""))
    for line in expected or []:
        out.append(Text(line, style="red"))
    return out


def _brief(text: str, expression: str | None) -> str:
    """`text` with the group's expression in brief (a document mask's 1,000 labels as its sizes and count);
    --json keeps every label."""
    from maskcli.expression import brief

    return text if expression is None else text.replace(expression, brief(expression))
