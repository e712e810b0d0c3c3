"""Command-line options shared by several commands, defined once as Annotated aliases."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

import typer

from maskcli.attention import FILLS, LIKES
from maskcli.commands.app import KIND_PANEL
from maskcli.conventions import CONVENTIONS, DTYPES
from maskcli.text import shortened


def completes(*values: str):
    """Shell completion of an option's value from its choices (typer calls it with what is typed so far)."""

    def complete(incomplete: str) -> list[str]:
        return [value for value in values if value.startswith(incomplete)]

    return complete


def complete_kinds(incomplete: str) -> list[str]:
    """Kind names for EXPR: the last word typed, completed (an expression goes on after & or |)."""
    from maskcli.kinds import names

    head, _, word = incomplete.rpartition(" ")
    return [f"{head} {name}".lstrip() for name in (*names(), "bidirectional", "prefill") if name.startswith(word)]


def integer(value: str) -> int:
    """Parse an integer option so that the error quotes what was typed: ASCII digits only (int() also takes 1_000 and
    other scripts' digits), and at most 30 of them (int() refuses 4,300; no option takes more than 19)."""
    import re

    if isinstance(value, int):  # a default, as click passes it
        return value
    digits = value.strip()
    if not re.fullmatch(r"[+-]?[0-9]+", digits):
        raise typer.BadParameter(f"{shortened(value, 40)!r} is not a whole number (write it in digits 0-9, like 16)")
    if len(digits.lstrip("+-")) > 30:
        raise typer.BadParameter(f"an integer of {len(digits.lstrip('+-')):,} digits is far too large for any option")
    return int(digits)


def escape(text: str) -> str:
    """Help text is rich markup: keep `label[kv]` from being read as a tag."""
    return text.replace("[", "\\[")


def examples(*commands: str) -> str:
    """A command's epilog: one runnable example a line, so each can be copied whole."""
    return "\n".join(["Examples:" if len(commands) > 1 else "Example:", *commands])


MASK_PANEL = "Mask options"
POSITION_PANEL = MASK_PANEL  # positions, padding and heads: one panel, so that help fits a screen
OWN_PANEL = MASK_PANEL
OUTPUT_PANEL = "Output"

Tokens = Annotated[str | None, typer.Option("--tokens", help="Words on the axes, one per position (\"the cat sat\" or a .txt/.json/.npy/.pt file).", rich_help_panel=OUTPUT_PANEL)]
As = Annotated[str, typer.Option("--as", help="Convention shown and saved: keep (the default; True = may attend: SDPA, create_mask), block (True = masked: nn.MultiheadAttention), additive (0 / -inf), min (0 / finfo.min: HF eager), int (1 / 0).", show_default=False, autocompletion=completes(*CONVENTIONS), rich_help_panel=OUTPUT_PANEL)]
Dtype = Annotated[str | None, typer.Option("--dtype", help=f"Float dtype of --as additive and min: {', '.join(DTYPES)} (default float32).", autocompletion=completes(*DTYPES), rich_help_panel=OUTPUT_PANEL)]
Png = Annotated[str | None, typer.Option("--png", metavar="FILE", help="Write a heatmap: .png, .svg or .pdf (a folder: a .png named after the mask).", rich_help_panel=OUTPUT_PANEL)]
Json = Annotated[bool, typer.Option("--json", help="Print the mask as JSON: expression, shape, offsets, cells as [B][H][Lq][Lk] lists (--as).", rich_help_panel=OUTPUT_PANEL)]
Html = Annotated[str | None, typer.Option("--html", metavar="FILE", help="Write a self-contained HTML page: zoom to any cell, hover for its value and --why.", rich_help_panel=OUTPUT_PANEL)]
Save = Annotated[str | None, typer.Option("--save", metavar="FILE", help="Save the mask in the --as convention: .pt, .pth or .npy (a folder: named after the mask).", rich_help_panel=OUTPUT_PANEL)]



INPUT_PANEL = "Inputs and computation"
COMPUTE_PANEL = INPUT_PANEL
DISPLAY_PANEL = OUTPUT_PANEL  # one panel, as the views and files a command gives are one choice

