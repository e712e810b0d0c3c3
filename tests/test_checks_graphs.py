"""checks/graphs.py (and trace/held.py's PyG batch vector): attention over a mini-batch of graphs concatenated node
after node, against the graph each node is of."""

from __future__ import annotations

from pathlib import Path

from checkbugs import check_bug, first, traced

GRAPHS = Path(__file__).parent / "data" / "graphs"


def test_grapharna_block_mask_inverted(tmp_path):
    """GraphaRNA#10: same-structure cells set to True = masked in nn.TransformerEncoder's bool mask."""
    hits = check_bug(tmp_path, "grapharna_sequence_structure_block_mask_inverted", "graphs-leak")
    graph = [0, 0, 0, 0, 0, 1, 1, 1]
    assert tuple(hits[0]["cell"]) == (0, *first((1, 8, 8), lambda _, q, k: graph[q] != graph[k])[1:])


def test_molecules_concatenated_without_block_mask(tmp_path):
    """Written another way: `batch_index` from repeat_interleave, SDPA over (1, H, N, N) with no mask at all; the first
    cell is a double loop's over the molecules (a node that sees another molecule's node). Its fix (a -inf block mask)
    is quiet."""
    status, found, report = traced(tmp_path, "molecules_concatenated_without_block_mask", False, GRAPHS)
    assert status == 1, report
    hit = next(f for f in found if f["code"] == "graphs-leak")
    assert hit["severity"] == "wrong"
    graph = [0] * 3 + [1] * 4 + [2] * 2
    assert tuple(hit["cell"]) == first((1, 9, 9), lambda _, q, k: graph[q] != graph[k])
    status, found, report = traced(tmp_path, "molecules_concatenated_without_block_mask", True, GRAPHS)
    assert status == 0 and [f for f in found if f["severity"] == "wrong"] == [], report
