"""The Typer app: thin commands that parse, call the core and render.

Only this module turns a MaskError (or a usage error) into one line on stderr and
exit status 2. torch and matplotlib are imported inside the commands that need
them, so `maskcli --help` loads neither.
"""

from __future__ import annotations

import math
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
from maskcli.options import (
    KIND_LIST, As, Batch, BatchIndex, Chunks, ComputeDtype, Device, Diagonal, DOut, Dropout, Dtype, FigurePng,
    Fill, Head, HeadDim, Heads, Ids, Json, KFile, Len, Lengths, Means, Offset, PadId, Png, Precision, Prefix,
    QFile, QkvBias, Repeat, Save, Scale, Seed, StagesJson, StagesOpt, Strict, Tokens, VerifyJson, VFile, Window, XFile,
    Atol, examples,
)
from maskcli.spec import CONVENTIONS, DTYPES, FILLS, KINDS, STAGES, check_choice, make_spec, parse_stages


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


def fail(message: str) -> None:
    one_line = " ".join(message.splitlines())  # a quoted value (a repr, say) may hold line breaks
    typer.echo(f"maskcli: error: {one_line}", err=True)
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
    epilog=examples(
        "maskcli show causal --len 6",
        "maskcli show padding --lengths 4,2",
        "maskcli show prefill --offset 3 --len 2 --as additive",
        "maskcli show window --len 8 --window 3 --png window.png",
    ),
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
    dtype: Dtype = None,
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


show.__doc__ = (show.__doc__ or "") + KIND_LIST


@app.command(
    context_settings={"ignore_unknown_options": True},  # so labels may start with a minus: chunk -1,0,1
    epilog=examples(
        "maskcli chunk 0,0,1,1,1,1,2,2,2,3,4,4  # the tutorial's chunk mask",
        "maskcli chunk 0,0,1,1 --lengths 4,3 --png chunk.png",
    ),
)
def chunk(
    labels: Annotated[str, typer.Argument(help="Comma-separated chunk label per token, like 0,0,1,1,2.", show_default=False)],
    lengths: Lengths = None,
    ids: Ids = None,
    pad_id: PadId = 0,
    heads: Heads = 1,
    tokens: Tokens = None,
    as_: As = "keep",
    dtype: Dtype = None,
    png: Png = None,
    json_: Json = False,
    save: Save = None,
) -> None:
    """Show the chunk mask of per-token labels: a token sees its own chunk and every earlier one (label\\[kv] <= label\\[q])."""
    spec = make_spec("chunk", chunks=labels, lengths=lengths, ids=ids, pad_id=pad_id, heads=heads, tokens=tokens)
    _present(spec, as_, dtype, png, json_, save)


def _present(spec, convention: str, dtype_name: str | None, png: str | None, json_out: bool, save: str | None) -> None:
    """Check the outputs, build the mask once, then print and write what was asked for."""
    from maskcli.files import FIGURE_SUFFIXES, TENSOR_SUFFIXES, check_output_path

    check_choice(convention, CONVENTIONS, "--as convention")
    given_dtype = dtype_name is not None
    dtype_name = check_choice(dtype_name or "float32", DTYPES, "--dtype")
    if given_dtype and convention not in ("additive", "min"):
        warn(f"--dtype {dtype_name} is ignored: it is for --as additive and --as min, and --as {convention} has a dtype of its own")
    png_path = check_output_path(png, FIGURE_SUFFIXES, "--png") if png is not None else None
    save_path = check_output_path(save, TENSOR_SUFFIXES, "--save") if save is not None else None
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


