"""`maskcli model FAMILY|CONFIG.json`: the masks a Hugging Face family builds, per layer type and step (needs transformers)."""

from __future__ import annotations

from typing import Annotated

import typer

from maskcli.commands.app import app, done, echo, make_console
from maskcli.commands.options import ConfigChunkSize, ConfigWindow, examples, integer
from maskcli.errors import MaskError


@app.command(
    epilog=examples(
        "maskcli model --list",
        "maskcli model gemma3_text --window 3 --lengths 5,3 --new-tokens 2",
        "maskcli model mistral --window 3 --attn eager --expect \"sliding_attention=window(3)\"",
        "maskcli model llama4_text --chunk-size 4 --lengths 6,4 --png llama4.png",
        "maskcli model gemma3_text --window 3 --prefill-chunk 2 --save run.pt",
        "maskcli model mistral --window 3 --lengths 7,4 --cache static --prefill-chunk 4",
        "maskcli show --mask run.pt:model.layers.0.self_attn@1",
    ),
)
def model(
    ctx: typer.Context,
    source: Annotated[str | None, typer.Argument(help="A model family (its model_type, like llama, mistral, gemma3_text; maskcli model --list lists them) or a local config.json. Never downloads anything.", show_default=False, metavar="FAMILY|CONFIG.json")] = None,
    list_: Annotated[bool, typer.Option("--list", help="List the families this transformers builds as a causal LM, with what shapes their masks (read from their config classes).")] = False,
    try_: Annotated[bool, typer.Option("--try", help="With --list: build each family tiny and say whether a padded prefill and decode step run (sdpa and eager, or eager only) or why not.")] = False,
    lengths: Annotated[str | None, typer.Option("--lengths", help="Prompt length per batch row, like 5,3 (default), padded to the longest on --pad's side.", show_default=False)] = None,
    ids: Annotated[str | None, typer.Option("--ids", help="The prompt's token ids per batch row, like '5,6,7;0,8,9' (--pad-id marks padding), instead of --lengths.", show_default=False)] = None,
    pad: Annotated[str, typer.Option("--pad", help="left (default) or right (then decode continues from a pad: exit 1).", show_default=False)] = "left",
    pad_id: Annotated[int | None, typer.Option("--pad-id", help="The padding token id (default the config's pad_token_id where it is inside the tiny vocabulary, else 0).", parser=integer, show_default=False)] = None,
    new_tokens: Annotated[int, typer.Option("--new-tokens", help="Decode steps after the prefill (default 2), each feeding back generate's greedy pick.", parser=integer, show_default=False)] = 2,
    attn: Annotated[str, typer.Option("--attn", help="The attention implementation: sdpa (the default), eager or flex (FlexAttention).", show_default=False)] = "sdpa",
    cache: Annotated[str, typer.Option("--cache", help="The KV cache generate uses: dynamic (the default), static, or sliding (its sliding_window cache).", show_default=False)] = "dynamic",
    window: ConfigWindow = None,
    chunk_size: ConfigChunkSize = None,
    prefill_chunk: Annotated[int | None, typer.Option("--prefill-chunk", help="Prefill in chunks of N tokens (generate's prefill_chunk_size), a step each; on absolute positions their masks must equal one pass's (else exit status 1).", parser=integer, show_default=False)] = None,
    expect: Annotated[list[str] | None, typer.Option("--expect", help="LAYERTYPE=EXPR, repeatable: every call of those layers (a shell pattern over layer types or module paths) must be EXPR (padding: as EXPR ends, causal (--lengths 5,3 --pad left), else off the mask); else exit 1.", show_default=False)] = None,
    png: Annotated[str | None, typer.Option("--png", metavar="FILE", help="Write a figure of each layer type's mask at each step, per batch row: .png, .svg or .pdf.", show_default=False)] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print every call, group and table cell as one JSON object instead of the table.")] = False,
    save: Annotated[str | None, typer.Option("--save", metavar="FILE", help="Write the captured calls to a trace file that show, diff and inspect read: --mask RUN.pt:7 (call 7) or RUN.pt:PATH@STEP.", show_default=False)] = None,
) -> None:
    """Build a family's model tiny from its config (random weights, offline), run a padded prompt and decode steps, and show the mask each layer type's attention gets at each step.

    Sizes shrink to a tiny width; what shapes masks stays: the sliding window, the layer types and their pattern (the first layers, up to one of each type), the chunk size, the cache, the padding side. The masks are captured as maskcli trace captures them and named by the same recogniser; calls with the same mask form one group (#N).

    Every run checks each step's mask against the keys its layer's cache returned (as wide, each key column on the position its slot holds) and its config: exit 1 naming the first cell where not, as for --expect and --prefill-chunk.
    """
    if list_:
        _only_try_with_list(ctx)
    _check_numbers(pad_id, new_tokens, prefill_chunk)  # before transformers' import: a typo costs no 20 s
    from maskcli.hf import require

    require()
    if try_ and not list_:
        raise MaskError("--try goes with --list: maskcli model --list --try")
    if list_:
        _list(try_)
        return
    if source is None:
        raise MaskError("give a model family or a config.json: maskcli model llama (maskcli model --list lists the families)")
    from maskcli.hf.run import ATTN, CACHES

    if attn not in ATTN:
        raise MaskError(f"--attn {attn!r}: choose sdpa, eager or flex")
    if cache not in CACHES:
        raise MaskError(f"--cache {cache!r}: choose dynamic, static or sliding")
    if pad not in ("left", "right"):
        raise MaskError(f"--pad {pad!r}: choose left or right (Hugging Face's padding_side)")
    if lengths is not None and ids is not None:
        raise MaskError("give either --lengths or --ids, not both")
    from maskcli.trace.expect import parse as parse_expect

    expectations = parse_expect(expect or [])
    from maskcli.files import check_output_path

    targets = {flag: check_output_path(path, suffixes, flag) for flag, path, suffixes in
               (("--save", save, (".pt",)), ("--png", png, (".png", ".svg", ".pdf"))) if path is not None}
    parsed_lengths, parsed_ids = _batch(lengths, ids)

    from maskcli.hf.families import SIZES, load, tiny
    from maskcli.hf.run import prompt, run

    config = load(source)
    name = source if not source.lower().endswith(".json") else f"{source} ({getattr(config, 'model_type', '?')})"
    config = tiny(config, window, chunk_size, name)
    the_pad = pad_id if pad_id is not None else config.pad_token_id
    the_prompt = prompt(parsed_lengths, parsed_ids, the_pad, pad, SIZES["vocab_size"])
    from maskcli.commands.app import warn
    from maskcli.commands.progress import progress
    from maskcli.hf.budget import estimate, notice
    from maskcli.hf.families import layer_types

    rows, width = the_prompt.ids.shape
    said = notice(name, *estimate(len(layer_types(config)), rows, width, new_tokens, prefill_chunk))
    if said is not None:  # before minutes of work: what it will cost and how to narrow it
        warn(said, now=True)
    with progress(f"model {name}: decode steps") as update:  # a bar after the first second, on a terminal only
        result = run(name, config, the_prompt, new_tokens, attn, cache, prefill_chunk, progress=update)
    _show(result, expectations, json_out, targets)


