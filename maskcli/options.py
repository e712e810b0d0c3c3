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


KIND_LIST = "\n\n".join(f"[bold]{kind}[/bold]: {text}" for kind, text in KINDS.items())
MASK_PANEL = "Mask options"
OUTPUT_PANEL = "Output"

Len = Annotated[int | None, typer.Option("--len", "-n", help="Number of query positions (default 8, or the longest --lengths).", parser=integer, rich_help_panel=MASK_PANEL)]
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
Dtype = Annotated[str, typer.Option(help=f"Float dtype for the additive and min conventions: {', '.join(DTYPES)}.", rich_help_panel=OUTPUT_PANEL)]
Png = Annotated[str | None, typer.Option("--png", help="Write a heatmap; the extension picks the format: .png, .svg or .pdf.", rich_help_panel=OUTPUT_PANEL)]
Json = Annotated[bool, typer.Option("--json", help="Print one JSON object: kind, params, shape, q_offset, convention and the mask as nested 0/1 lists (1 = may attend).", rich_help_panel=OUTPUT_PANEL)]
Save = Annotated[str | None, typer.Option(help="Save the mask tensor in the --as convention; .pt or .npy by extension.", rich_help_panel=OUTPUT_PANEL)]


