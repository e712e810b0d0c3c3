"""`maskcli attend`: run scaled dot-product attention through a mask and show every stage."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from maskcli.attention import FILLS, LIKES, STAGES
from maskcli.commands.app import app, done, echo, make_console
from maskcli.commands.inputs import InputOptions, mask_and_inputs
from maskcli.commands.options import (
    Expr, BatchIndex, Dropout, DropoutSeed, FigurePng, Fill, Head, Html, Like, Precision, StagesJson, StagesOpt, examples,
    input_options, mask_options,
)
from maskcli.commands.show import check_choice
from maskcli.errors import MaskError
from maskcli.mask import MaskOptions

FIGURE_ROWS = 8  # (batch, head) rows in an attend figure unless --batch-index / --head choose


def parse_stages(text: str) -> tuple[str, ...]:
    """`scores,masked,weights` -> names, each one of STAGES, in the order given."""
    names = tuple(dict.fromkeys(name.strip() for name in text.split(",") if name.strip()))  # each once, in order
    if not names:
        raise MaskError(f"--stages {text!r} names no stage: choose from {', '.join(STAGES)}")
    for name in names:
        check_choice(name, STAGES, "stage in --stages")
    return names


@app.command(
    short_help="Run scaled dot-product attention through a mask and show every stage.",  # the stages: in --help
    epilog=examples(
        "maskcli attend causal --len 4",
        "maskcli attend \"document(0,0,1,1) & window(2)\" --fill multiply",
        "maskcli attend padding --lengths 3,0 --fill min --png stages.png",
        "maskcli attend padding --lengths 3,0 --like sdpa --stages weights",
        "maskcli attend causal --like tutorial --seed 789 --d-out 2 --stages unmasked,weights --x "
        "\"[[0.43,0.15,0.89], [0.55,0.87,0.66], [0.57,0.85,0.64], [0.22,0.58,0.33], [0.77,0.25,0.10], [0.05,0.80,0.55]]\"",
        "maskcli attend causal --like tutorial --seed 789 --d-out 2 --stages weights --dropout 0.5 --dropout-seed 123 --x "
        "\"[[0.43,0.15,0.89], [0.55,0.87,0.66], [0.57,0.85,0.64], [0.22,0.58,0.33], [0.77,0.25,0.10], [0.05,0.80,0.55]]\"",
    ),
)
@mask_options(regions=True)
@input_options(head_dim=8)
def attend(
    kind: Expr = None,
    like: Like = None,
    fill: Fill = None,
    dropout: Dropout = 0.0,
    dropout_seed: DropoutSeed = None,
    stages: StagesOpt = "scores,masked,weights,output",
    batch_index: BatchIndex = None,
    head: Head = None,
    precision: Precision = 4,
    png: FigurePng = None,
    json_: StagesJson = False,
    html: Html = None,
    *,
    mask: MaskOptions,
    inputs: InputOptions,
) -> None:
    """Run scaled dot-product attention through a mask and show every stage: scores = Q Kᵀ, scaled, masked (--like,
    --fill), weights = softmax(masked), output = weights V; then findings."""
    from maskcli.files import FIGURE_SUFFIXES, check_output_path

    if like is not None and fill is not None:
        raise MaskError(f"--like {like} sets how masked scores are hidden; --fill {fill} does too: give one of them")
    if like is not None:
        check_choice(like, LIKES, "--like")
    fill = "-inf" if fill is None else fill  # an empty --fill is refused, not taken as the default
    check_choice(fill, FILLS, "--fill")
    if like == "mha" and dropout > 0:
        raise MaskError("--like mha drops weights inside SDPA, where they cannot be shown: use --like mha-weights with --dropout")
    if dropout_seed is not None and not 0 <= dropout_seed < 2**63:
        raise MaskError(f"--dropout-seed must be 0 to {2**63 - 1} (a 64-bit seed), got {dropout_seed}")
    names = list(parse_stages(stages))
    for flag, value in (("--png", png), ("--html", html)):
        if value is not None and not value.strip():
            raise MaskError(f"{flag} is empty: give a file name")
    if not 0 <= dropout < 1:
        raise MaskError(f"--dropout must be at least 0 and below 1, got {dropout}")
    if not 0 <= precision <= 12:
        raise MaskError(f"--precision must be 0 to 12 decimals, got {precision}")
    if png is not None and not Path(png).is_dir():  # its suffix and folder, before torch is imported
        check_output_path(png, FIGURE_SUFFIXES, "--png")
    if html is not None and not Path(html).is_dir():
        check_output_path(html, (".html",), "--html")
    from dataclasses import replace

    from maskcli.mask import parse_region

    rows, keys = parse_region(mask.rows, "--rows"), parse_region(mask.keys, "--keys")
    built, qkv, torch_device, torch_dtype = mask_and_inputs(kind, replace(mask, rows=None, keys=None), inputs, dropout)
    png_path = check_output_path(png, FIGURE_SUFFIXES, "--png", "attend_" + built.slug) if png is not None else None
    html_path = check_output_path(html, (".html",), "--html", "attend_" + built.slug) if html is not None else None
    if json_:  # every stage (each cell, and the mask's) and the output: refused before any is computed
        from maskcli.render import check_json_size

        view = built.crop(rows, keys).frame
        pairs = max(qkv.q.shape[0], built.batch) * max(qkv.q.shape[1], built.heads)
        check_json_size(pairs * view.q_len * (view.k_len * len(STAGES) + qkv.v.shape[-1]), "stage values",
                        "view a region with --rows/--keys, or use a shorter --len or fewer --heads")
    from maskcli.attention.run import run_attention

    whole = built
    if rows != (None, None) and dropout == 0:  # only the rows asked for (dropout draws for every row, so not then)
        built = built.crop(rows)
        start = built.frame.q_start - whole.frame.q_start
        qkv = replace(qkv, q=qkv.q[:, :, start : start + built.frame.q_len])
    run = run_attention(
        built, qkv, torch_device, torch_dtype, scale=inputs.scale, fill=fill, dropout=dropout,
        seed=inputs.seed if dropout_seed is None else dropout_seed, like=like, unmasked="unmasked" in names or json_,
    )
    if (rows, keys) != ((None, None), (None, None)):
        run = _region(run, rows if built is whole else (None, None), keys)

    from maskcli.render import stages as report

    shape = run.stages.keep.shape
    chosen = batch_index is not None or head is not None
    for flag, index, size, what in (("--batch-index", batch_index, shape[0], "batch rows"), ("--head", head, shape[1], "heads")):
        if index is not None and not 0 <= index < size:
            raise MaskError(f"{flag} {index} is outside this run's {what} 0-{size - 1} ({what[0].upper()}={size}): pick one of them")
    if html_path is not None:  # made before any file is written: a page it refuses leaves none behind
        from maskcli.render.html import attend_page

        page_pairs = report.selection(shape, batch_index, head, limit=FIGURE_ROWS)
        page = attend_page(run, names, page_pairs)
    if png_path is not None:
        from maskcli.render.heatmaps import save_figure

        pairs = report.selection(shape, batch_index, head, limit=FIGURE_ROWS)
        save_figure(report.stages_figure(run.mask, run.stages, names, pairs, run.device), png_path)
        note = report.selection_note(shape, pairs, "the figure's rows", chosen)
        done(f"wrote {png_path}" + (f" ({note})" if note else ""))
    if html_path is not None:
        from maskcli.render.html import save_page

        save_page(page, html_path)
        note = report.selection_note(shape, page_pairs, "the page", chosen)
        done(f"wrote {html_path}" + (f" ({note})" if note else ""))
    if json_:
        echo(report.stages_json(run.mask, run.stages, run.device, run.findings, list(STAGES)))
        return

    console = make_console()
    from rich.text import Text

    from maskcli.render.breaking import Dotted

    # wrapped between its ' · ' parts, two cells in ('fill:' / 'masked_fill -inf' at column 0 read as a line of its own)
    console.print(Dotted(Text(report.run_header(run.mask, run.stages, run.device, run.source), style="bold")))
    pairs = report.selection(shape, batch_index, head)
    note = report.selection_note(shape, pairs, "the tables", chosen)
    if note:
        console.print(note, style="dim", highlight=False)
    for view in report.stage_tables(run.mask, run.stages, names, pairs, precision, width=console.width):
        console.print(view)
    from maskcli.render.tables import findings_text

    console.print(findings_text(run.findings))


def _region(run, rows, keys):
    """The run viewed over --rows and --keys: every stage's cells there (the weights stay those of every key)."""
    from dataclasses import replace

    f = run.mask.frame
    view = run.mask.crop(rows, keys)
    q = slice(view.frame.q_start - f.q_start, view.frame.q_end - f.q_start)
    k = slice(view.frame.k_start - f.k_start, view.frame.k_end - f.k_start)
    s = run.stages
    cells = {name: getattr(s, name)[:, :, q, k] for name in ("scores", "scaled", "masked", "weights", "keep")}
    unmasked = None if s.unmasked is None else s.unmasked[:, :, q, k]
    return replace(run, mask=view, stages=replace(s, **cells, output=s.output[:, :, q], unmasked=unmasked))
