"""A mini-batch of graphs concatenated node after node, whose attention over all its nodes crosses from one graph to
another.

PyG concatenates the nodes of a mini-batch's graphs into one sequence and states which graph each node is of in its
`batch` vector (0, 0, 0, 1, 1, ...; trace/held.py reads it, and `batch_index`, `graph_index`, from the program's own
frames at the call). A self-attention whose keys are exactly those nodes, one batch row, that lets a node see a node
of another graph mixes two samples: each graph's output then depends on what else was batched with it (GraphaRNA#10:
the block mask set to 1 = True = masked within each structure, so every residue attended only the others). Quiet
where each query sees only its own graph's nodes, where the keys are not the nodes (a dense batch from
`to_dense_batch`: B rows of padded graphs), and on a batch of one graph.
"""

from __future__ import annotations

import numpy as np

from maskcli.checks.context import Run, cross, first_cell, keep
from maskcli.checks.registry import Rule
from maskcli.text import Finding


def graphs_leak(run: Run) -> list:
    """Calls over one mini-batch's concatenated nodes whose queries see another graph's nodes."""
    found, done = [], {}
    for call in [*run.calls, *run.unmasked]:  # (a softmax that masks nothing over the nodes: the block mask never built)
        helds = [held for held in call.details.get("held_padding") or () if held["kind"] == "graphs"]
        q_len, k_len = call.shape[2], call.shape[3]
        if not helds or call.stored is None or q_len != k_len or cross(call):
            continue
        key = (call.mask, call.shape, tuple(id(h["rows"]) for h in helds))
        if key not in done:
            done[key] = None
            cells = keep(call)
            for held in helds:
                graph = held["rows"]
                if cells is None or cells.shape[0] != 1 or graph.shape != (k_len,):
                    continue
                seen = cells.any(axis=1)[0]
                across = seen & (graph[:, None] != graph[None, :])
                if not across.any():
                    continue
                q, k = first_cell(across)
                said = f"{held['name']} in {held['where']}"
                only = " and none of its own" if not (seen & (graph[:, None] == graph[None, :])).any() else ""
                done[key] = Finding("graphs-leak", (
                    f"{said} puts these {k_len} nodes in {int(graph.max()) + 1} graphs, but node {q} (graph "
                    f"{int(graph[q])}) sees node {k} of graph {int(graph[k])}{only} ({int(across.sum())} such cells): "
                    f"the mask does not keep each graph to its own nodes (inverted, or never built?)"),
                    expected=f"a block mask from {held['name']}", source=said, cell=(0, q, k))
                break
        if done[key] is not None:
            found.append((call, done[key]))
    return found


RULES = (
    Rule("graphs-leak", "wrong", "call", "a node of a mini-batch of graphs concatenated node after node that sees "
         "another graph's node, the graphs marked by the PyG batch vector the program's own frames hold at the call",
         graphs_leak),
)
