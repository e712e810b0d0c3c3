"""Command-line options shared by several commands, defined once as Annotated aliases."""

from __future__ import annotations

from typing import Annotated

import typer

from maskcli.spec import CONVENTIONS, DTYPES, KINDS


def integer(value: str) -> int:
    """Parse an integer option so that the error quotes what was typed."""
    try:
        return int(value)
    except ValueError:
        raise typer.BadParameter(f"{value!r} is not a whole number") from None


def escape(text: str) -> str:
    """Help text is rich markup: keep `label[kv]` from being read as a tag."""
    return text.replace("[", "\\[")


def examples(*commands: str) -> str:
    """A command's epilog: one runnable example a line, so each can be copied whole."""
    return "\n\n".join(["Examples:" if len(commands) > 1 else "Example:", *commands])


KIND_LIST = "\n\n".join(f"[bold]{kind}[/bold]: {escape(text)}" for kind, text in KINDS.items())
MASK_PANEL = "Mask options"
OUTPUT_PANEL = "Output"

Len = Annotated[int | None, typer.Option("--len", "-n", help="Number of query positions (default 8, or from the longest --lengths, or from --tokens).", parser=integer, rich_help_panel=MASK_PANEL)]
Diagonal = Annotated[int | None, typer.Option(help="tril/triu: the diagonal argument of torch.tril/triu (default 0 for tril, 1 for triu).", parser=integer, rich_help_panel=MASK_PANEL)]
Means = Annotated[str | None, typer.Option(help="tril/triu: read the 1-cells as 'keep' (tril default) or 'block' (triu default).", rich_help_panel=MASK_PANEL)]
Lengths = Annotated[str | None, typer.Option(help="Valid length per batch row, like 4,2: later keys are padding. Combines with any kind.", rich_help_panel=MASK_PANEL)]
Ids = Annotated[str | None, typer.Option(help="Token ids per batch row, ';' between rows, like '5,6,7,0;8,9,0,0': ids equal to --pad-id are padding.", rich_help_panel=MASK_PANEL)]
PadId = Annotated[int, typer.Option(help="The padding token id for --ids.", parser=integer, rich_help_panel=MASK_PANEL)]
Offset = Annotated[int | None, typer.Option("--offset", "--prev", help="prefill: tokens already in the KV cache; queries sit at positions P..P+N-1.", parser=integer, rich_help_panel=MASK_PANEL)]
Chunks = Annotated[str | None, typer.Option(help="chunk/document: one integer label per token, like 0,0,1,1.", rich_help_panel=MASK_PANEL)]
Window = Annotated[int | None, typer.Option(help="window: each query sees itself and the W-1 keys before it (W keys in all, as Hugging Face's sliding_window counts; some libraries count W-1 or W+1).", parser=integer, rich_help_panel=MASK_PANEL)]
Prefix = Annotated[int | None, typer.Option(help="prefix: the first P tokens see each other both ways; the rest is causal.", parser=integer, rich_help_panel=MASK_PANEL)]
Heads = Annotated[int, typer.Option(help="Number of attention heads (the H in B, H, Lq, Lk).", parser=integer, rich_help_panel=MASK_PANEL)]
Tokens = Annotated[str | None, typer.Option(help="Words that label the axes, one per key position: \"Your journey starts with one step\".", rich_help_panel=OUTPUT_PANEL)]
As = Annotated[str, typer.Option("--as", help="Convention shown and saved: " + "; ".join(f"{k} = {v}" for k, v in CONVENTIONS.items()) + ".", rich_help_panel=OUTPUT_PANEL)]
Dtype = Annotated[str | None, typer.Option(help=f"Float dtype for the additive and min conventions: {', '.join(DTYPES)} (default float32).", rich_help_panel=OUTPUT_PANEL)]
Png = Annotated[str | None, typer.Option("--png", help="Write a heatmap; the extension picks the format: .png, .svg or .pdf.", rich_help_panel=OUTPUT_PANEL)]
Json = Annotated[bool, typer.Option("--json", help="Print one JSON object: kind, params, shape, q_offset, convention and the mask as nested 0/1 lists (1 = may attend).", rich_help_panel=OUTPUT_PANEL)]
Save = Annotated[str | None, typer.Option(help="Save the mask tensor in the --as convention; .pt or .npy by extension.", rich_help_panel=OUTPUT_PANEL)]



INPUT_PANEL = "Inputs"
COMPUTE_PANEL = "Computation"
DISPLAY_PANEL = "Display"

