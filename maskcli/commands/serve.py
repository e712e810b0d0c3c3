"""`maskcli serve FILE`: the masks a serving engine's batch metadata implies, its page map, and what is wrong with it.

Exit status 0 when nothing is wrong, 1 on a finding of severity wrong, 2 for bad input.
"""

from __future__ import annotations

from typing import Annotated

import typer

from maskcli.commands.app import app, done, echo
from maskcli.commands.options import examples


@app.command(
    epilog=examples(
        'maskcli serve \'{"cu_seqlens_q":[0,1],"seqused_k":[9],"causal":1}\' --json',
        'maskcli export "tree(-1,0,0,1)" --offset 4 --for flashinfer --save tree.pt',
        "maskcli serve tree.pt --png serve.png --html serve.html",
        'maskcli serve tree.pt --expect "*=tree(-1,0,0,1)"',
        "maskcli serve tree.pt --model llama",
    ),
)
def serve(
    files: Annotated[list[str], typer.Argument(
        help="One batch's attention metadata (several: steps in order, chunked prefill or prefix hits, each request matched across them by request_ids, else by the pages it wrote, else by index) (or the same as inline JSON): a .pt (loaded with weights_only=True), .safetensors, .npz or .json file of named "
             "tensors under one engine's names: vLLM's CommonAttentionMetadata (query_start_loc, seq_lens, num_computed_tokens, "
             "block_table_tensor, slot_mapping, block_size), SGLang's ForwardBatch (extend_prefix_lens, extend_seq_lens, seq_lens, "
             "req_to_token, out_cache_loc), flash-attn's (cu_seqlens_q, seqused_k, block_table, cache_leftpad, window_size), "
             "FlashInfer's plan() (qo_indptr, kv_indptr, kv_indices, kv_last_page_len, window_left, custom_mask) or "
             "TensorRT-LLM's (seq_lens, num_cached_tokens_per_seq, kv_cache_block_offsets, spec_decoding_packed_mask), and "
             "medusa_choices, eagle_choices or tree_choices: the static tree each draft mask must be; or a FlashInfer "
             "API-logging folder of a plan() call (FLASHINFER_LOGLEVEL=10).",
        show_default=False, metavar="FILE...")],
    png: Annotated[str | None, typer.Option("--png", metavar="FILE", help="Write a figure of each request's mask and its pages (shared, null, written): .png, .svg or .pdf.", show_default=False)] = None,
    html: Annotated[str | None, typer.Option("--html", metavar="FILE", help="Write a self-contained HTML page: per request its positions, its mask (zoom to any cell, hover for --why), its pages (shared, null, written) and the findings.", show_default=False)] = None,
    json_: Annotated[bool, typer.Option("--json", help="Print the report as one JSON object: every request's positions, mask, pages, and the findings.")] = False,
    model: Annotated[str | None, typer.Option("--model", help="A model family (as maskcli model --list names them) or a local config.json: the batch's window or chunk must be one its layer types have (sliding_window, attention_chunk_size as transformers reads them), an off-by-one named as such. Needs transformers.", show_default=False)] = None,
    expect: Annotated[list[str] | None, typer.Option("--expect", help="PATTERN=EXPR, repeatable: every request whose index (or request_id) matches PATTERN (as a shell matches: * is every request) must be EXPR at its positions; exit status 1 naming the request and its first wrong cell where not.", show_default=False)] = None,
) -> None:
    """Show the masks a serving engine's batch metadata implies, per request, and its page map; check lengths, pages, writes, cascade and draft trees.

    Engines keep no mask tensor: a request's queries are its new tokens, at positions seq_len - new .. seq_len - 1 (the kernels align the last query with the last key), its keys are positions 0 .. seq_len - 1 read through its page table, and its mask is a maskcli expression: causal, window(W), local(C), prefix(P) for a cascade's shared prefix, tree(parents) for a draft tree. Findings (exit status 1): seq_len not computed + new, offsets that count more than the new tokens, requests with queries and no keys, tables too short, a last page's fill out of 1..page_size, a null page where keys are read, a page shared between requests that is partly filled or written this step, new tokens written off their own page, a cascade that is not plain attention, tree nodes that see more or less than their ancestors or sit off prefix + depth.
    """
    from maskcli.errors import MaskError
    from maskcli.files import FIGURE_SUFFIXES, check_output_path, is_inline

    from maskcli.trace.expect import parse as parse_expect

    expectations = parse_expect(expect or [], "*=window(8)", "a request's index or request_id", padding=False)
    layers = None
    if model is not None:
        from maskcli.hf import require

        require("serve --model")
        from maskcli.hf.layers import layer_masks

        layers = layer_masks(model, missing="full")[0]
    png_path = check_output_path(png, FIGURE_SUFFIXES, "--png") if png is not None else None
    html_path = check_output_path(html, (".html",), "--html") if html is not None else None
    for flag, path in (("--png", png_path), ("--html", html_path)):
        if path is not None and len(files) > 1:
            raise MaskError(f"{flag} draws one step, and {len(files)} FILEs were given: give one FILE with {flag}")
    from maskcli.checks import registry
    from maskcli.checks.pagemap import page_map
    from maskcli.checks.servecheck import check
    from maskcli.render import serve as render
    from maskcli.serve.engines import by_name
    from maskcli.sources import registry as sources

    batches = [sources.read("engine", file) for file in files]
    across = registry.run("request-steps", batches) if len(batches) > 1 else []
    reports, wrong = [], bool(across)
    console = None
    if not json_:
        from maskcli.commands.app import make_console

        console = make_console()
    for file, batch in zip(files, batches):
        title = by_name(batch.engine).TITLE
        source = "inline JSON" if is_inline(file) else file
        findings = check(batch) + registry.run("expectations", batch, expectations)
        if layers is not None:
            findings += registry.run("layer-masks", batch, layers, model)
        wrong |= bool(registry.wrong(findings))
        # the tables list the first requests only; --json and --html every one
        rows = render.request_rows(batch, page_map(batch), None if json_ or html_path is not None else render.TABLE_REQUESTS)
        if html_path is not None:  # the page is made whole before it is written: a refused one leaves no file
            from maskcli.render.html import save_page
            from maskcli.render.servepage import serve_page

            save_page(serve_page(batch, rows, [render.finding_json(f) for f in findings], source, title), html_path)
            done(f"wrote {html_path}")
        if png_path is not None:
            from maskcli.render.heatmaps import save_figure

            save_figure(render.serve_figure(batch, page_map(batch), source, title), png_path)
            done(f"wrote {png_path}")
        if json_:
            reports.append(render.serve_dict(batch, rows, findings, source, title))
        else:
            if len(batches) > 1 and file != files[0]:
                console.print()
            for view in render.views(batch, rows, findings, source, title, console.width):
                console.print(view)
    if json_:
        echo(render.steps_json(reports, across))
    elif len(batches) > 1:
        from rich.text import Text

        console.print()
        console.print(Text(f"the {len(batches)} steps together", style="bold"))
        for view in render.findings_text(across):
            console.print(view)
    if wrong:
        raise typer.Exit(1)
