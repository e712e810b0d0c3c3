"""A window attention's relative-position index that gives two different offsets of its window one bias row.

Swin-style window attention adds to each pair of tokens the bias of their offset: a table of one row per offset,
prod(2 * w - 1) rows for a window of sides w, read through `relative_position_index`. Where the module sizes its table
so and its own index sends two different offsets to one row (trace/relindex.py), the bias its logits get is not the
offset's the table states: nnFormer's WindowAttention_kv strided its 3-D offsets by (3 * Wh - 1, 2 * Wh - 1, 1), not
((2 * Wh - 1) * (2 * Ww - 1), 2 * Ww - 1, 1) (282857341/nnFormer#88). Quiet where each offset has a row of its own, in
any order, and where the table holds fewer rows than offsets (a clipped distance shares rows by design).
"""

from __future__ import annotations

from maskcli.checks.context import Run
from maskcli.checks.registry import Rule
from maskcli.checks.swin import window_findings
from maskcli.text import Finding


def index_collides(run: Run) -> list:
    return window_findings(run, "index", _finding)


def _finding(index: dict) -> Finding:
    window, (one, two), (a, b) = index["window"], index["pairs"], index["apart"]
    sides = " x ".join(str(w) for w in window)
    return Finding("relative-index-collides", (
        f"the module's bias table holds {index['rows']} rows, one for each of the {index['offsets']} offsets of its "
        f"{sides} window, but its relative_position_index uses {index['used']}: token {one[0]} to token {one[1]} "
        f"(offset {a}) and token {two[0]} to token {two[1]} (offset {b}) read one row, {index['row']}, so different "
        f"offsets get one bias (the index's strides are not the table's: (2 * w - 1) per axis)"),
        expected=f"one row of relative_position_bias_table per offset ({index['offsets']})",
        source=f"relative_position_bias_table ({index['rows']} rows), window_size={tuple(window)}",
        cell=(0, one[0], one[1]))


RULES = (
    Rule("relative-index-collides", "wrong", "call", "a window attention's relative_position_index that sends two "
         "different offsets of its window to one row of a bias table sized one row per offset (nnFormer's 3-D "
         "strides)", index_collides),
)
