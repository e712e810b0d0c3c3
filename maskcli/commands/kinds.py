"""`maskcli kinds`: every kind of mask, as the registry defines it."""

from __future__ import annotations

import json
from typing import Annotated

import typer

from maskcli.commands.app import app, make_console
from maskcli.commands.options import examples
from maskcli.kinds.base import Kind, Param
from maskcli.text import shell_quote


def example_command(kind: Kind) -> str:
    """The `maskcli show` command that draws the kind's example."""
    return f"maskcli show {shell_quote(kind.example)}" + (f" {kind.options}" if kind.options else "")


def _param_json(param: Param) -> dict:
    return {
        "name": param.name,
        "type": param.type,
        "flag": param.flag,
        "required": param.required,
        "default": None if param.required else param.default,
        "minimum": param.minimum,
        "choices": list(param.choices) or None,
        "sizes": param.sizes,
        "help": param.help,
    }


def kind_json(kind: Kind) -> dict:
    return {
        "name": kind.name,
        "signature": kind.signature,
        "meaning": kind.meaning,
        "keep": kind.keep,
        "params": [_param_json(p) for p in kind.params],
        "example": kind.example,
        "command": example_command(kind),
        "aliases": list(kind.aliases),
        "causal": kind.causal,
    }


@app.command(
    name="kinds",
    epilog=examples("maskcli kinds", "maskcli kinds --json"),
)
def kinds(
    json_: Annotated[bool, typer.Option("--json", help="Print the kinds as a JSON list of objects.")] = False,
) -> None:
    """List every kind of mask: its name, what it keeps, its parameters and an example.

    Kinds combine into expressions with & (both allow), | (either allows), ~ (not) and parentheses, on absolute positions: "document(0,0,1,1) & window(2)".
    """
    from maskcli.kinds import all_kinds

    if json_:
        typer.echo(json.dumps([kind_json(kind) for kind in all_kinds()]))
        return
    from rich.console import Group
    from rich.padding import Padding
    from rich.text import Text

    from maskcli.render.breaking import Breaking

    blocks = []
    for kind in all_kinds():
        head = Text()
        head.append(kind.signature, style="bold")
        head.append(f"   keeps {kind.keep}", style="cyan")
        if kind.aliases:
            head.append(f"   (also: {', '.join(kind.aliases)})", style="dim")
        body = [Breaking(Text(kind.meaning))]
        for param in kind.params:
            line = Text()
            line.append(f"{param.metavar} ", style="bold")
            line.append(f"{param.flag}  ", style="green")
            default = "" if param.required or param.default is None else f" (default {param.default})"  # None: its help says
            sizes = "; or sizes=[3,5] / --sizes 3,5" if param.sizes else ""
            line.append(f"{param.help}{default}{sizes}")
            body.append(Breaking(line, indent=2))  # its wrapped lines under its text, not taken for the next parameter
        body.append(_example(example_command(kind)))
        # a wrapped head stands in, under the name: at column 0 it read as the next kind
        blocks += [Breaking(head, indent=4), Padding(Group(*body), (0, 0, 1, 2))]
    make_console(highlight=False).print(Group(*blocks))


def _example(command: str):
    """'example: COMMAND' on one line; where that does not fit, the command whole on a line of its own, so that it
    copies as one (wrapped, it broke inside its quoted expression); only a command wider than any line wraps."""
    from rich.cells import cell_len
    from rich.text import Text

    from maskcli.render.breaking import Breaking, FirstThatFits

    lead = Text("example: ", style="dim")
    return FirstThatFits((cell_len(lead.plain + command), [lead + Text(command)]),
                         (cell_len(command), [Text("example:", style="dim"), Text(command)]),
                         (0, [Breaking(lead + Text(command), indent=2)]))