QFile = Annotated[str | None, typer.Option("--q", help="Queries [L, D] .. [B, H, L, D]: a .pt/.npy/.safetensors/.json file (tensor q) or JSON.", rich_help_panel=INPUT_PANEL)]
KFile = Annotated[str | None, typer.Option("--k", help="Keys, like --q (tensor 'k').", rich_help_panel=INPUT_PANEL)]
VFile = Annotated[str | None, typer.Option("--v", help="Values, like --q (tensor 'v').", rich_help_panel=INPUT_PANEL)]
XFile = Annotated[str | None, typer.Option("--x", help="Embeddings [(B,) L, d_in], projected as tutorials do: manual_seed(--seed), nn.Linear.", rich_help_panel=INPUT_PANEL)]
Seed = Annotated[int, typer.Option("--seed", help="Seed for random inputs, the --x projections and --dropout.", parser=integer, rich_help_panel=INPUT_PANEL)]
Batch = Annotated[int | None, typer.Option("--batch", help="Batch size of random inputs (default 1; padding masks set it from --lengths/--ids).", parser=integer, rich_help_panel=INPUT_PANEL)]
HeadDim = Annotated[int | None, typer.Option("--head-dim", help="Head size D of random inputs (default 8 for attend, 16 for verify).", parser=integer, rich_help_panel=INPUT_PANEL)]
DOut = Annotated[int | None, typer.Option("--d-out", help="--x: output size of the projections (default d_in); split over --heads.", parser=integer, rich_help_panel=INPUT_PANEL)]
QkvBias = Annotated[bool, typer.Option("--qkv-bias", help="--x: give the projections a bias (nn.Linear(bias=True)).", rich_help_panel=INPUT_PANEL)]
Device = Annotated[str, typer.Option("--device", help="auto (cuda, mps, then cpu), cpu, cuda, cuda:N or mps (default auto or $MASKCLI_DEVICE).", envvar="MASKCLI_DEVICE", show_envvar=False, show_default=False, autocompletion=completes("auto", "cpu", "cuda", "mps"), rich_help_panel=COMPUTE_PANEL)]
ComputeDtype = Annotated[str, typer.Option("--dtype", help=f"Compute dtype of every stage: {', '.join(DTYPES)}.", show_default=False, autocompletion=completes(*DTYPES), rich_help_panel=COMPUTE_PANEL)]
Scale = Annotated[float | None, typer.Option("--scale", help="Multiply the scores by this instead of 1/sqrt(D) (as SDPA's scale does).", rich_help_panel=COMPUTE_PANEL)]
Fill = Annotated[str | None, typer.Option("--fill", help="-inf (default; NaN on empty rows), min (uniform there), -1e9, multiply (after softmax).", show_default=False, autocompletion=completes(*FILLS), rich_help_panel=COMPUTE_PANEL)]
Like = Annotated[str | None, typer.Option("--like", help="Match tutorial (empty rows: NaN), sdpa (0), hf-eager (uniform), mha, mha-weights.", show_default=False, autocompletion=completes(*LIKES), rich_help_panel=COMPUTE_PANEL)]
Dropout = Annotated[float, typer.Option("--dropout", help="Dropout on the weights, as nn.Dropout(p) after manual_seed of --dropout-seed.", show_default=False, rich_help_panel=COMPUTE_PANEL)]
DropoutSeed = Annotated[int | None, typer.Option("--dropout-seed", help="The torch.manual_seed before the dropout (default --seed). The LLMs-from-scratch tutorial uses --seed 789 for the weights and --dropout-seed 123.", parser=integer, show_default=False, rich_help_panel=COMPUTE_PANEL)]
StagesOpt = Annotated[str, typer.Option("--stages", help="Stages to show (default scores,masked,weights,output; also scaled, and unmasked: no mask).", show_default=False, rich_help_panel=DISPLAY_PANEL)]
BatchIndex = Annotated[int | None, typer.Option("--batch-index", help="Show this batch row only (default: up to 4 (batch, head) pairs in tables, 8 in --png).", parser=integer, rich_help_panel=DISPLAY_PANEL)]
Head = Annotated[int | None, typer.Option("--head", help="Show this head only (default: as for --batch-index).", parser=integer, rich_help_panel=DISPLAY_PANEL)]
Precision = Annotated[int, typer.Option("--precision", help="Decimals in the tables.", parser=integer, rich_help_panel=DISPLAY_PANEL)]
FigurePng = Annotated[str | None, typer.Option("--png", metavar="FILE", help="Write a figure: rows = heads, columns = stages; .png, .svg or .pdf.", rich_help_panel=DISPLAY_PANEL)]
StagesJson = Annotated[bool, typer.Option("--json", help="Print every stage as nested lists (\"nan\", \"inf\", \"-inf\" as strings) and findings.", rich_help_panel=DISPLAY_PANEL)]
Atol = Annotated[float | None, typer.Option("--atol", help="Agreement tolerance on max |diff| (default by dtype: float32 1e-5, float16 5e-3, bfloat16 3e-2, float64 1e-10).", rich_help_panel=COMPUTE_PANEL)]
Repeat = Annotated[int, typer.Option("--repeat", help="Timed calls per backend (the median is shown), after one warm-up call.", parser=integer, rich_help_panel=COMPUTE_PANEL)]
Strict = Annotated[bool, typer.Option("--strict", help="Exit with status 1 when any backend that ran disagrees beyond --atol.", rich_help_panel=DISPLAY_PANEL)]
VerifyJson = Annotated[bool, typer.Option("--json", help="Print the table as one JSON object.", rich_help_panel=DISPLAY_PANEL)]
# maskcli model: a family's config values, not kind parameters (those are declared once, from the registry, below)
ConfigWindow = Annotated[int | None, typer.Option("--window", help="Set the sliding_window (keys a sliding layer sees, itself included) instead of the config's.", parser=integer, show_default=False)]
ConfigChunkSize = Annotated[int | None, typer.Option("--chunk-size", help="Set attention_chunk_size (Llama 4's chunked layers) instead of the config's.", parser=integer, show_default=False)]
KeyOpt = Annotated[str | None, typer.Option("--key", help="The tensor's name in a .npz, .safetensors, .pt dict or JSON object.")]
InspectHeads = Annotated[int | None, typer.Option("--heads", help="Your model's head count, to check a 3-D mask against it.", parser=integer)]
ReportJson = Annotated[bool, typer.Option("--json", help="Print the report as one JSON object.")]