@app.command(
    epilog=examples(
        "maskcli attend causal --len 4",
        "maskcli attend chunk --chunks 0,0,1,1 --fill multiply",
        "maskcli attend padding --lengths 3,0 --fill min --png stages.png",
        "maskcli attend causal --seed 789 --d-out 2 --stages weights --x "
        "\"[[0.43,0.15,0.89],[0.55,0.87,0.66],[0.57,0.85,0.64],[0.22,0.58,0.33],[0.77,0.25,0.10],[0.05,0.80,0.55]]\"",
    ),
)
def attend(
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
    q: QFile = None,
    k: KFile = None,
    v: VFile = None,
    x: XFile = None,
    seed: Seed = 0,
    batch: Batch = None,
    head_dim: HeadDim = None,
    d_out: DOut = None,
    qkv_bias: QkvBias = False,
    device: Device = "auto",
    dtype: ComputeDtype = "float32",
    scale: Scale = None,
    fill: Fill = "-inf",
    dropout: Dropout = 0.0,
    stages: StagesOpt = "scores,masked,weights,output",
    batch_index: BatchIndex = None,
    head: Head = None,
    precision: Precision = 4,
    tokens: Tokens = None,
    png: FigurePng = None,
    json_: StagesJson = False,
) -> None:
    """Run scaled dot-product attention through a mask and show every stage.

    scores = Q Kᵀ, scaled = scores / sqrt(D), masked (see --fill), weights = softmax(masked), output = weights V. Under the tables, findings in plain words: rows that see no key (NaN or uniform weights), rows whose weights do not sum to 1, queries that see later keys, a fill value the dtype cannot hold.
    """
    from maskcli.files import FIGURE_SUFFIXES, check_output_path

    check_choice(fill, FILLS, "--fill")
    names = list(parse_stages(stages))
    png_path = check_output_path(png, FIGURE_SUFFIXES, "--png") if png is not None else None
    if not 0 <= dropout < 1:
        raise MaskError(f"--dropout must be at least 0 and below 1, got {dropout}")
    if not 0 <= precision <= 12:
        raise MaskError(f"--precision must be 0 to 12 decimals, got {precision}")
    if scale is not None and not 0 < scale < math.inf:
        raise MaskError(f"--scale must be a positive finite number, got {scale}")
    mask_options = dict(
        diagonal=diagonal, means=means, lengths=lengths, ids=ids, pad_id=pad_id, offset=offset, chunks=chunks,
        window=window, prefix=prefix, heads=heads, tokens=tokens,
    )
    spec, qkv, torch_device, torch_dtype = _mask_and_inputs(
        kind, length, mask_options, q=q, k=k, v=v, x=x, seed=seed, batch=batch, heads=heads, head_dim=head_dim,
        d_out=d_out, qkv_bias=qkv_bias, device=device, dtype=dtype, default_head_dim=8,
    )
    from maskcli.run import run_attention

    run = run_attention(spec, qkv, torch_device, torch_dtype, scale=scale, fill=fill, dropout=dropout, seed=seed)

    from maskcli import report

    shape = run.stages.keep.shape
    chosen = batch_index is not None or head is not None
    for flag, index, size, what in (("--batch-index", batch_index, shape[0], "batch rows"), ("--head", head, shape[1], "heads")):
        if index is not None and not 0 <= index < size:
            raise MaskError(f"{flag} {index} is outside this run's {what} 0-{size - 1} ({what[0].upper()}={size}): pick one of them")
    if png_path is not None:
        from maskcli.render.heatmaps import save_figure

        pairs = report.selection(shape, batch_index, head, limit=FIGURE_ROWS)
        save_figure(report.stages_figure(run.mask, run.stages, names, pairs, run.device), png_path)
        note = report.selection_note(shape, pairs, "the figure's rows", chosen)
        warn_done(f"wrote {png_path}" + (f" ({note})" if note else ""))
    if json_:
        typer.echo(report.stages_json(run.mask, run.stages, run.device, run.findings, list(STAGES)))
        return
    from rich.console import Console

    console = Console()
    console.print(report.run_header(run.mask, run.stages, run.device, run.source), style="bold", highlight=False)
    pairs = report.selection(shape, batch_index, head)
    note = report.selection_note(shape, pairs, "the tables", chosen)
    if note:
        console.print(note, style="dim", highlight=False)
    for view in report.stage_tables(run.mask, run.stages, names, pairs, precision, width=console.width):
        console.print(view)
    console.print(report.findings_text(run.findings))


FIGURE_ROWS = 8  # (batch, head) rows in an attend figure unless --batch-index / --head choose


def _check_input_options(q, k, v, x, seed, batch, head_dim, d_out, qkv_bias) -> None:
    """Refuse a seed torch cannot take, and input options that the inputs in use would silently ignore."""
    if not 0 <= seed < 2**63:
        raise MaskError(f"--seed must be 0 to {2**63 - 1} (a 64-bit seed), got {seed}")
    given_qkv = any(t is not None for t in (q, k, v))
    source = "--q/--k/--v" if given_qkv else "--x" if x is not None else None
    if source and batch is not None:
        raise MaskError(f"--batch {batch} is for random inputs, and {source} set the batch size: drop --batch")
    if source and head_dim is not None:
        how = "--q/--k/--v set it" if given_qkv else "with --x it is --d-out / --heads"
        raise MaskError(f"--head-dim {head_dim} is for random inputs, and {how}: drop --head-dim")
    if (d_out is not None or qkv_bias) and (given_qkv or x is None):
        flag = f"--d-out {d_out}" if d_out is not None else "--qkv-bias"
        raise MaskError(f"{flag} is for the projections of --x embeddings, and there is no --x in use: drop {flag.split()[0]}")
    if given_qkv and x is not None:
        warn("--x is ignored: --q/--k/--v take precedence")


