"""The Typer app: thin commands that parse, call the core and render.

Only this module turns a MaskError (or a usage error) into one line on stderr and
exit status 2. torch and matplotlib are imported inside the commands that need
them, so `maskcli --help` loads neither.
"""

from __future__ import annotations

import sys
from typing import Annotated

import typer
from typer.core import TyperGroup

try:  # newer typer carries its own copy of click, with its own exception classes
    from typer._click import exceptions as _click_exceptions
except ImportError:  # pragma: no cover - older typer raises click's
    from click import exceptions as _click_exceptions

UsageError = _click_exceptions.UsageError
NoArgsIsHelpError = getattr(_click_exceptions, "NoArgsIsHelpError", ())

from maskcli import __version__
from maskcli.errors import MaskError
from maskcli.spec import CONVENTIONS, DTYPES, KINDS, check_choice, make_spec


class MaskcliGroup(TyperGroup):
    """Every bad input, ours or click's, ends as one line on stderr and exit status 2."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        try:
            code = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except NoArgsIsHelpError as error:
            typer.echo(error.ctx.get_help())
            code = 0
        except UsageError as error:
            command = error.ctx.command_path if error.ctx else "maskcli"
            fail(f"{command}: {error.format_message()} (see '{command} --help')")
        except MaskError as error:
            fail(str(error))
        except typer.Abort:
            typer.echo("maskcli: aborted", err=True)
            code = 1
        except BrokenPipeError:
            sys.stderr.close()
            code = 1
        if not standalone_mode:
            return code
        sys.exit(code if isinstance(code, int) else 0)


def integer(value: str) -> int:
    """Parse an integer option so that the error quotes what was typed."""
    try:
        return int(value)
    except ValueError:
        raise typer.BadParameter(f"{value!r} is not a whole number") from None


def fail(message: str) -> None:
    typer.echo(f"maskcli: error: {message}", err=True)
    sys.exit(2)


def warn(message: str) -> None:
    typer.echo(f"maskcli: warning: {message}", err=True)


app = typer.Typer(
    cls=MaskcliGroup,
    name="maskcli",
    help="See and check attention masks: build them, show them as tables or heatmaps, "
    "and run attention through them.",
    epilog="Example: maskcli show causal --len 6",
    no_args_is_help=True,
    add_completion=False,
    context_settings={"help_option_names": ["-h", "--help"]},
    pretty_exceptions_enable=False,
)

_KIND_LIST = "\n\n".join(f"[bold]{kind}[/bold]: {text}" for kind, text in KINDS.items())
_MASK = "Mask options"
_OUT = "Output"

Len = Annotated[int | None, typer.Option("--len", "-n", help="Number of query positions (default 8, or the longest --lengths).", parser=integer, rich_help_panel=_MASK)]
Diagonal = Annotated[int | None, typer.Option(help="tril/triu: the diagonal argument of torch.tril/triu (default 0 for tril, 1 for triu).", parser=integer, rich_help_panel=_MASK)]
Means = Annotated[str | None, typer.Option(help="tril/triu: read the 1-cells as 'keep' (tril default) or 'block' (triu default).", rich_help_panel=_MASK)]
Lengths = Annotated[str | None, typer.Option(help="Valid length per batch row, like 4,2: later keys are padding. Combines with any kind.", rich_help_panel=_MASK)]
Ids = Annotated[str | None, typer.Option(help="Token ids per batch row, ';' between rows, like '5,6,7,0;8,9,0,0': ids equal to --pad-id are padding.", rich_help_panel=_MASK)]
PadId = Annotated[int, typer.Option(help="The padding token id for --ids.", parser=integer, rich_help_panel=_MASK)]
Offset = Annotated[int | None, typer.Option("--offset", "--prev", help="prefill: tokens already in the KV cache; queries sit at positions P..P+N-1.", parser=integer, rich_help_panel=_MASK)]
Chunks = Annotated[str | None, typer.Option(help="chunk/document: one integer label per token, like 0,0,1,1.", rich_help_panel=_MASK)]
Window = Annotated[int | None, typer.Option(help="window: each query sees itself and the W-1 keys before it (W keys in all, as Hugging Face's sliding_window counts; some libraries count W-1 or W+1).", parser=integer, rich_help_panel=_MASK)]
Prefix = Annotated[int | None, typer.Option(help="prefix: the first P tokens see each other both ways; the rest is causal.", parser=integer, rich_help_panel=_MASK)]
Heads = Annotated[int, typer.Option(help="Number of attention heads (the H in B, H, Lq, Lk).", parser=integer, rich_help_panel=_MASK)]
Tokens = Annotated[str | None, typer.Option(help="Words that label the axes, one per key position: \"Your journey starts with one step\".", rich_help_panel=_OUT)]
As = Annotated[str, typer.Option("--as", help="Convention shown and saved: " + "; ".join(f"{k} = {v}" for k, v in CONVENTIONS.items()) + ".", rich_help_panel=_OUT)]
Dtype = Annotated[str, typer.Option(help=f"Float dtype for the additive and min conventions: {', '.join(DTYPES)}.", rich_help_panel=_OUT)]
Png = Annotated[str | None, typer.Option("--png", help="Write a heatmap; the extension picks the format: .png, .svg or .pdf.", rich_help_panel=_OUT)]
Json = Annotated[bool, typer.Option("--json", help="Print one JSON object: kind, params, shape, q_offset, convention and the mask as nested 0/1 lists (1 = may attend).", rich_help_panel=_OUT)]
Save = Annotated[str | None, typer.Option(help="Save the mask tensor in the --as convention; .pt or .npy by extension.", rich_help_panel=_OUT)]


def version_callback(value: bool) -> None:
    if value:
        typer.echo(f"maskcli {__version__}")
        raise typer.Exit()


@app.callback()
def root(
    version: Annotated[bool, typer.Option("--version", callback=version_callback, is_eager=True, help="Print the version and exit.")] = False,
) -> None:
    """See and check attention masks."""


@app.command(
    epilog="Examples: maskcli show causal --len 6 · maskcli show padding --lengths 4,2 · "
    "maskcli show prefill --offset 3 --len 2 --as additive · maskcli show window --len 8 --window 3 --png window.png",
)
def show(
    kind: Annotated[str, typer.Argument(help="Mask kind: " + ", ".join(KINDS) + ".", show_default=False)],
    length: Len = None,
    diagonal: Diagonal = None,
    means: Means = None,
    lengths: Lengths = None,
    ids: Ids = None,
    pad_id: PadId = 0,
    offset: Offset = None,
    chunks: Chunks = None,
    window: Window = None,
    prefix: Prefix = None,
    heads: Heads = 1,
    tokens: Tokens = None,
    as_: As = "keep",
    dtype: Dtype = "float32",
    png: Png = None,
    json_: Json = False,
    save: Save = None,
) -> None:
    """Show a mask as a table (a density map when it is wider than the terminal).

    Kinds:

    """
    spec = make_spec(
        kind, length=length, diagonal=diagonal, means=means, lengths=lengths, ids=ids, pad_id=pad_id,
        offset=offset, chunks=chunks, window=window, prefix=prefix, heads=heads, tokens=tokens,
    )
    _present(spec, as_, dtype, png, json_, save)


show.__doc__ = (show.__doc__ or "") + _KIND_LIST


@app.command(
    epilog="Example: maskcli chunk 0,0,1,1,1,1,2,2,2,3,4,4 (the tutorial's chunk mask) · "
    "maskcli chunk 0,0,1,1 --lengths 4,3 --png chunk.png",
)
def chunk(
    labels: Annotated[str, typer.Argument(help="Comma-separated chunk label per token, like 0,0,1,1,2.", show_default=False)],
    lengths: Lengths = None,
    ids: Ids = None,
    pad_id: PadId = 0,
    heads: Heads = 1,
    tokens: Tokens = None,
    as_: As = "keep",
    dtype: Dtype = "float32",
    png: Png = None,
    json_: Json = False,
    save: Save = None,
) -> None:
    """Show the chunk mask of per-token labels: a token sees its own chunk and every earlier one (label[kv] <= label[q])."""
    spec = make_spec("chunk", chunks=labels, lengths=lengths, ids=ids, pad_id=pad_id, heads=heads, tokens=tokens)
    _present(spec, as_, dtype, png, json_, save)


def _present(spec, convention: str, dtype_name: str, png: str | None, json_out: bool, save: str | None) -> None:
    """Check the outputs, build the mask once, then print and write what was asked for."""
    from maskcli.files import FIGURE_SUFFIXES, TENSOR_SUFFIXES, check_output_path

    check_choice(convention, CONVENTIONS, "--as convention")
    check_choice(dtype_name, DTYPES, "--dtype")
    png_path = check_output_path(png, FIGURE_SUFFIXES, "--png") if png else None
    save_path = check_output_path(save, TENSOR_SUFFIXES, "--save") if save else None
    if save_path is not None and save_path.suffix.lower() == ".npy" and dtype_name == "bfloat16" and convention in ("additive", "min"):
        raise MaskError("--save .npy cannot hold bfloat16 (numpy has no such dtype): save as .pt or pick another --dtype")
    for message in spec.warnings:
        warn(message)

    from maskcli import output
    from maskcli.masks import build

    mask = build(spec)
    if save_path is not None:
        output.save_tensor(mask, convention, dtype_name, save_path)
        warn_done(f"wrote {save_path} ({convention} convention)")
    if png_path is not None:
        output.save_mask_figure(mask, png_path)
        warn_done(f"wrote {png_path}")
    if json_out:
        typer.echo(output.mask_json(mask))
    else:
        from rich.console import Console

        console = Console()
        for view in output.mask_views(mask, convention, dtype_name, console):
            console.print(view)


def warn_done(message: str) -> None:
    typer.echo(message, err=True)


def main() -> None:
    app()