QFile = Annotated[str | None, typer.Option("--q", help="Queries: a .pt/.npy/.safetensors/.json file (tensor 'q') or inline JSON; shape [L, D], [B, L, D] or [B, H, L, D]. Needs --k and --v too.", rich_help_panel=INPUT_PANEL)]
KFile = Annotated[str | None, typer.Option("--k", help="Keys, like --q (tensor 'k').", rich_help_panel=INPUT_PANEL)]
VFile = Annotated[str | None, typer.Option("--v", help="Values, like --q (tensor 'v').", rich_help_panel=INPUT_PANEL)]
XFile = Annotated[str | None, typer.Option("--x", help="Embeddings [L, d_in] or [B, L, d_in] (file or inline JSON like \"[[0.43, 0.15, 0.89], ...]\"), projected as tutorial code does: torch.manual_seed(--seed), then nn.Linear(d_in, d_out) for query, key and value in that order.", rich_help_panel=INPUT_PANEL)]
Seed = Annotated[int, typer.Option(help="Seed for random inputs, for the --x projections and for --dropout.", parser=integer, rich_help_panel=INPUT_PANEL)]
Batch = Annotated[int | None, typer.Option(help="Batch size of random inputs (default 1; padding masks set it from --lengths/--ids).", parser=integer, rich_help_panel=INPUT_PANEL)]
HeadDim = Annotated[int | None, typer.Option(help="Head size D of random inputs (default 8 for attend, 16 for verify).", parser=integer, rich_help_panel=INPUT_PANEL)]
DOut = Annotated[int | None, typer.Option(help="--x: output size of the projections (default d_in); split over --heads.", parser=integer, rich_help_panel=INPUT_PANEL)]
QkvBias = Annotated[bool, typer.Option("--qkv-bias", help="--x: give the projections a bias (nn.Linear(bias=True)).", rich_help_panel=INPUT_PANEL)]
Device = Annotated[str, typer.Option(help="Where to compute: auto (cuda, then mps, then cpu), cpu, cuda, cuda:N or mps.", envvar="MASKCLI_DEVICE", rich_help_panel=COMPUTE_PANEL)]
ComputeDtype = Annotated[str, typer.Option("--dtype", help=f"Compute dtype of every stage: {', '.join(DTYPES)}.", rich_help_panel=COMPUTE_PANEL)]
Scale = Annotated[float | None, typer.Option(help="Multiply the scores by this instead of 1/sqrt(D) (as SDPA's scale does).", rich_help_panel=COMPUTE_PANEL)]
Fill = Annotated[str, typer.Option(help="How masked scores are hidden: -inf (masked_fill, as SDPA), min (finfo(dtype).min, as Hugging Face), -1e9 (older tutorials), multiply (softmax first, then zero masked weights and renormalise).", rich_help_panel=COMPUTE_PANEL)]
Dropout = Annotated[float, typer.Option(help="Dropout probability on the weights (seeded by --seed), 0 to turn it off.", rich_help_panel=COMPUTE_PANEL)]
StagesOpt = Annotated[str, typer.Option("--stages", help="Stages to show, comma-separated: scores, scaled, masked, weights, output.", rich_help_panel=DISPLAY_PANEL)]
BatchIndex = Annotated[int | None, typer.Option(help="Show this batch row only (default: up to 4 (batch, head) pairs in the tables and 8 in --png, head 0 of every batch row first).", parser=integer, rich_help_panel=DISPLAY_PANEL)]
Head = Annotated[int | None, typer.Option(help="Show this head only (default: as for --batch-index).", parser=integer, rich_help_panel=DISPLAY_PANEL)]
Precision = Annotated[int, typer.Option(help="Decimals in the tables.", parser=integer, rich_help_panel=DISPLAY_PANEL)]
FigurePng = Annotated[str | None, typer.Option("--png", help="Write a figure: rows = heads, columns = stages; .png, .svg or .pdf.", rich_help_panel=DISPLAY_PANEL)]
StagesJson = Annotated[bool, typer.Option("--json", help="Print every stage as nested lists (non-finite values as \"nan\", \"inf\", \"-inf\"), with the mask and findings.", rich_help_panel=DISPLAY_PANEL)]
Atol = Annotated[float | None, typer.Option(help="Agreement tolerance on max |diff| (default by dtype: float32 1e-5, float16 5e-3, bfloat16 3e-2, float64 1e-10).", rich_help_panel=COMPUTE_PANEL)]
Repeat = Annotated[int, typer.Option(help="Timed calls per backend (the median is shown), after one warm-up call.", parser=integer, rich_help_panel=COMPUTE_PANEL)]
Strict = Annotated[bool, typer.Option("--strict", help="Exit with status 1 when any backend that ran disagrees beyond --atol.", rich_help_panel=DISPLAY_PANEL)]
VerifyJson = Annotated[bool, typer.Option("--json", help="Print the table as one JSON object.", rich_help_panel=DISPLAY_PANEL)]
KeyOpt = Annotated[str | None, typer.Option("--key", help="The tensor's name in a .npz, .safetensors, .pt dict or JSON object.")]
InspectHeads = Annotated[int | None, typer.Option("--heads", help="Your model's head count, to check a 3-D mask against it.", parser=integer)]
ReportJson = Annotated[bool, typer.Option("--json", help="Print the report as one JSON object.")]
