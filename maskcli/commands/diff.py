"""`maskcli diff A B`: is my mask the one I meant? Exit status 0 when equal, 1 when they differ."""

from __future__ import annotations

from dataclasses import replace
import sys
from pathlib import Path
from typing import Annotated

import typer

from maskcli.commands.app import app, done, echo
from maskcli.commands.options import Html, Why, examples, mask_options
from maskcli.errors import MaskError
from maskcli.render import wrapped
from maskcli.mask import Mask, MaskOptions

SIDE_HELP = (
    "A mask expression (\"window(4096)\"), a mask tensor file (.pt, .npy, .npz, .safetensors, .json, in any convention), "
    "or the NAME of your mask_mod loaded with --mask-mod FILE.py:NAME (only that flag runs your code)."
)
DiffPng = Annotated[str | None, typer.Option("--png", metavar="FILE", help="Write a figure coloured by category: .png, .svg or .pdf.")]
DiffJson = Annotated[bool, typer.Option("--json", help="Print the counts, the first rows that differ (with intervals and in words) as one JSON object.")]


def _side(text: str, options: MaskOptions, kinds: dict, label: str) -> Mask:
    from maskcli.mask import build
    from maskcli.sources.registry import from_file

    if _is_file(text):
        from maskcli.files import state

        from maskcli.sources.trace import split_spec

        spec = split_spec(text)
        if state(Path(spec[0] if spec and not Path(text).exists() else text)) == "missing":
            raise MaskError(f"{label} {text!r}: no such file (give a mask file, an expression, or FILE.py:NAME)")
        return from_file(text, options, label)
    return build(text, options, kinds=kinds)


def _named_mask_mod(text: str, label: str, given: str | None) -> str:
    """A side written FILE.py:NAME or module:NAME stands for the mask_mod NAME only when --mask-mod loads that very
    spec: importing it runs code, and only the flag that says so may (`diff causal this:f` must import nothing)."""
    from maskcli.sources.usermod import SPEC, looks_like_spec

    if not looks_like_spec(text):
        return text
    name = SPEC.match(text)["name"]
    if given is not None and given.strip() == text.strip():
        return name
    if given is not None:
        raise MaskError(f"{label} {text!r} names a mask_mod that --mask-mod {given!r} does not load: diff loads one mask_mod, "
                        f"so give it with --mask-mod and write the other side as an expression or a tensor file")
    raise MaskError(f"{label} {text!r} looks like a mask_mod: loading one runs its code, so only --mask-mod loads it: "
                    f"give --mask-mod {text} and write {label} as {name}")


def _advice(is_file: dict[str, bool], fa, fb) -> str:
    """How to give two masks the same cells, where they differ: options move an expression, not a file."""
    from maskcli.diff import SAME_POSITIONS

    rows, keys = (max(fa.q_start, fb.q_start), min(fa.q_end, fb.q_end)), (max(fa.k_start, fb.k_start), min(fa.k_end, fb.k_end))
    shared = (f"compare the cells both cover with --rows {rows[0]}:{rows[1]} --keys {keys[0]}:{keys[1]}"
              if rows[0] < rows[1] and keys[0] < keys[1] else "they share no cell")
    if all(is_file.values()):
        return f"each file's shape is its own and no option changes it: {shared}, or compare masks of the same shape (two calls of the same size)"
    if any(is_file.values()):
        return (f"the file's shape fixes its positions: leave out --len, --offset, --kv-start and --kv-len (the expression "
                f"then takes the file's), or {shared}")
    return SAME_POSITIONS


def _is_file(text: str) -> bool:
    from maskcli.tensorfile import READ_SUFFIXES
    from maskcli.sources.usermod import looks_like_spec

    from maskcli.sources.trace import split_spec

    if split_spec(text) is not None and not Path(text).exists():  # TRACE.pt:7, a call of a maskcli trace --save
        return True
    return not looks_like_spec(text) and Path(text).suffix.lower() in READ_SUFFIXES and not text.lstrip().startswith(("[", "{"))


def _for_a_file(options: MaskOptions) -> MaskOptions:
    """The options a tensor file takes: its key, convention, heads and where its queries sit; not the sizes,
    padding or kind parameters, which are for the expression beside it."""
    return replace(options, length=None, kv_len=None, align=None, lengths=None, ids=None, tokens=None, params={})