def _check_numbers(pad_id: int | None, new_tokens: int, prefill_chunk: int | None) -> None:
    """The integer options' ranges, as maskcli.hf.run checks them again where they are used."""
    from maskcli.hf.families import MOST_WINDOW, SIZES
    from maskcli.hf.budget import MOST_TOKENS

    vocab = SIZES["vocab_size"]
    if pad_id is not None and not 0 <= pad_id < vocab:
        raise MaskError(f"--pad-id {pad_id}: the tiny model's vocabulary is 0..{vocab - 1}: give a pad id in it")
    if not 0 <= new_tokens <= MOST_TOKENS:
        raise MaskError(f"--new-tokens {new_tokens}: give 0 to {MOST_TOKENS} decode steps")
    if prefill_chunk is not None and not 1 <= prefill_chunk <= MOST_WINDOW:  # (2^63: "Overflow when unpacking long long")
        raise MaskError(f"--prefill-chunk {prefill_chunk}: give 1 to {MOST_WINDOW:,} tokens")


def _only_try_with_list(ctx: typer.Context) -> None:
    """--list lists and --try builds every family: any other input given with them would be ignored, so say so."""
    # by name: typer 0.28 vendors its own click (typer._click), whose ParameterSource is not click's
    given = [param for param in ctx.command.params if param.name not in ("list_", "try_", "help", "help_all")
             and getattr(ctx.get_parameter_source(param.name), "name", None) == "COMMANDLINE"]
    if given:
        named = [f"FAMILY {ctx.params[p.name]!r}" if p.name == "source" else p.opts[0] for p in given]
        raise MaskError(f"--list uses only --try, not {', '.join(named)}: drop them, or drop --list to run one family")


