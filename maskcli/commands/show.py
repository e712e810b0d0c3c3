"""`maskcli show` and `maskcli chunk`: build a mask and print, draw, save or list it."""

from __future__ import annotations

import sys
from typing import Annotated

import typer

from maskcli.commands.app import app, check_write, done, echo, make_console, warn
from maskcli.commands.options import Expr, Output, escape, examples, mask_options, output_options
from maskcli.conventions import CONVENTIONS, DTYPES
from maskcli.errors import MaskError
from maskcli.render import wrapped
from maskcli.mask import Mask, MaskOptions


def check_choice(value: str, choices, what: str) -> str:
    if value not in choices:
        raise MaskError(f"unknown {what} {value!r}: choose one of {', '.join(choices)}")
    return value


def kinds_help() -> str:
    """The kinds in one paragraph, from the registry (for a command's help)."""
    from maskcli.kinds import all_kinds

    signatures = ", ".join(
        escape(kind.signature) + (f" (or {', '.join(kind.aliases)})" if kind.aliases else "") for kind in all_kinds()
    )
    return (
        f"Kinds: {signatures}. Combine them with & (both allow), | (either allows), ~ (not) and parentheses. "
        "maskcli kinds explains each."
    )


@app.command(
    epilog=examples(
        "maskcli show causal --len 6",
        "maskcli show \"document(0,0,0,1,1,1) & window(2)\"",
        "maskcli show \"causal | blocks(-1,-1,0,0,0,-1)\"",
        "maskcli show \"causal & (window(3) | sink(1))\" --len 8 --png sinks.png",
        "maskcli show prefill --offset 3 --len 2 --as additive",
        "maskcli show window --len 8 --window 3 --kv-start 2",
        "maskcli show padding --lengths 4,2",
        "maskcli show \"document(sizes=[300,212]) & window(128)\" --why 400,300",
    ),
)
@mask_options(regions=True)
@output_options
def show(
    kind: Expr = None,
    *,
    mask: MaskOptions,
    output: Output,
) -> None:
    """Show a mask as a table (an exact density map when it is wider than the terminal)."""
    present(kind, mask, output)


show.__doc__ = (show.__doc__ or "") + "\n\n" + kinds_help()


@app.command(
    context_settings={"ignore_unknown_options": True},  # so labels may start with a minus: chunk -1,0,1
    epilog=examples(
        "maskcli chunk 0,0,1,1,1,1,2,2,2,3,4,4  # the tutorial's chunk mask",
        "maskcli chunk 0,0,1,1 --lengths 4,3 --png chunk.png",
        "maskcli chunk \"0,0,1,1;0,1,1,2\"  # one row of labels per batch row",
    ),
)
@mask_options(kind_params=False, regions=True)
@output_options
def chunk(
    labels: Annotated[str, typer.Argument(help="Comma-separated chunk label per position, like 0,0,1,1,2 (';' between batch rows), or a .npy/.json/.txt/.pt file.", show_default=False)],
    *,
    mask: MaskOptions,
    output: Output,
) -> None:
    """Show the chunk mask of per-token labels: a token sees its own chunk and every earlier one (label\\[kv] <= label\\[q])."""
    try:
        present("chunk", MaskOptions(**{**mask.__dict__, "params": {"--chunks": labels}}), output)
    except MaskError as error:  # the labels were given as the argument, not as --chunks: name what the user gave
        message = str(error)
        if message.startswith("--chunks "):
            raise MaskError("chunk labels " + message[len("--chunks "):], error.pointer) from None
        raise