def _explain(sides: dict[str, Mask], cell: str, png: str | None, json_: bool, html: str | None, advice: str) -> None:
    """--why: the cell in A and in B, each side's tree; exit status 1 where the cell differs (`advice`: how to give
    A and B the same cells, as without --why)."""
    from maskcli.diff import check_comparable
    from maskcli.render.why import diff_why_dumps, diff_why_text
    from maskcli.why import explain, parse_cell

    for flag, value in (("--png", png), ("--html", html)):
        if value is not None:
            raise MaskError(f"--why {cell} explains one cell and {flag} draws them all: give one of them")
    a, b = sides["A"], sides["B"]
    check_comparable(a, b, advice)
    cells = parse_cell(cell, a if a.batch >= b.batch else b)
    answers = {label: [explain(side, min(i, side.batch - 1), q, kv) for i, q, kv in cells] for label, side in sides.items()}
    echo(diff_why_dumps(a, b, answers["A"], answers["B"]) if json_ else wrapped(diff_why_text(a, b, answers["A"], answers["B"]), sys.stdout).rstrip("\n"))
    if any(x.keep != y.keep for x, y in zip(answers["A"], answers["B"])):
        raise typer.Exit(1)


def _placed_alone(texts: dict, is_file: dict, options: MaskOptions, kinds: dict, files: dict) -> dict:
    """The expression sides built as `show` builds them, and the file re-read at their positions, where the user gave
    sizes but no placing (--len 3 --kv-len 7: queries 0-2, as `show` and `inspect`'s rebuild command place them) and
    the file has that shape: a file does not say where its queries sit, so the sizes the user gave say it. Empty where
    that does not apply (the file then places the expressions: its queries at the end of its keys)."""
    if not files or len(files) == len(texts) or options.offset is not None or options.align is not None \
            or (options.length is None and options.kv_len is None):
        return {}
    try:
        alone = {label: _side(texts[label], options, kinds, label) for label in texts if not is_file[label]}
    except MaskError:
        return {}  # (the sizes given do not build it alone: the file's shape places it, as without them)
    g, (label, file) = next(iter(alone.values())).frame, next(iter(files.items()))
    f = file.frame
    if (g.q_len, g.k_len) != (f.q_len, f.k_len) or (g.q_start, g.k_start) == (f.q_start, f.k_start):
        return {}
    at = replace(_for_a_file(options), offset=g.q_start, kv_start=g.k_start or None)
    files[label] = _side(texts[label], at, kinds, label)
    return alone


def _positions_given(options: MaskOptions) -> bool:
    return any(value is not None for value in (options.length, options.offset, options.kv_start, options.kv_len, options.align))


