"""`maskcli pack BATCH`: do a packed batch's boundaries agree, and which one does each attention path use?

Exit status 1 where a finding is wrong or the paths disagree, 0 otherwise (a leak that rests on what pack cannot see,
use_cache or the attention implementation, is suspicious while another path reads the batch right), 2 for bad input.
"""

from __future__ import annotations

from typing import Annotated

import typer

from maskcli.commands.app import app, done, echo
from maskcli.commands.options import examples, integer
from maskcli.errors import MaskError

FIELDS_PANEL = "Fields given as options (instead of, or over, the file's)"


def _field(flag: str, help_text: str):
    return Annotated[str | None, typer.Option(flag, help=help_text, show_default=False, rich_help_panel=FIELDS_PANEL)]


InputIds = _field("--input-ids", "Token ids, a row per batch row: 5,6,2,7,8 (';' between rows).")
PositionIds = _field("--position-ids", "position_ids: 0,1,2,0,1 (';' between rows).")
AttentionMask = _field("--attention-mask", "A 2-D attention_mask: 1,1,1,0 (1 = token, 0 = padding; document ids 1,1,2,2,0 too), or a 4-D one as JSON.")
CuSeqlens = _field("--cu-seqlens", "Cumulative lengths over the flattened batch, as flash_attn_varlen_func takes them: 0,3,5.")
CuQ = _field("--cu-seq-lens-q", "cu_seq_lens_q (HF's name; cu_seqlens_q too): 0,3,5.")
CuK = _field("--cu-seq-lens-k", "cu_seq_lens_k (cu_seqlens_k, cu_seqlens_kv): 0,3,5.")
CuPadded = _field("--cu-seqlens-padded", "TransformerEngine's cu_seqlens_padded: where each document sits; --cu-seqlens gives the real lengths.")
MaxQ = _field("--max-length-q", "max_length_q (max_seqlen_q): the longest document.")
MaxK = _field("--max-length-k", "max_length_k (max_seqlen_k).")
SeqIdx = _field("--seq-idx", "seq_idx: the document of each token, 0,0,0,1,1 (negative: padding).")
Labels = _field("--labels", "labels: -100 where the loss skips a token.")