# --- the mask options: declared once, read by every command that builds a mask ---------------

KIND_ARGUMENT_HELP = (
    "A kind or an expression: causal, window(3), \"document(0,0,1,1) & window(2)\"; a bare kind takes flags (--window 3; "
    "maskcli kinds lists them). Left out with --mask or --mask-mod."
)


Expr = Annotated[str | None, typer.Argument(help=KIND_ARGUMENT_HELP, show_default=False, metavar="EXPR", autocompletion=complete_kinds)]


def _position_options(heads: int, many_masks: bool = False) -> list[tuple[str, object, object]]:
    """(python name, annotation, default) of the options every mask takes (`many_masks`: --mask repeatable, a list)."""
    mask_file = list[str] | None if many_masks else str | None
    return [
        ("m_length", Annotated[int | None, typer.Option("--len", "-n", help="Number of queries (default 8, or what labels, --ids or --tokens cover).", parser=integer, rich_help_panel=POSITION_PANEL)], None),
        ("m_offset", Annotated[int | None, typer.Option("--offset", "--prev", help="Tokens already in the KV cache: queries sit at P..P+Lq-1 (--len 1: decode).", parser=integer, rich_help_panel=POSITION_PANEL)], None),
        ("m_kv_start", Annotated[int | None, typer.Option("--kv-start", help="First key position kept (a sliding cache that dropped its first keys).", parser=integer, rich_help_panel=POSITION_PANEL)], None),
        ("m_kv_len", Annotated[int | None, typer.Option("--kv-len", help="Number of keys: a static cache or cross-attention memory (see --align).", parser=integer, rich_help_panel=POSITION_PANEL)], None),
        ("m_align", Annotated[str | None, typer.Option("--align", help="With --kv-len: top-left (SDPA's is_causal) or bottom-right (FlashAttention's causal: last query on last key).", autocompletion=completes("top-left", "bottom-right"), rich_help_panel=POSITION_PANEL)], None),
        ("m_heads", Annotated[int, typer.Option("--heads", help="Number of attention heads (the H in B, H, Lq, Lk).", parser=integer, rich_help_panel=MASK_PANEL)], heads),
        ("m_lengths", Annotated[str | None, typer.Option("--lengths", help="Valid length per batch row, like 4,2, or a file; keys past it are padding.", rich_help_panel=MASK_PANEL)], None),
        ("m_pad", Annotated[str | None, typer.Option("--pad", help="right (default) or left: where --lengths puts the padding (HF's padding_side).", autocompletion=completes("right", "left"), rich_help_panel=MASK_PANEL)], None),
        ("m_ids", Annotated[str | None, typer.Option("--ids", help="Token ids per batch row ('5,6,7,0;0,8,9,1' or a file); --pad-id marks padding.", rich_help_panel=MASK_PANEL)], None),
        ("m_pad_id", Annotated[int, typer.Option("--pad-id", help="The padding token id for --ids.", parser=integer, rich_help_panel=MASK_PANEL)], 0),
        ("m_mask_file", Annotated[mask_file, typer.Option("--mask", metavar="FILE", help="A mask file (.pt .npy .npz .safetensors .json, any convention) or TRACE.pt:N" + ("; repeat for one mask per layer type." if many_masks else "."), rich_help_panel=OWN_PANEL)], None),
        ("m_key", Annotated[str | None, typer.Option("--key", help="With --mask: which tensor of the file (.npz, .safetensors, a .pt dict, a JSON object).", rich_help_panel=OWN_PANEL)], None),
        ("m_from", Annotated[str | None, typer.Option("--from", help="With --mask: keep or block, where a bool or 0/1 tensor's structure does not tell; or the kernel format the file holds, as maskcli export --save writes it: flash-attn, flashmask, magi or flex.", rich_help_panel=OWN_PANEL)], None),
        ("m_causal", Annotated[bool, typer.Option("--causal", help="With --mask FILE --from flash-attn or flashmask: the kernel's causal=True, where the file does not say.", rich_help_panel=OWN_PANEL)], False),
        ("m_mask_mod", Annotated[str | None, typer.Option("--mask-mod", help="A FlexAttention mask_mod: FILE.py:NAME or module:NAME. RUNS YOUR CODE.", rich_help_panel=OWN_PANEL)], None),
        ("m_mask_mod_args", Annotated[str | None, typer.Option("--mask-mod-args", help="Arguments for a --mask-mod factory, as Python literals, like 4 or 4, 128.", rich_help_panel=OWN_PANEL)], None),
    ]