@app.command(
    epilog=examples(
        "maskcli diff \"document(0,0,1,1)\" causal --png leak.png",
        "maskcli show \"window(4096)\" --len 8192 --offset 100 --as min --save hf_mask.pt  # a mask to compare",
        "maskcli diff \"window(4096)\" hf_mask.pt",
        "maskcli diff \"window(4095)\" \"window(4096)\" --len 1048576",
        "maskcli diff \"document(0,0,1,1)\" causal --why 2,1",
    ),
)
@mask_options(regions=True)
def diff(
    a: Annotated[str, typer.Argument(help="A: " + SIDE_HELP, show_default=False, metavar="A")],
    b: Annotated[str, typer.Argument(help="B: " + SIDE_HELP, show_default=False, metavar="B")],
    png: DiffPng = None,
    json_: DiffJson = False,
    why: Why = None,
    html: Html = None,
    *,
    mask: MaskOptions,
) -> None:
    """Compare two masks: the cells only A allows, only B allows, and both, and the first rows that differ, in words.

    Exit status 0 when they are equal and 1 when they differ, so a test suite can call it (with --why, the one cell: each side's tree there, exit status 1 where the cell differs). Two expressions are compared on their key intervals, exactly at any length; a tensor or a mask_mod cell by cell. A tensor's shape sets the positions of an expression beside it (its queries at the end of its keys) unless --len/--offset say otherwise.
    """
    from maskcli.files import FIGURE_SUFFIXES, check_output_path

    if mask.mask_file is not None:
        raise MaskError("diff takes its masks as A and B: give the file as one of them instead of --mask")
    for flag, value in (("--png", png), ("--html", html)):
        if value is not None and not value.strip():
            raise MaskError(f"{flag} is empty: give a file name")
    from maskcli.sources.usermod import kinds as user_kinds

    texts = {"A": a, "B": b}
    for label, text in texts.items():
        texts[label] = _named_mask_mod(text, label, mask.mask_mod)
    kinds = user_kinds(mask.mask_mod, mask.mask_mod_args)
    options = replace(mask, mask_mod=None, mask_mod_args=None)
    is_file = {label: _is_file(text) for label, text in texts.items()}
    for flag, value in (("--key", options.key), ("--from", options.from_)):  # (read from a file side only: with none
        if value is not None and not any(is_file.values()):  # it was dropped without a word)
            raise MaskError(f"{flag} {value} is for a mask file: give A or B as a file (a .pt, .npy, ...), or drop {flag}")
    # a tensor's shape says its own positions: the position, padding and kind options are the expressions'
    sides: dict[str, Mask] = {label: _side(texts[label], _for_a_file(options), kinds, label) for label in texts if is_file[label]}
    alone = _placed_alone(texts, is_file, options, kinds, sides)
    if alone:
        sides.update(alone)
    elif sides:
        f = next(iter(sides.values())).frame  # the (first) file places the expressions, unless options say otherwise
        placed = replace(
            options,
            length=options.length if options.length is not None else f.q_len,
            offset=options.offset if options.offset is not None else f.q_start,
            kv_start=options.kv_start if options.kv_start is not None else f.k_start or None,
            kv_len=options.kv_len if options.kv_len is not None else f.k_len if f.k_end != f.q_end else None,
        )
        sides.update({label: _side(texts[label], placed, kinds, label) for label in texts if not is_file[label]})
    else:
        sides = {label: _side(text, options, kinds, label) for label, text in texts.items()}
        fa, fb = sides["A"].frame, sides["B"].frame
        if (fa.q_start, fa.q_len, fa.k_start, fa.k_len) != (fb.q_start, fb.q_len, fb.k_start, fb.k_len) and not _positions_given(options):
            # one side's labels or words fix the sequence: place the other side the same way
            for fixed, other, text in (("A", "B", b), ("B", "A", a)):
                f = sides[fixed].frame
                again = replace(options, length=f.q_len, offset=f.q_start or None, kv_start=f.k_start or None,
                                kv_len=f.k_len if f.k_end != f.q_end else None)
                try:
                    sides[other] = _side(text, again, kinds, other)
                    break
                except MaskError:
                    continue
    from maskcli.sources.registry import region

    sides = {label: region(sides[label], mask) for label in texts}  # the same region of each
    if why is not None:
        _explain(sides, why, png, json_, html, _advice(is_file, sides["A"].frame, sides["B"].frame))
        return
    png_path = check_output_path(png, FIGURE_SUFFIXES, "--png", "diff") if png is not None else None
    html_path = check_output_path(html, (".html",), "--html", "diff") if html is not None else None

    from maskcli.commands.progress import progress
    from maskcli.diff import compare
    from maskcli.render import diff as render

    with progress("comparing") as update:
        difference = compare(sides["A"], sides["B"], progress=update, advice=_advice(is_file, sides["A"].frame, sides["B"].frame))
    if html_path is not None:  # made before any file is written: a page it refuses leaves none behind
        from maskcli.render.html import diff_page

        page = diff_page(sides["A"], sides["B"])
    if png_path is not None:
        from maskcli.render.heatmaps import save_figure

        save_figure(render.diff_figure(difference), png_path)
        done(f"wrote {png_path}")
    if html_path is not None:
        from maskcli.render.html import save_page

        save_page(page, html_path)
        done(f"wrote {html_path}")
    if json_:
        echo(render.diff_json(difference))
    else:
        from maskcli.commands.show import wide_console

        console, map_width = wide_console()
        for view in render.views(difference, console, map_width=map_width):
            console.print(view)
    if not difference.equal:
        raise typer.Exit(1)
