"""`maskcli inspect` and `maskcli convert`: say what a mask tensor is, and write it in another convention.

rich and matplotlib are imported inside the commands, so `maskcli --help` loads neither; torch only for a .pt file
(in or out) and for a bfloat16 result.
"""

from __future__ import annotations

from typing import Annotated

import typer

from maskcli.commands.app import app, check_write, done, echo, make_console, warn
from maskcli.commands.options import InspectHeads, KeyOpt, Png, ReportJson, Tokens, examples
from maskcli.commands.show import check_choice
from maskcli.conventions import CONVENTIONS, DTYPES
from maskcli.errors import MaskError

FILE_HELP = (
    "The mask tensor: .pt (loaded with weights_only=True, so no code in it runs), .npy, .npz, .safetensors, "
    ".json, or inline JSON like '[[1,0],[1,1]]'."
)
OUT_SUFFIXES = (".pt", ".npy", ".json", ".pth")

File = Annotated[str, typer.Argument(help=FILE_HELP, show_default=False)]
To = Annotated[str, typer.Option("--to", help="Target convention: " + "; ".join(f"{k} = {v}" for k, v in CONVENTIONS.items()) + ".", show_default=False)]
Out = Annotated[str, typer.Option("--out", metavar="FILE", help="Output file; .pt (or .pth), .npy or .json by extension. Written whole or not at all.", show_default=False)]
ConvertDtype = Annotated[str | None, typer.Option("--dtype", help=f"Float dtype of an additive or min result: {', '.join(DTYPES)} (default float32).", show_default=False)]
From = Annotated[str | None, typer.Option(
    "--from", help="Say which way round a bool (or 0/1) input is, where its structure does not tell: keep (True = attend) or block (True = masked).",
    show_default=False,
)]


@app.command(
    epilog=examples(
        "maskcli show causal --len 4 --as block --save mask.pt  # a mask to look at",
        "maskcli inspect mask.pt",
        "maskcli inspect mask.pt --heads 8 --png mask.png",
        "maskcli inspect '[[1,0,0],[1,1,0],[1,1,1]]' --json",
    ),
)
def inspect(
    file: File,
    key: KeyOpt = None,
    from_: From = None,
    heads: InspectHeads = None,
    tokens: Tokens = None,
    png: Png = None,
    json_: ReportJson = False,
) -> None:
    """Say what a mask tensor is, then show it.

    The report: dtype and shape; how the shape broadcasts to (B, H, Lq, Lk) and which APIs take it as is (SDPA attn_mask, nn.MultiheadAttention attn_mask and key_padding_mask); its convention (a bool mask's polarity is read from its structure, and the report says when it cannot tell); the maskcli expression that rebuilds it exactly, with the command; and findings: rows that see no key, a query that sees a later key, a fill value that turns to -inf in float16/bfloat16, a 3-D mask whose first dimension is the head count.
    """
    from maskcli.files import FIGURE_SUFFIXES, check_output_path

    from maskcli.positions import check_size

    check_size(heads, "--heads", "your model's head count")
    if from_ is not None:
        check_choice(from_, ("keep", "block"), "--from convention")
    png_path = check_output_path(png, FIGURE_SUFFIXES, "--png") if png is not None else None

    from maskcli.sources import registry

    values, label, padding, keep_form = registry.values(file, key, from_, work=(11, "to inspect"))  # numpy: only a .pt imports torch
    from maskcli.inspect.analysis import analyse

    if keep_form:
        from maskcli.inspect.polarity import Convention

        given = Convention("keep", "values", "a call captured by maskcli trace, in keep form (True = may attend)")
    else:
        given = _convention(values, from_, label) if from_ is not None else None
    _check_room(values, label, 11 + values.itemsize, "to inspect")
    analysis = analyse(values, heads, given, padding, label)
    mask = _display_mask(analysis, file if key is None else f"{file} [{key}]", tokens)
    if png_path is not None:
        from maskcli.render.heatmaps import save_figure
        from maskcli.render.masks import mask_figure

        source = file if key is None else f"{file} [{key}]"
        name = analysis.structure.mask.title if analysis.structure.mask is not None else None
        drawn = f"{source}: {analysis.convention.name} mask, drawn as keep" + (f" (it is {name})" if name else "")
        save_figure(mask_figure(mask, drawn), png_path)
        done(f"wrote {png_path}")
    report = analysis.report(file)
    if json_:
        import json

        echo(json.dumps(report))
        return
    _print_report(analysis, report, mask)


