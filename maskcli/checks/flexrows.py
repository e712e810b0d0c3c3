"""A BlockMask listing one batch row's blocks for a batch whose rows its mask_mod tells apart (trace/flexrows.py).

`create_block_mask(mask_mod, B=None)` evaluates the mask_mod at b = 0 only: the fused kernel visits row 0's blocks in
every row and never asks the mask_mod about the others. Where the program's own mask_mod, asked at a later row's b,
keeps keys in blocks no list holds, the mask contradicts the program's statement of it: *wrong* (axonn-ai/yalis#53:
the decode BlockMask of `kv_idx <= token_counter[b]` built with B=None, so the 200-token sequence attended only the
first block, as its 5-token neighbour's lists said). Quiet where the BlockMask has a plane per row, where the mask_mod
keeps no more of a later row than row 0's blocks hold (a mask_mod that ignores b), and where row 0's own mask_mod keeps
cells outside its lists (a sparsity the program chose).
"""

from __future__ import annotations

from maskcli.checks.context import Run
from maskcli.checks.registry import Rule
from maskcli.text import Finding


def row_zero_blocks(run: Run) -> list:
    """Flex calls whose one-plane BlockMask skips blocks a later batch row's mask_mod keeps."""
    found, done = [], set()
    for call in run.calls:
        lost = call.details.get("blocks_of_row_0")
        if not isinstance(lost, dict) or call.api != "flex" or (call.mask, call.shape) in done:
            continue
        done.add((call.mask, call.shape))
        name = call.details.get("mask_mod") or "its mask_mod"
        first, last = lost["keys"]
        found.append((call, Finding("block-mask-one-row", (
            f"{call.where}: the BlockMask holds one batch plane (built with B=None or 1) for a batch of {call.shape[0]} "
            f"rows, but its mask_mod {name} reads the row: at b={lost['row']} it keeps keys {first}-{last - 1} "
            f"(its query {lost['query']} keeps key {lost['key']}; {lost['cells']} such cells) in blocks row 0's lists never "
            f"visit, so the fused kernel drops them (build it with B=batch size)"),
            expected=f"{name} at b={lost['row']}", source=f"{name} (the program's mask_mod)",
            cell=(lost["row"], lost["query"], lost["key"]))))
    return found


RULES = (
    Rule("block-mask-one-row", "wrong", "call", "a BlockMask built for one batch row (B=None) whose mask_mod keeps other "
         "rows' keys in blocks it never lists (axonn-ai/yalis#53)", row_zero_blocks),
)