@app.command(
    epilog=examples(
        "maskcli pack --position-ids 0,1,2,0,1 --cu-seqlens 0,3,5 --use-cache no",
        "maskcli pack --input-ids 5,6,2,7,2 --position-ids 0,1,2,0,1 --eos-id 2 --use-cache no --png pack.png",
        "maskcli pack --position-ids 0,1,2,0,1 --labels=-100,6,2,-100,2 --use-cache no --json",
    ),
)
def pack(
    batch: Annotated[str | None, typer.Argument(
        help="The batch: a .pt (loaded with weights_only=True), .safetensors, .npz or .json file of named tensors (input_ids, "
             "position_ids, attention_mask, cu_seqlens, cu_seq_lens_q/k, cu_seqlens_padded, max_length_q/k, seq_idx, labels, "
             "under the names HF, TRL, torchtitan and TransformerEngine use). Optional where the fields are given as options.",
        show_default=False, metavar="BATCH")] = None,
    input_ids: InputIds = None,
    position_ids: PositionIds = None,
    attention_mask: AttentionMask = None,
    cu_seqlens: CuSeqlens = None,
    cu_seq_lens_q: CuQ = None,
    cu_seq_lens_k: CuK = None,
    cu_seqlens_padded: CuPadded = None,
    max_length_q: MaxQ = None,
    max_length_k: MaxK = None,
    seq_idx: SeqIdx = None,
    labels: Labels = None,
    field: Annotated[list[str] | None, typer.Option("--field", help="NAME=KEY: read the file's KEY as the field NAME (like position_ids=pos); repeat for several.", show_default=False)] = None,
    eos_id: Annotated[int | None, typer.Option("--eos-id", help="Check a document mask keyed on this EOS token id (torchtitan's flex document mask): a document ends at each EOS.", parser=integer, show_default=False)] = None,
    use_cache: Annotated[str | None, typer.Option("--use-cache", help="yes: the model makes a cache, and sdpa/eager/flex read no position_ids (default: --config's, else yes as most configs; Trainer: no).", show_default=False, metavar="yes|no")] = None,
    config: Annotated[str | None, typer.Option("--config", help="The model's config.json, or its family (llama, ...), for its use_cache.", show_default=False, metavar="FAMILY|CONFIG.json")] = None,
    reference: Annotated[str | None, typer.Option("--reference", help="The field that says where the documents are (default: the one most fields agree with, else the first of cu_seq_lens_q, cu_seqlens, position_ids, ...).", show_default=False)] = None,
    png: Annotated[str | None, typer.Option("--png", metavar="FILE", help="Write a figure of each path's mask per batch row, with the documents' boundaries and padding: .png, .svg or .pdf.", show_default=False)] = None,
    json_: Annotated[bool, typer.Option("--json", help="Print the report as one JSON object.")] = False,
) -> None:
    """Check a packed batch: the document boundaries each field implies, side by side, which field each attention path reads and the mask that results, and what leaks across documents.

    The paths: transformers' sdpa/eager/flex_attention (a 4-D attention_mask as given; a 2-D one gives causal & padding and position_ids are then not read; else, with no cache, position_ids restarts), transformers' flash_attention_2 (an attention_mask with padding unpads each row into one sequence; else cu_seq_lens_q/k with max_length_q/k; else position_ids for one batch row), flash_attn_varlen_func on cu_seqlens, and with --eos-id a document mask keyed on EOS. Each mask is compared exactly on key intervals, in O(tokens). Findings: tokens that see another document, position_ids that do not restart at a boundary, labels not -100 at a boundary, lengths that do not add up, padding a path lets tokens see. Exit status 1 where a finding is wrong, else 0: a leak resting on what pack cannot see (use_cache, the attention implementation) is suspicious, its condition named, while another path reads the batch right.
    """
    from maskcli.files import FIGURE_SUFFIXES, check_output_path

    given = {name: value for name, value in (
        ("input_ids", input_ids), ("position_ids", position_ids), ("attention_mask", attention_mask), ("cu_seqlens", cu_seqlens),
        ("cu_seq_lens_q", cu_seq_lens_q), ("cu_seq_lens_k", cu_seq_lens_k), ("cu_seqlens_padded", cu_seqlens_padded),
        ("max_length_q", max_length_q), ("max_length_k", max_length_k), ("seq_idx", seq_idx), ("labels", labels),
    ) if value is not None}
    if field and batch is None:
        raise MaskError("--field maps a key of the BATCH file: give the file too")
    png_path = check_output_path(png, FIGURE_SUFFIXES, "--png") if png is not None else None
    from maskcli.pack.findings import check
    from maskcli.sources import registry

    model = _model(use_cache, config)
    report = check(registry.read("packed", batch, given, field or []), eos_id, reference, model)
    source = batch if batch is not None else "the batch given as options"
    from maskcli.render import pack as render

    if png_path is not None:
        from maskcli.render.heatmaps import save_figure

        save_figure(render.pack_figure(report, source), png_path)
        done(f"wrote {png_path}")
    if json_:
        echo(render.pack_json(report, source))
    else:
        from maskcli.commands.app import make_console

        console = make_console()
        for view in render.views(report, source, console.width):
            console.print(view)
    if not report.ok:
        raise typer.Exit(1)


def _model(use_cache: str | None, config: str | None):
    """How the transformers model runs: --use-cache, else the --config's use_cache, else transformers' default (yes)."""
    from maskcli.pack.paths import Model

    if use_cache is not None:
        answer = {"yes": True, "true": True, "1": True, "no": False, "false": False, "0": False}.get(use_cache.strip().lower())
        if answer is None:
            raise MaskError(f"--use-cache {use_cache!r}: say yes or no (yes: the model makes a cache, as transformers' configs default to)")
        if config is not None:  # (read all the same: a --config that names no family or file is said, not dropped)
            from maskcli.hf.families import use_cache_of

            use_cache_of(config)
        return Model(answer, f"--use-cache {'yes' if answer else 'no'}", stated=True)
    if config is not None:
        from maskcli.hf.families import use_cache_of

        return Model(*use_cache_of(config))
    return Model()