def _display_mask(analysis, source: str, tokens: str | None):
    """A Mask over the dense keep tensor, named by the expression that rebuilds it (or by the file)."""
    import numpy as np

    from maskcli.mask import from_tensor

    dense = np.ascontiguousarray(analysis.keep4)
    _, _, q_len, k_len = dense.shape
    parsed = None
    if tokens is not None:
        parsed = tuple(tokens.split())
        if not parsed:
            raise MaskError(f"--tokens {tokens!r} has no words: give one word per key position")
        if len(parsed) != k_len:
            raise MaskError(f"--tokens has {len(parsed)} words but the mask has {k_len} key positions: give exactly {k_len}")
        if analysis.q_offset + q_len > k_len:
            raise MaskError(f"--tokens labels key positions, and this mask has more queries ({q_len}) than keys ({k_len}): drop --tokens")
    structure = analysis.structure
    name = structure.mask.title if structure.mask is not None else source
    return from_tensor(dense, name, analysis.q_offset, 0, parsed)


def _shown_convention(analysis) -> tuple[str, str, str | None]:
    """The convention and dtype to draw the cells in: the file's own where maskcli can write its values."""
    from maskcli.conventions import FLOAT_MIN
    from maskcli.tensorfile import dtype_name

    convention = analysis.convention
    own_dtype = dtype_name(analysis.tensor)
    if convention.name in ("keep", "block"):
        return convention.name, "float32", None
    if convention.name == "int" and convention.ones_mean == "attend":
        return "int", "float32", None
    if convention.name == "additive" and convention.sentinel is None:
        return "additive", own_dtype if own_dtype in DTYPES else "float32", None
    if convention.name == "min":
        for name in DTYPES:
            if convention.sentinel == FLOAT_MIN[name]:
                return "min", name, None
    return "keep", "float32", "shown as keep (1 = may attend, 0 = masked): the file's own values are not one of the conventions maskcli draws"


def _print_report(analysis, report: dict, mask) -> None:
    from rich.text import Text

    from maskcli.render import hanging
    from maskcli.render.masks import mask_views
    from maskcli.render.tables import findings_text

    console = make_console(highlight=False)
    convention, structure = analysis.convention, analysis.structure
    # each line's wrapped lines stand under its text, not at column 0 (where the second API of `fits:` lost its
    # place under the first, and a wrapped line read as a line of its own)
    lines = [hanging(Text(f"{report['file']}: ", style="bold"), Text(f"{report['dtype']} {report['shape']}")),
             hanging("shape: ", Text(report["broadcast"])),
             hanging("fits: ", Text("\n".join(report["apis"])))]
    how = {"values": "", "structure": "", "guess": " (a guess)", "cannot tell": " (cannot tell)"}[convention.how]
    lines.append(hanging(Text("convention: ", style="bold"), Text.assemble((f"{convention.name}{how}", "bold"), f" — {convention.note}")))
    if structure.expression is not None:
        lines.append(_rebuilt(Text.assemble(("structure: ", "bold"), (structure.expression, "bold")), structure.command))
        if structure.note:
            lines.append(hanging("  ", Text(structure.note, style="dim")))
        if structure.also:
            lines.append(hanging("  also rebuilt by: ", Text(structure.also), style="dim"))
    else:
        lines.append(hanging(Text("structure: ", style="bold"), Text.assemble(("none recognised", "bold"), f" — {structure.note}")))
        if structure.closest:
            close = structure.closest
            apart = close["cells_apart"]
            lines.append(hanging("  closest: ", Text(f"{close['command']}, {apart:,} cell{'s' if apart != 1 else ''} apart"), style="dim"))
            for line in close["rows"][:3]:
                lines.append(hanging("    ", Text(line), style="dim"))
    for line in lines:
        console.print(line)
    console.print(findings_text(analysis.findings) if analysis.findings else Text("findings: none", style="green"))
    shown, dtype_name, note = _shown_convention(analysis)
    if note:
        console.print(Text(note, style="dim"))
    for view in mask_views(mask, shown, dtype_name, console):
        console.print(view)


def _rebuilt(head, command: str):
    """'structure: EXPR — rebuild it with: COMMAND' on one line where it fits; else the command on a line of its own
    under the structure, whole where it fits (wrapped after 'rebuild it with:', it broke in the middle of the command)."""
    from rich.cells import cell_len
    from rich.text import Text

    from maskcli.render import hanging
    from maskcli.render.breaking import FirstThatFits

    line = Text.assemble(head, f" — rebuild it with: {command}")
    apart = [hanging(Text("structure: ", style="bold"), head[len("structure: "):]),
             hanging("  rebuild it with: ", Text(command))]  # (a command wider than its room wraps under itself)
    return FirstThatFits((cell_len(line.plain), [line]), (0, apart))