def present(expression: str | None, options: MaskOptions, output: Output) -> None:
    """Check the outputs, build the mask once, then print and write what was asked for."""
    from maskcli.files import FIGURE_SUFFIXES, TENSOR_SUFFIXES, check_output_path

    convention, dtype_name, png, json_out, save = output.convention, output.dtype, output.png, output.json, output.save
    if output.grid is not None and not (output.summary and json_out):
        raise MaskError(f"--grid {output.grid} sizes the density grid of --summary --json: add --summary --json, or drop --grid")

    check_choice(convention, CONVENTIONS, "--as convention")
    given_dtype = dtype_name is not None
    dtype_name = check_choice("float32" if dtype_name is None else dtype_name, DTYPES, "--dtype")
    if given_dtype and convention not in ("additive", "min"):
        warn(f"--dtype {dtype_name} is ignored: it is for --as additive and --as min, and --as {convention} has a dtype of its own")
    for flag, value in (("--png", png), ("--save", save), ("--html", output.html)):
        if value is not None and not value.strip():
            raise MaskError(f"{flag} is empty: give a file name")
    from maskcli.sources import registry

    mask = registry.load(expression, options)
    if output.why is not None and output.summary:
        raise MaskError(f"--why {output.why} explains one cell and --summary counts them all: give one of them")
    answers = explain_cells(mask, output.why) if output.why is not None else None
    if json_out and not output.summary and answers is None:  # before any file is written: --json of the cells is refused whole or printed whole
        from maskcli.render.masks import check_mask_json

        check_mask_json(mask)
    png_path = check_output_path(png, FIGURE_SUFFIXES, "--png", mask.slug) if png is not None else None
    save_path = check_output_path(save, TENSOR_SUFFIXES, "--save", mask.slug) if save is not None else None
    html_path = check_output_path(output.html, (".html",), "--html", mask.slug) if output.html is not None else None
    if save_path is not None and save_path.suffix.lower() == ".npy" and dtype_name == "bfloat16" and convention in ("additive", "min"):
        raise MaskError("--save .npy cannot hold bfloat16 (numpy has no such dtype): save as .pt or pick another --dtype")
    if html_path is not None:  # made before any file is written: a page it refuses leaves none behind
        from maskcli.render.html import mask_page

        page = mask_page(mask)
    for message in mask.warnings:
        warn(message)
    shown = None
    if answers is None:  # O(L) counts: --why stays one cell's work
        from maskcli.summary import seen

        shown = seen(mask)  # what the view reads, asked of the Mask once
    empty = empty_rows(shown) if shown is not None else None
    if empty:
        warn(f"{empty}: softmax over nothing is NaN with an -inf fill (maskcli attend shows what each fill makes of it)")
    if save_path is not None:
        save_mask(mask, convention, dtype_name, save_path)
        done(f"wrote {save_path} ({convention} convention)")
    if png_path is not None:
        from maskcli.render.heatmaps import save_figure
        from maskcli.render.masks import mask_figure

        save_figure(mask_figure(mask), png_path)
        done(f"wrote {png_path}")
    if html_path is not None:
        from maskcli.render.html import save_page

        save_page(page, html_path)
        done(f"wrote {html_path}")
    from maskcli.commands.progress import progress

    if output.summary:
        from maskcli.render.summary import summary_json, summary_text
        from maskcli.summary import DEFAULT_GRID, summarise

        grid = parse_grid(output.grid) if output.grid is not None else DEFAULT_GRID
        with progress("counting") as update:
            summary = summarise(mask, grid, update, with_grid=json_out)
        echo(summary_json(summary) if json_out else wrapped(summary_text(summary), sys.stdout).rstrip("\n"))  # between words
        return
    if answers is not None:
        from maskcli.render.why import why_dumps, why_text

        echo(why_dumps(mask, answers) if json_out else wrapped(why_text(mask, answers), sys.stdout).rstrip("\n"))
        return
    from maskcli.render.masks import TABLE_MAX_ROWS, mask_json, mask_views

    if json_out:
        echo(mask_json(mask, convention, dtype_name))
        return
    beside = "--png" if png_path is not None else "--html" if html_path is not None else None
    if beside is not None and max(mask.frame.q_len, mask.frame.k_len) > TABLE_MAX_ROWS:
        done(f"the terminal map is left out beside {beside} for a mask of {mask.frame.q_len:,} x {mask.frame.k_len:,}: "
             f"the {'figure' if beside == '--png' else 'page'} has it; run without {beside} to print the map too")
        return

    console, map_width = wide_console()
    with progress("counting") as update:
        views = mask_views(shown or mask, convention, dtype_name, console, update, map_width)
    for view in views:
        console.print(view)


def explain_cells(mask: Mask, cell: str) -> list:
    """--why Q,KV: each asked cell of `mask` and why (checked before any file is written)."""
    from maskcli.why import explain, parse_cell

    return [explain(mask, b, q, kv) for b, q, kv in parse_cell(cell, mask)]


def empty_rows(mask) -> str | None:
    """'2 query rows see no key (3-4 of batch row 1)'; from the intervals or a kind's own counts, else from the
    cells up to a few million. `mask`: a Mask, or what a view reads of one (summary.Seen)."""
    from maskcli.summary import row_counts, spans

    if mask.whole is not None:  # a region: a row sees what it sees among every key, not only those shown
        from dataclasses import replace

        mask = getattr(mask, "mask", mask)
        mask = replace(mask, frame=replace(mask.frame, k_start=mask.whole.k_start, k_len=mask.whole.k_len))
    f = mask.frame
    if not mask.exact and mask.counted is None and mask.batch * f.q_len * f.k_len > 1 << 24:
        return None
    count, parts = 0, []
    for b in range(mask.batch):
        seen = row_counts(mask, b) > 0
        if not seen.all():
            count += int((~seen).sum())
            runs = spans(~seen, f.q_start, 5)
            shown = ", ".join(f"{a}" if a == z else f"{a}-{z}" for a, z in runs[:4]) + (", ..." if len(runs) > 4 else "")
            parts.append(shown + (f" of batch row {b}" if mask.batch > 1 else ""))
    if not count:
        return None
    return f"{count:,} query row{'s see' if count > 1 else ' sees'} no key ({'; '.join(parts)})"


PIPED_TABLE_WIDTH = 512  # piped output keeps a table whole up to this many columns (some 250 one-digit cells)


def wide_console():
    """A console for a view, and the width a map takes: piped output (no terminal, no COLUMNS) keeps
    tables whole up to PIPED_TABLE_WIDTH columns, and draws maps (and their words) 80 columns wide."""
    import os

    console = make_console()
    if console.is_terminal or os.environ.get("COLUMNS"):
        return console, None
    return make_console(width=PIPED_TABLE_WIDTH), console.width


def parse_grid(text: str) -> tuple[int, int]:
    try:
        rows, cols = (int(part) for part in text.split(","))
    except ValueError:
        raise MaskError(f"--grid {text!r} is not R,C: give the grid's rows and columns like 32,64") from None
    if not (1 <= rows <= 4096 and 1 <= cols <= 4096):
        raise MaskError(f"--grid {text!r}: rows and columns are 1 to 4096 each")
    return rows, cols


def save_mask(mask: Mask, convention: str, dtype: str, path) -> None:
    """The dense mask in `convention`, as .pt or .npy, after checking memory and disk."""
    import math

    import numpy as np

    from maskcli.conventions import bytes_per_cell, to_convention
    from maskcli.files import write_array
    from maskcli.memory import check_dense_fits

    check_dense_fits(mask.shape, bytes_per_cell(convention, dtype) + 1, f"in the {convention} convention")
    check_write(path, math.prod(mask.shape) * bytes_per_cell(convention, dtype), "--save")
    keep = np.ascontiguousarray(np.broadcast_to(mask.dense(), mask.shape))
    write_array(to_convention(keep, convention, dtype), path)
