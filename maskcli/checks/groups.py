"""A window or grid attention whose groups are not the gh x gw cells of the map its block states.

A block that states the size of its windows or grid (`grid_window_size`, `grid_size`, `window_size`, `partition_size`:
gh x gw) attends within groups of gh rows by gw columns of its map, contiguous (a window), spaced H / gh and W / gw
apart (MaxViT's grid) or wrapped round the map (a shifted window). trace/groups.py finds each token of the groups the
block's frame holds on its map by its values; a group spread over other rows and columns (one row by gh * gw columns,
two images) puts together tokens that no partition of that size does: the partition's view and permute disagree
(ChristophReich1996/MaxViT#2: `grid_partition` viewed the map as blocks, (B, C, H // g, g, W // g, g), and its groups
were single rows of tokens g apart). Read only on calls whose batch is the groups and whose queries are a group's
tokens; quiet where every group is gh rows by gw columns, in any order.
"""

from __future__ import annotations

from maskcli.checks.context import Run
from maskcli.checks.registry import Rule
from maskcli.checks.swin import window_findings
from maskcli.text import Finding


def misgrouped(run: Run) -> list:
    return window_findings(run, "grouped", _finding,
                           lambda call, grouped: (call.shape[0], call.shape[2]) == (grouped["windows"], grouped["tokens"]))


def _finding(grouped: dict) -> Finding:
    (gh, gw), (h, w) = grouped["size"], grouped["map"]
    cells = ", ".join(f"({r}, {c})" for r, c in grouped["cells"][:8]) + (" ..." if len(grouped["cells"]) > 8 else "")
    return Finding("window-group-shape", (
        f"the block states {grouped['field']}={(gh, gw)}: each group it attends within is {gh} rows by {gw} columns of "
        f"its {h}x{w} map, but group {grouped['group']} holds cells {cells} (row, column): {grouped['rows']} rows by "
        f"{grouped['cols']} columns, tokens no window or grid of that size puts together (the partition's view and "
        f"permute disagree?)"),
        expected=f"groups of {gh} rows by {gw} columns of the map",
        source=f"{grouped['field']}={(gh, gw)} of the block",
        cell=(grouped["group"], 0, 0))


RULES = (
    Rule("window-group-shape", "wrong", "call", "a window or grid attention whose groups are not the rows by columns "
         "of its map the block's own size states (MaxViT's grid partition viewed as blocks)", misgrouped),
)
