"""`maskcli shard`: how a mask is split across context-parallel ranks, each rank's work, and whether the parts add up.

Exit status 0 when the ranks' parts add up to the global mask, 1 when a check finds they do not, 2 for bad input.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Annotated

import typer

from maskcli.commands.app import app, done, echo, make_console
from maskcli.commands.options import KIND_ARGUMENT_HELP, examples, integer, mask_options
from maskcli.errors import MaskError
from maskcli.mask import MaskOptions

LayoutOpt = Annotated[str, typer.Option("--layout", help="contiguous, headtail (PyTorch's _HeadTailLoadBalancer), per-document (TransformerEngine's THD split), striped or striped:W, ulysses (heads split, every rank sees every token), ptrr or ptrr:BLOCK (PyTorch's _PTRRLoadBalancer on the mask's blocks), or a FILE of indices: a permutation as a balancer returns it, or one list per rank (.json .npy .pt .txt). Default headtail.", show_default=False)]


@app.command(
    epilog=examples(
        "maskcli shard causal --len 4096 --ranks 8 --layout contiguous",
        "maskcli shard \"document(sizes=[3000,5000,192]) & window(512)\" --ranks 4 --layout per-document",
        "maskcli shard causal \"causal & window(1024)\" --len 65536 --ranks 8 --layout headtail --png shard.png",
        "maskcli shard causal --len 1048576 --ranks 64 --layout striped:128 --json",
    ),
)
@mask_options(many_masks=True, tokens=False)
def shard(
    expressions: Annotated[list[str] | None, typer.Argument(help=KIND_ARGUMENT_HELP + " Several: one mask per layer type, split the same way. A file: a packed BATCH, as pack reads it, its documents and-ed into each.", show_default=False, metavar="EXPR...")] = None,
    ranks: Annotated[int | None, typer.Option("--ranks", help="Context-parallel ranks N (default 2, or the ranks --trace holds).", parser=integer, show_default=False)] = None,
    layout: LayoutOpt = "headtail",
    docs: Annotated[str | None, typer.Option("--docs", help="Document sizes for --layout per-document, like 3000,5000 (default: the mask's document(...) labels).", show_default=False)] = None,
    model: Annotated[str | None, typer.Option("--model", help="Take one mask per layer type from a Hugging Face family's config (needs transformers): full is causal, sliding causal & window(W), chunked local(C); an EXPR is and-ed into each.", show_default=False)] = None,
    rank_mask: Annotated[list[str] | None, typer.Option("--rank-mask", help="A rank's captured mask (its slots x every slot in the gathered order), once per rank in rank order: each checked against the global mask under --layout.", show_default=False)] = None,
    trace: Annotated[str | None, typer.Option("--trace", help="A traced run of every rank (torchrun ... maskcli trace --save run.pt): each rank's part checked at its global positions under --layout, the work shown what ran.", show_default=False)] = None,
    head_dim: Annotated[int, typer.Option("--head-dim", help="Head size for the FLOPs (4 x head_dim x visible cells x heads).", parser=integer)] = 128,
    png: Annotated[str | None, typer.Option("--png", metavar="FILE", help="Write a figure (.png .svg .pdf): the strip, each rank's work, the ring steps.", show_default=False)] = None,
    html: Annotated[str | None, typer.Option("--html", metavar="FILE", help="Write a self-contained HTML page: the strip, tables, ring steps and findings.", show_default=False)] = None,
    json_: Annotated[bool, typer.Option("--json", help="Print the layout, each mask's per-rank cells, FLOPs, ratios, ring-step grid, cu_seqlens and findings as JSON.")] = False,
    *,
    mask: MaskOptions,
) -> None:
    """Split a mask across context-parallel ranks: each rank's tokens, visible cells, FLOPs and ratio to the mean, the imbalance, each ring step's block, and the local cu_seqlens, exactly at any length.

    Checks, exit status 1 when wrong: every real token on exactly one rank (nothing dropped by padding or truncation), and with --trace or --rank-mask each rank's captured part equal to the global mask on global positions (a part built on local indices, or replaced by is_causal, is named). Imbalance past 1.25 is reported, not an error.
    """
    from maskcli.files import FIGURE_SUFFIXES, check_output_path
    from maskcli.sources import registry
    from maskcli.shard.plan import analyse, parse_sizes

    png_path = check_output_path(png, FIGURE_SUFFIXES, "--png") if png is not None else None
    html_path = check_output_path(html, (".html",), "--html") if html is not None else None
    if trace is not None:
        from maskcli.shard.traced import length_of, ranks_of

        ranks = ranks_of(trace) if ranks is None else ranks
        if mask.length is None:  # the length the run split: its ranks' query rows added up
            mask = replace(mask, length=length_of(trace))
    masks = _masks(expressions or [], mask, model, registry.load)
    with_docs = parse_sizes(docs) if docs is not None else None
    report = analyse(masks, layout, 2 if ranks is None else ranks, head_dim, rank_mask, with_docs, trace)
    from maskcli.render import shard as render

    for line in report.notes:
        done(line)

    if png_path is not None:
        from maskcli.render.heatmaps import save_figure

        save_figure(render.figure(report), png_path)
        done(f"wrote {png_path}")
    if html_path is not None:
        from maskcli.render.html import save_page
        from maskcli.render.shardpage import shard_page

        save_page(shard_page(report), html_path)
        done(f"wrote {html_path}")
    if json_:
        echo(render.report_json(report))
    else:
        console = make_console(highlight=False)
        for view in render.views(report, console.width):
            console.print(view)
    if report.wrong:
        raise typer.Exit(1)


def _batch(expressions: list[str]):
    """The EXPRs, less the one that names a file: a packed BATCH (as pack reads it), its documents as a term
    (`document` bound to their sizes: and-ed into each mask as it is, never written to be parsed back)."""
    import os

    batches = [text for text in expressions if os.path.isfile(text)]
    if not batches:
        return expressions, None
    if len(batches) > 1:
        raise MaskError(f"give one BATCH file, not {len(batches)} ({', '.join(map(repr, batches))}): a layout splits one sequence")
    from maskcli.sources import packed, registry

    where = f"BATCH {batches[0]!r}"
    return [text for text in expressions if text != batches[0]], packed.sequence(registry.read("packed", batches[0]), where)


def _masks(expressions: list[str], options: MaskOptions, model: str | None, load) -> list[tuple[str, object]]:
    """(label, Mask) per layer type: the EXPRs, the --mask files, or --model's layer types (and-ed with one EXPR); a
    BATCH's documents are and-ed into each. The documents and the layer types are terms, placed with the EXPR's
    (`load`'s before and after); only what the user typed is parsed."""
    files = list(options.mask_file or [])
    one = replace(options, mask_file=None)
    expressions, documents = _batch(expressions)
    if documents is not None and files:
        raise MaskError("a BATCH gives the documents of the EXPRs or --model's layer types: give no --mask with it")
    if documents is not None and model is None:
        from maskcli.terms import text as named

        return [(text, load(text, one, before=documents)) for text in expressions] or [(named(documents), load(None, one, before=documents))]
    if model is not None:
        from maskcli.hf import require

        try:
            require()
        except MaskError:
            raise MaskError('--model reads a family\'s config with transformers, which is not installed: pip install "maskcli[hf]"') from None
        from maskcli.hf.layers import bound, layer_masks

        if files or len(expressions) > 1:
            raise MaskError("--model gives one mask per layer type: add at most one EXPR (and-ed into each, like a document(...) mask), and no --mask")
        found, _, skipped = layer_masks(model, missing="error")
        if not found:
            raise MaskError(f"{model}: none of its layer types ({', '.join(skipped)}) holds an attention mask to shard")
        extra = expressions[0] if expressions else None
        return [(kind, load(extra, one, before=documents, after=bound(mask))) for kind, mask in found.items()]
    if not expressions and not files:
        raise MaskError("give a mask: an expression like \"causal & window(4096)\", --mask FILE, or --model FAMILY")
    masks = [(text, load(text, one)) for text in expressions]
    masks += [(path, load(None, replace(options, mask_file=path))) for path in files]
    return masks