def _mask_and_inputs(kind, length, mask_options, *, q, k, v, x, seed, batch, heads, head_dim, d_out, qkv_bias, device, dtype, default_head_dim):
    """The MaskSpec and Q/K/V for attend and verify: given inputs decide the length unless --len does."""
    _check_input_options(q, k, v, x, seed, batch, head_dim, d_out, qkv_bias)
    if all(t is None for t in (q, k, v, x)):
        make_spec(kind, length=length, **mask_options)  # refuse bad mask options before importing torch

    from maskcli.inputs import check_fits, load_given, make_qkv, resolve_device, resolve_dtype

    torch_device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype)
    given = load_given(q, k, v, x)
    if given is not None and length is None and kind not in ("chunk", "document"):
        length = given.query_length(mask_options.get("offset") or 0)  # the inputs say how long the sequence is
    spec = make_spec(kind, length=length, **mask_options)
    for message in spec.warnings:
        warn(message)
    if spec.padded and batch is not None and batch != spec.batch:
        raise MaskError(f"--batch {batch} does not match the {spec.batch} batch rows of --lengths/--ids: drop --batch")
    qkv = make_qkv(
        given, seed=seed, batch=spec.batch if spec.padded else 1 if batch is None else batch, heads=heads,
        head_dim=default_head_dim if head_dim is None else head_dim, d_out=d_out, qkv_bias=qkv_bias,
        q_len=spec.q_len, k_len=spec.k_len,
    )
    if given is not None:
        source = "--x (projected)" if given.x is not None else None
        for flag, tensor in (("--q", qkv.q), ("--k", qkv.k), ("--v", qkv.v)):
            check_fits(tensor, torch_dtype, source or flag)
    return spec, qkv, torch_device, torch_dtype


@app.command(
    epilog=examples(
        "maskcli verify causal --len 16",
        "maskcli verify padding --lengths 5,0 --device cuda --dtype float16",
        "maskcli verify prefill --offset 4 --len 2 --strict --json",
    ),
)
def verify(
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
    heads: Heads = 2,
    q: QFile = None,
    k: KFile = None,
    v: VFile = None,
    x: XFile = None,
    seed: Seed = 0,
    batch: Batch = None,
    head_dim: HeadDim = None,
    d_out: DOut = None,
    qkv_bias: QkvBias = False,
    device: Device = "auto",
    dtype: ComputeDtype = "float32",
    scale: Scale = None,
    atol: Atol = None,
    repeat: Repeat = 5,
    strict: Strict = False,
    json_: VerifyJson = False,
) -> None:
    """Run one mask and one Q/K/V through every PyTorch attention kernel and compare them.

    Backends: maskcli's staged computation; F.scaled_dot_product_attention under each backend (math, flash, efficient, cudnn; one that refuses says why); nn.MultiheadAttention (block-convention attn_mask and key_padding_mask, identity projections); flex_attention with the mask's own predicate. Each is compared with a float64 reference on rows that see a key; for fully masked rows the table says what each backend returned (zero, NaN, the unmasked row, the mean of V, other).
    """
    if scale is not None and not 0 < scale < math.inf:
        raise MaskError(f"--scale must be a positive finite number, got {scale}")
    if atol is not None and not atol >= 0:
        raise MaskError(f"--atol must be 0 or more, got {atol}")
    if not 1 <= repeat <= 1000:
        raise MaskError(f"--repeat must be 1 to 1000, got {repeat}")
    mask_options = dict(
        diagonal=diagonal, means=means, lengths=lengths, ids=ids, pad_id=pad_id, offset=offset, chunks=chunks,
        window=window, prefix=prefix, heads=heads, tokens=None,
    )
    spec, qkv, torch_device, torch_dtype = _mask_and_inputs(
        kind, length, mask_options, q=q, k=k, v=v, x=x, seed=seed, batch=batch, heads=heads, head_dim=head_dim,
        d_out=d_out, qkv_bias=qkv_bias, device=device, dtype=dtype, default_head_dim=16,
    )
    from maskcli import verify as verify_core
    from maskcli.inputs import check_against_mask
    from maskcli.masks import build

    qkv = check_against_mask(qkv, spec.shape)
    tensors = [t.to(device=torch_device, dtype=torch_dtype).contiguous() for t in (qkv.q, qkv.k, qkv.v)]
    tolerance = verify_core.DEFAULT_ATOL[torch_dtype] if atol is None else atol
    mask = build(spec, torch_device)
    results = verify_core.verify(mask, spec, *tensors, scale=scale, atol=tolerance, repeat=repeat)
    dtype_name = str(torch_dtype).removeprefix("torch.")
    if json_:
        typer.echo(verify_core.results_json(results, spec, tensors[0], tolerance))
    else:
        from rich.console import Console

        from maskcli.checks import mask_findings
        from maskcli.render.backends import backends_table

        empty = [f.message for f in mask_findings(mask.materialize(), spec.kind, spec.offset) if f.code == "fully-masked"]
        title = (
            f"verify {spec.describe()} · shape (B={tensors[0].shape[0]}, H={tensors[0].shape[1]}, Lq={spec.q_len}, "
            f"Lk={spec.k_len}, D={tensors[0].shape[-1]}) · {torch_device} {dtype_name} · inputs: {qkv.source}\n"
            + ("\n".join(empty) if empty else "every query row sees at least one key")
        )
        Console().print(backends_table(results, tolerance, title))
    if strict and not all(r.agrees(tolerance) for r in results):
        raise typer.Exit(1)


def warn_done(message: str) -> None:
    typer.echo(message, err=True)


def main() -> None:
    app()


from maskcli import inspect_cli  # noqa: E402,F401  (registers inspect and convert on app)
