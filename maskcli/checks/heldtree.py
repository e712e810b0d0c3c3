"""A draft tree's attention that is not the tree mask the program hands the function running it.

A speculative verify kernel written in the program (FastDeploy's append attention, a Medusa or SpecInfer tree step) is
handed the draft tree as a (T, T) mask under a name that says so (`tree_mask`, `spec_tree_mask`: trace/namedmasks.py
records it, `named_masks`), node i seeing node j where j is i or one of its ancestors. The T draft tokens are the last
T keys (appended after the cache), and each query of the call is one of them: the draft key it sees last (a node's
ancestors come before it), its queries consecutive nodes (a tile of the rows, or all of them). Over the draft keys,
each query's row must be its node's row of the tree mask; a row that sees a node the mask hides (a sibling, a cousin)
or misses one it shows contradicts the mask the program holds (FastDeploy#3514: `mask_check_iteration` started at
the query tile's causal diagonal, so the KV tiles below it were never masked and a later tile's draft tokens saw
every earlier draft token). The mask is read whichever way round makes every node see itself, lower-triangular (a
tree in topological order); the keys before the draft (the cache) are other rules'. Only the tree mask the nearest
frame was handed is read (trace/namedmasks.py): one a function further out holds is another tree's where a nearer
function was handed its own, in whatever shape (OPT-Tree's verify() holds the tree it verified and drafts the next one,
whose draft model is handed that tree's mask: written blind, quiet-r133a). Left alone: calls whose queries are not consecutive draft nodes, masks that are no tree
in that order, cross-attention.
"""

from __future__ import annotations

import re

import numpy as np

from maskcli.checks.context import Run, first_cell, keep
from maskcli.checks.eachheld import first_findings
from maskcli.checks.registry import Rule
from maskcli.text import Finding

TREE = re.compile(r"tree")  # a token mask named as the draft tree's (tree_mask, spec_tree_mask, tree_attn_mask)


def _tree(rows: np.ndarray) -> np.ndarray | None:
    """Bool (T, T), node i sees node j, of a named (T, T) mask read whichever way round makes it a tree in topological
    order (each node sees itself, none a later one); None where neither way is."""
    if rows.ndim != 2 or rows.shape[0] != rows.shape[1] or rows.shape[0] < 2:
        return None
    for tree in (rows, ~rows):
        if tree.diagonal().all() and not np.triu(tree, 1).any():
            return tree
    return None


def _nodes(draft: np.ndarray) -> np.ndarray | None:
    """Each query row's draft node (the draft key it sees last, over the batch rows), where they are consecutive and
    agree across the rows; None otherwise."""
    seen = draft.any(axis=-1)
    if not seen.all():
        return None
    last = draft.shape[-1] - 1 - np.argmax(draft[..., ::-1], axis=-1)  # (B, Q)
    nodes = last[0]
    if not (last == nodes).all() or not (np.diff(nodes) == 1).all():
        return None
    return nodes


def held_tree(run: Run) -> list:
    """Calls whose queries' rows over the draft keys are not their nodes' rows of the tree mask the program holds."""
    return first_findings(run, "named_masks", lambda call: True, _judged)


def _judged(call, held: dict) -> Finding | None:
    """The finding for `call` against a named mask it holds, None where that is no tree of its draft keys (named so,
    no longer than its keys), or its rows are their nodes' or its queries no nodes."""
    tree = _tree(np.asarray(held["rows"], dtype=bool)) if TREE.search(held["name"]) else None
    if tree is None or tree.shape[0] > call.shape[3]:
        return None
    cells = keep(call)
    t = tree.shape[0]
    if cells is None:
        return None
    draft = cells.any(axis=1)[..., -t:]  # (B, Q, T): over the heads
    nodes = _nodes(draft)
    if nodes is None:
        return None
    differ = draft != tree[nodes][None]
    if not differ.any():
        return None
    b, i, j = first_cell(differ)
    node = int(nodes[i])
    what = "sees" if draft[b, i, j] else "misses"
    kin = "its ancestor" if tree[node, j] else "not its ancestor"
    offset = call.shape[3] - t
    return Finding("tree-mask-not-applied", (
        f"query {i} of batch row {b} (draft node {node}) {what} draft node {j}, {kin} in the tree mask "
        f"`{held['name']}` ({held['where']}) ({int(differ.sum())} such cells): each draft node sees its ancestors "
        f"and itself"),
        expected=f"{held['name']} over the last {t} keys", source=f"{held['name']} in {held['where']}",
        cell=(b, i, offset + j))


RULES = (
    Rule("tree-mask-not-applied", "wrong", "call", "a draft tree's verify attention whose rows over the draft keys are "
         "not their nodes' rows of the (T, T) tree mask the program hands the function running it", held_tree),
)
