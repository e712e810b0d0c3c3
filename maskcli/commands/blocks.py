"""`maskcli blocks`: FlexAttention's block view of a mask (full, partial, empty), at any length."""

from __future__ import annotations

import re
import sys
from typing import Annotated

import typer

from maskcli.commands.app import app, check_write, done, echo, make_console
from maskcli.commands.options import Expr, Html, examples, mask_options
from maskcli.errors import MaskError
from maskcli.mask import MaskOptions
from maskcli.render import wrapped

BlockOpt = Annotated[str, typer.Option("--block", help="Block size: 128 (FlexAttention's BLOCK_SIZE), or Q,KV for unequal query and key blocks like 128,64.")]
BlocksPng = Annotated[str | None, typer.Option("--png", metavar="FILE", help="Write a figure of full, partial and empty blocks: .png, .svg or .pdf (a directory: named after the mask).")]
BlocksJson = Annotated[bool, typer.Option("--json", help="Print counts, sparsity and kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices exactly as create_block_mask makes them.")]
BlocksSave = Annotated[str | None, typer.Option("--save", metavar="FILE", help="Save the BlockMask's tensors (kv and q sides), BLOCK_SIZE and seq_lengths to a .pt file: BlockMask(**torch.load(FILE, weights_only=True), mask_mod=MASK_MOD) rebuilds it in seconds, even at 1M tokens (flex_attention calls mask_mod on partial blocks).")]


def parse_block(text: str) -> tuple[int, int]:
    parts = text.split(",")
    try:
        if not all(re.fullmatch(r"\s*[+-]?[0-9]+\s*", part) for part in parts):  # int() takes '1_28' and '١٢٨' as 128
            raise ValueError(text)
        sizes = [int(part) for part in parts]
    except ValueError:
        raise MaskError(f"--block {text!r} is not a block size: give one whole number like 128, or Q,KV like 128,64") from None
    if len(sizes) not in (1, 2) or any(size < 1 for size in sizes):
        raise MaskError(f"--block {text!r}: give one size of at least 1 like 128, or two like 128,64")
    if any(size > 2**40 for size in sizes):
        raise MaskError(f"--block {text!r} is too large: a block holds at most {2**40:,} positions")
    return (sizes[0], sizes[-1])


@app.command(
    epilog=examples(
        "maskcli blocks causal --len 1024",
        "maskcli blocks \"document(sizes=[300,500,224]) & window(128)\" --block 64",
        "maskcli blocks \"window(4096)\" --len 1048576 --save blocks.pt",
        "maskcli blocks \"causal | blocks(-1,-1,0,0,0,-1)\" --block 2 --json",
    ),
)
@mask_options(regions=True)
def blocks(
    kind: Expr = None,
    block: BlockOpt = "128",
    png: BlocksPng = None,
    json_: BlocksJson = False,
    save: BlocksSave = None,
    summary: Annotated[bool, typer.Option("--summary", help="Print counts, sparsity and blocks per query-block row instead of the map (with --json: as JSON, without the index tensors), at any length.")] = False,
    html: Html = None,
    *,
    mask: MaskOptions,
) -> None:
    """Show which FlexAttention blocks of a mask are full, partial or empty, exactly, at any length.

    The blocks are what create_block_mask makes (the sequence padded to whole blocks, so a block cut short by the end is never full), counted from the mask's key intervals without building its cells: a 1M-token mask takes seconds. --save writes every BlockMask tensor, so that BlockMask(**torch.load(FILE, weights_only=True), mask_mod=MASK_MOD) rebuilds it without transposing.
    """
    from maskcli.files import FIGURE_SUFFIXES, check_output_path

    q_block, kv_block = parse_block(block)
    for flag, value in (("--png", png), ("--save", save), ("--html", html)):
        if value is not None and not value.strip():
            raise MaskError(f"{flag} is empty: give a file name")
    from maskcli.sources import registry

    built = registry.load(kind, mask)
    html_path = check_output_path(html, (".html",), "--html", "blocks_" + built.slug) if html is not None else None
    png_path = check_output_path(png, FIGURE_SUFFIXES, "--png", "blocks_" + built.slug) if png is not None else None
    save_path = check_output_path(save, (".pt",), "--save", "blocks_" + built.slug) if save is not None else None
    from maskcli.blockmask import layout
    from maskcli.commands.progress import progress
    from maskcli.render import blocks as render
    from maskcli.render import check_json_size

    f = built.frame
    n_q, n_kv = -(-f.q_len // q_block), -(-f.k_len // kv_block)
    if json_ and not summary:
        check_json_size(built.batch * built.heads * n_q * n_kv, "block indices", "add --summary for the counts alone, save them with --save blocks.pt, or use a larger --block")
    if save_path is not None:  # the four int32 tensors at the mask's B and H, refused before any block is counted
        from maskcli.memory import check_bytes_fit

        save_bytes = 4 * 4 * built.batch * built.heads * n_q * (1 + n_kv)  # kv and q sides, partial and full, int32
        check_bytes_fit(save_bytes, f"--save {str(save_path)!r} ({built.batch} x {built.heads} x {n_q} x {n_kv} block indices)", "to write", fix="use a larger --block, or fewer --heads")
        check_write(save_path, save_bytes, "--save")  # after every refusal: it may announce a long write
    if html_path is not None:  # made before any file is written: a page it refuses leaves none behind
        from maskcli.render.html import blocks_page

        page = blocks_page(built, q_block, kv_block)
    with progress("counting blocks") as update:
        # (--summary alone reads the counts: no (n_q, n_kv) indices made for a mask with intervals)
        found = layout(built, q_block, kv_block, update, indices=not summary or save_path is not None or png_path is not None)
    if save_path is not None:
        _save(found, save_path)
        done(f"wrote {save_path} (BlockMask(**torch.load({str(save_path)!r}, weights_only=True), mask_mod=MASK_MOD): "
             "the mask_mod flex_attention calls on partial blocks)")
    if png_path is not None:
        from maskcli.render.heatmaps import save_figure

        save_figure(render.blocks_figure(found), png_path)
        done(f"wrote {png_path}")
    if html_path is not None:
        from maskcli.render.html import save_page

        save_page(page, html_path)
        done(f"wrote {html_path}")
    if summary:
        echo(render.summary_json(found) if json_ else wrapped(render.summary_text(found), sys.stdout).rstrip("\n"))  # between words
        return
    if json_:
        echo(render.blocks_json(found))
        return
    console = make_console(highlight=False)
    lines = max(8, console.height - 8) if console.is_terminal else 48
    for view in render.views(found, console.width, lines):
        console.print(view)


def _save(found, path) -> None:
    """Every BlockMask tensor (int32, at the mask's B and H) with BLOCK_SIZE and seq_lengths, written whole."""
    import torch

    from maskcli.files import atomic_write

    arrays = found.block_mask_arrays()
    data = {name: torch.from_numpy(value.copy()) for name, value in arrays.items()}  # a copy: the arrays may be read-only views
    data["BLOCK_SIZE"] = (found.q_block, found.kv_block)
    data["seq_lengths"] = (found.mask.frame.q_len, found.mask.frame.k_len)
    atomic_write(path, lambda temp: torch.save(data, temp))
