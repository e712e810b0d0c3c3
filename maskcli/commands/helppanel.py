"""--help's option panels on a narrow terminal: each option's help beside its names and on under them, full width.

typer draws an option panel as a table of name, short name, type and help: at 60 columns the help column is 20
characters wide, and attend's --help ran to 153 lines. Below NARROW columns the same panels are drawn with each
option's help (typer's own text, with its default) after its names, wrapped to the panel's full width under a
hanging indent; wider terminals get typer's table unchanged.
"""

from __future__ import annotations

NARROW = 100  # columns below which an option's help wraps under its names


def install() -> None:
    """Draw typer's option panels this way from now on (once; typer.rich_utils._print_options_panel, typer < 0.29)."""
    import typer.rich_utils as rich_utils

    if getattr(rich_utils._print_options_panel, "maskcli_narrow", False):
        return
    wide = rich_utils._print_options_panel

    def panel(*, name, params, ctx, markup_mode, console):
        if console.width >= NARROW:
            return wide(name=name, params=params, ctx=ctx, markup_mode=markup_mode, console=console)
        return _narrow(rich_utils, name, params, ctx, markup_mode, console)

    panel.maskcli_narrow = True
    rich_utils._print_options_panel = panel


def _names(param, ctx) -> str:
    """'--len, -n <integer>': the flags, then what the option takes (nothing for a flag); an argument's metavar."""
    import typer.core

    if isinstance(param, typer.core.TyperArgument):
        return param.metavar or (param.name or "").upper()
    opts = [*param.opts, *param.secondary_opts]
    if param.name == "help":  # click builds the help option's names from a set: their order changes run to run
        opts.sort(key=len)
    flags = ", ".join(opts)
    takes = "" if param.is_flag else param.make_metavar(ctx=ctx)
    return f"{flags} {takes}".rstrip()


def _narrow(rich_utils, name, params, ctx, markup_mode, console) -> None:
    import textwrap

    from rich.panel import Panel
    from rich.table import Table
    from rich.text import Text

    width = console.width - 4  # the panel's borders and padding
    table = Table.grid(expand=True)
    table.add_column(overflow="fold")
    for param in params:
        parts = rich_utils._get_parameter_help(param=param, ctx=ctx, markup_mode=markup_mode).renderables
        text = " ".join(getattr(part, "plain", str(part)) for part in parts)
        # the help starts beside the names and goes on under them, indented: a hanging indent
        lines = textwrap.wrap(f"{_names(param, ctx)}  {text}", width, subsequent_indent="  ", break_long_words=False,
                              break_on_hyphens=False)
        table.add_row(rich_utils.highlighter(Text("\n".join(lines))))
    console.print(Panel(table, border_style=rich_utils.STYLE_OPTIONS_PANEL_BORDER, title=name,
                        title_align=rich_utils.ALIGN_OPTIONS_PANEL))