def _kind_options() -> list[tuple[str, object, object, str]]:
    """One option per kind parameter flag, from the registry: (python name, annotation, default, flag)."""
    from maskcli.kinds import flags

    options = []
    for flag, readers in flags().items():
        kinds = ", ".join(dict.fromkeys(kind.name for kind, _ in readers))
        param = readers[0][1]
        if flag == "--sizes":
            text = f"{kinds}: labels from segment sizes, like 3,5 (0,0,0,1,1,1,1,1)."
        else:  # kinds that read the flag alike share one text; one that reads it otherwise (band's W) says its own
            meanings: dict[str, list[str]] = {}
            for kind, p in readers:
                meanings.setdefault(p.help, []).append(kind.name)
            text = "; ".join(f"{', '.join(dict.fromkeys(names))}: {meaning}" for meaning, names in meanings.items())
            defaults = {kind.name: p.default for kind, p in readers if not p.required and p.default is not None}
            if defaults:
                text += " (default " + ", ".join(f"{v} for {k}" for k, v in defaults.items()) + ")"
            text += "."
        is_int = param.type == "int" and flag != "--sizes"
        annotation = Annotated[
            int | None if is_int else str | None,
            # --help folds the panel away (app.py FOLDED), since an expression carries its parameters; --help-all shows it
            typer.Option(flag, help=escape(text), rich_help_panel=KIND_PANEL, **({"parser": integer} if is_int else {})),
        ]
        options.append(("m_" + flag.lstrip("-").replace("-", "_"), annotation, None, flag))
    return options


def extend(func, name: str, added: list[tuple[str, object, object]], pack):
    """`func` with the options `added` (python name, annotation, default) in its signature, given to it
    as one argument `name` = pack(values of the added options). Typer reads the new signature."""
    import functools
    import inspect
    import typing

    hints = typing.get_type_hints(func, include_extras=True)
    own = [
        p.replace(annotation=hints.get(p.name, p.annotation), kind=inspect.Parameter.KEYWORD_ONLY)
        for p in inspect.signature(func).parameters.values() if p.name != name
    ]
    arguments = [p for p in own if p.default is inspect.Parameter.empty]
    rest = [p for p in own if p.default is not inspect.Parameter.empty]
    parameters = arguments + [
        inspect.Parameter(option, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=annotation)
        for option, annotation, default in added
    ] + rest

    @functools.wraps(func)
    def command(**values):
        values[name] = pack({option: values.pop(option) for option, _, _ in added})
        return func(**values)

    del command.__wrapped__  # typer must read the new signature, not the function's own
    command.__signature__ = inspect.Signature(parameters)
    command.__annotations__ = {p.name: p.annotation for p in parameters}
    return command


Rows = Annotated[str | None, typer.Option("--rows", help="View queries A:B only (absolute, B excluded; 4000: or :64 leave a side open).", rich_help_panel=POSITION_PANEL)]
Keys = Annotated[str | None, typer.Option("--keys", help="View the keys C:D only, as --rows does the queries.", rich_help_panel=POSITION_PANEL)]