def _batch(lengths: str | None, ids: str | None):
    from maskcli.kinds.values import parse_rows

    if ids is not None:
        import numpy as np

        rows = parse_rows(ids, "--ids", "5,6,7;0,8,9")
        if len({len(row) for row in rows}) > 1:
            raise MaskError(f"--ids {ids!r}: the batch rows have {', '.join(str(len(row)) for row in rows)} tokens: pad every row to the same length with the pad id")
        return None, np.asarray(rows, dtype=np.int64)
    if lengths is not None:
        rows = parse_rows(lengths, "--lengths", "5,3")
        if len(rows) > 1:
            raise MaskError(f"--lengths {lengths!r}: one length per batch row, in one row (like 5,3)")
        return tuple(int(x) for x in rows[0]), None
    return None, None


def _list(try_: bool) -> None:
    from rich import box
    from rich.table import Table

    from maskcli.hf.families import listing

    import transformers

    found = listing()
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True,
                  title=f"{len(found)} families transformers {transformers.__version__} builds as a causal LM")
    # the config class is the family's name in CamelCase (model FAMILY names it): a row a line needs its width
    table.add_column("family", no_wrap=True)
    for column in ("what shapes its masks (class defaults)",) + (("built tiny",) if try_ else ()):
        table.add_column(column, overflow="fold", ratio=1)
    from maskcli.commands.progress import progress

    with progress(f"model --list --try: {len(found)} families built tiny, each in turn") as update:  # (minutes: a bar
        for done, family in enumerate(found):  # on a terminal's stderr after the first second)
            if try_:
                from maskcli.hf.run import tryout

                update(done, len(found))
            table.add_row(family.name, family.shapes, *((tryout(family.name),) if try_ else ()))
    make_console().print(table)


def _placed(call) -> dict:
    """Queries placed among the keys where the cache says so and they are not at the keys' end (a static cache's
    slots not yet filled lie after them); the keys counted from the first one, as --expect's padding is."""
    keys, queries = call.details.get("keys"), call.details["queries"]
    if keys is None or keys[1] == queries[1]:
        return {}
    return {"offset": queries[0] - keys[0], "kv_len": keys[1] - keys[0]}


def _show(result, expectations, json_out: bool, targets: dict) -> None:
    import json

    from maskcli.files import atomic_write
    from maskcli.hf.report import view as make_view
    from maskcli.trace.expect import check

    view = make_view(result)
    failures = check(result.calls, expectations, lambda call: (call.details["layer_type"], call.where), _placed) if expectations else []
    held = [f"--expect: every call matched holds ({len(expectations)} expectation{'s' if len(expectations) != 1 else ''})"] if expectations and not failures else []
    if json_out:
        echo(json.dumps(view.json(failures), default=str))
    else:
        from maskcli.render.model import views

        console = make_console()
        for item in views(view, failures, held):
            console.print(item)
    if "--png" in targets:
        from maskcli.render.heatmaps import save_figure
        from maskcli.render.model import model_figure

        save_figure(model_figure(view), targets["--png"])
        done(f"wrote {targets['--png']}")
    if "--save" in targets:
        from maskcli.tracefile import save as save_trace

        tracer = result.trace
        used = {call.mask for call in tracer.calls if call.mask is not None}
        masks = {key: value for key, value in tracer.masks.items() if key in used}
        atomic_write(targets["--save"], lambda path: save_trace(path, [call.json() for call in tracer.calls], masks))
        done(f"wrote {targets['--save']}")
    from maskcli.checks.registry import wrong

    if failures or not result.chunk_holds or not result.cache_holds or any(wrong(g.findings) for g in view.groups):
        raise typer.Exit(1)