@app.command(
    epilog=examples(
        "maskcli show causal --len 4 --as block --save mha_mask.pt  # a mask to convert",
        "maskcli convert mha_mask.pt --to keep --out sdpa_mask.pt",
        "maskcli convert mha_mask.pt --to min --dtype float16 --out hf_mask.npy",
        "maskcli convert '[[0,1],[0,0]]' --from block --to additive --out padding.json",
    ),
)
def convert(
    file: File,
    to: To,
    out: Out,
    dtype: ConvertDtype = None,
    key: KeyOpt = None,
    from_: From = None,
) -> None:
    """Write a mask in another convention (keep, block, additive, min, int), in the same shape.

    The input's convention is read from its values; a bool (or 0/1) mask's polarity from its structure, and where that cannot tell, --from says it. An additive bias (values other than 0 and one fill) is not a mask and is refused.
    """
    from maskcli.files import check_output_path

    check_choice(to, CONVENTIONS, "--to convention")
    if dtype is not None:
        check_choice(dtype, DTYPES, "--dtype")
        if to not in ("additive", "min"):
            warn(f"--dtype {dtype} is for --to additive or min; --to {to} is written as {'bool' if to in ('keep', 'block') else 'int64'}")
    if from_ is not None:
        check_choice(from_, ("keep", "block"), "--from convention")
    out_path = check_output_path(out, OUT_SUFFIXES, "--out")
    dtype = dtype or "float32"
    if out_path.suffix.lower() == ".npy" and dtype == "bfloat16" and to in ("additive", "min"):  # else it is ignored, as said
        raise MaskError("--out .npy cannot hold bfloat16 (numpy has no such dtype): write .pt or .json, or pick another --dtype")

    _check_source(file)
    from maskcli.conventions import to_convention
    from maskcli.files import write_array
    from maskcli.inspect.polarity import to_keep
    from maskcli.sources.tensor import load_mask

    out_bytes = {"keep": 1, "block": 1, "int": 8}.get(to) or {"float16": 2, "bfloat16": 2, "float64": 8}.get(dtype, 4)
    values, label = load_mask(file, key, work=(5 + out_bytes, f"to convert to {to}"))
    _check_room(values, label, 5 + out_bytes, f"to convert to {to}")
    convention = _convention(values, from_, label)
    if convention.name == "bias":
        raise MaskError(f"{label} is not a mask but an additive bias ({convention.note}): nothing to convert")
    elif not convention.sure:
        raise MaskError(f"cannot tell whether {label} is keep or block ({convention.note}): say which with --from keep or --from block")
    result = to_convention(to_keep(values, convention), to, dtype)
    check_write(out_path, result.numel() * result.element_size() if hasattr(result, "numel") else result.nbytes, "--out")
    write_array(result, out_path)
    described = f"{convention.name}" + (", 1 = masked" if convention.name == "int" and convention.ones_mean == "masked" else "")
    done(f"wrote {out_path}: {described} -> {to}{' ' + dtype if to in ('additive', 'min') else ''}, shape {list(result.shape)}")


def _check_source(file: str) -> None:
    """A missing, unreadable, empty or unknown file is refused before torch is imported."""
    from maskcli.tensorfile import checked_source, is_inline

    if not is_inline(file):
        checked_source(file, "FILE")


def _check_room(values, label: str, bytes_per_cell: int, doing: str) -> None:
    """Refuse up front a loaded mask too large to work on in the memory left (measured: the peak per cell)."""
    from maskcli.memory import check_bytes_fit

    check_bytes_fit(
        values.size * bytes_per_cell, f"{label} ({' x '.join(map(str, values.shape))} cells)", doing,
        fix="slice the part you need into a smaller file first (like mask[0, 0] or mask[..., :4096, :4096]), or run where there is more memory",
    )


def _convention(values, from_: str | None, label: str):
    """The tensor's convention as its values say, or as --from says for a bool or 0/1 mask."""
    from maskcli.inspect.polarity import Convention, classify

    convention = classify(values, label)
    if from_ is None:
        return convention
    if convention.name not in ("keep", "block", "int"):
        raise MaskError(f"--from is for bool and 0/1 masks; {label} is {convention.name} ({convention.note})")
    return Convention(from_, "values", "given with --from")