def mask_options(*, heads: int = 1, tokens: bool = True, kind_params: bool = True, regions: bool = False, many_masks: bool = False):
    """Decorate a command that builds a mask: its signature gains every mask option, declared here once,
    and the function receives them as one `mask: MaskOptions` argument (`regions`: --rows and --keys too;
    `many_masks`: --mask repeatable, its mask_file a list of files)."""
    from maskcli.mask import MaskOptions

    kind_options = _kind_options() if kind_params else []
    added = list(_position_options(heads, many_masks)) + [(name, annotation, default) for name, annotation, default, _ in kind_options]
    if tokens:
        added.append(("m_tokens", Tokens, None))
    if regions:
        added += [("m_rows", Rows, None), ("m_keys", Keys, None)]
    flag_of = {name: flag for name, _, _, flag in kind_options}

    def pack(given: dict) -> MaskOptions:
        from maskcli.batchdata import check_pad_id

        check_pad_id(given["m_pad_id"])  # up front, --ids given or not
        return MaskOptions(
            length=given["m_length"], offset=given["m_offset"], kv_start=given["m_kv_start"],
            kv_len=given["m_kv_len"], align=given["m_align"], heads=given["m_heads"],
            lengths=given["m_lengths"], ids=given["m_ids"], pad_id=given["m_pad_id"], pad=given["m_pad"],
            tokens=given.get("m_tokens"),
            params={flag_of[name]: given[name] for name in flag_of if given[name] is not None},
            mask_file=given["m_mask_file"], key=given["m_key"], from_=given["m_from"], causal=given["m_causal"],
            mask_mod=given["m_mask_mod"], mask_mod_args=given["m_mask_mod_args"],
            rows=given.get("m_rows"), keys=given.get("m_keys"),
        )

    return lambda func: extend(func, "mask", added, pack)


def input_options(*, head_dim: int):
    """Decorate a command that runs attention: it gains the input and compute options, given to it as
    one `inputs: InputOptions` argument."""
    from maskcli.commands.inputs import InputOptions

    added = [
        ("i_q", QFile, None), ("i_k", KFile, None), ("i_v", VFile, None), ("i_x", XFile, None),
        ("i_seed", Seed, 0), ("i_batch", Batch, None), ("i_head_dim", HeadDim, None), ("i_d_out", DOut, None),
        ("i_qkv_bias", QkvBias, False), ("i_device", Device, "auto"), ("i_dtype", ComputeDtype, "float32"),
        ("i_scale", Scale, None),
    ]

    def pack(given: dict) -> InputOptions:
        return InputOptions(**{key[2:]: value for key, value in given.items()}, default_head_dim=head_dim)

    return lambda func: extend(func, "inputs", added, pack)


@dataclass(frozen=True)
class Output:
    """What show and chunk print or write."""

    convention: str
    dtype: str | None
    png: str | None
    json: bool
    save: str | None
    summary: bool
    grid: str | None
    why: str | None = None
    html: str | None = None


Summary = Annotated[bool, typer.Option("--summary", help="Print exact statistics instead of cells: visible cells, keys per row, empty rows, documents.", rich_help_panel=OUTPUT_PANEL)]
Grid = Annotated[str | None, typer.Option("--grid", help="With --summary --json: the R,C of the exact density grid (default 32,64).", rich_help_panel=OUTPUT_PANEL)]


Why = Annotated[str | None, typer.Option("--why", help="Explain one cell: Q,KV (absolute positions; B,Q,KV for one batch row) -- the expression's tree at that cell, each kind's reason, and how &, |, ~ decide; with --json as JSON.", metavar="Q,KV", rich_help_panel=OUTPUT_PANEL)]


def output_options(func):
    """The output options of show and chunk, declared once and given to the command as `output: Output`."""
    added = [("o_as", As, "keep"), ("o_dtype", Dtype, None), ("o_png", Png, None), ("o_json", Json, False), ("o_save", Save, None),
             ("o_summary", Summary, False), ("o_grid", Grid, None), ("o_why", Why, None), ("o_html", Html, None)]
    return extend(func, "output", added, lambda given: Output(*given.values()))

Check = Annotated[bool, typer.Option("--check/--no-check", help="Exit status 1 where a finding is wrong: a mask differs from what the run itself states (the model's config, the forward call's attention_mask / position_ids / cache_position, the call's earlier steps, the kernel's rules). --no-check reports findings and keeps the program's status.")]
