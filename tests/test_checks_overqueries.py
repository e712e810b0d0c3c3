"""checks/overqueries.py (and trace/overqueries.py, which reads a softmax over the query axis of scores whose fill
masks whole key columns): a key mask cancelled by a softmax over the queries."""

from __future__ import annotations

from pathlib import Path

from checkbugs import check_bug, first, traced

OVER = Path(__file__).parent / "data" / "overqueries"
CODE = "mask-cancelled-over-queries"


def test_pyg_graph_multiset_transformer_softmax_over_seeds(tmp_path):
    """pyg-team/pytorch_geometric#6343: the old GMT's MAB adds to_dense_batch's -1e9 bias (B*H, 1, nodes) to its
    (B*H, seeds, nodes) scores and takes torch.softmax(mask + score, 1), over the seeds; A.bmm(V) sums the nodes."""
    found = check_bug(tmp_path, "pyg_graph_multiset_transformer_masked_softmax_over_seeds", CODE)
    sizes, heads, seeds, nodes = [5, 12, 8, 20], 4, 3, 20
    # the scores' rows are torch.cat(Q.split(dim_split, 2), dim=0): head-major, row = head * 4 + graph; a node past its
    # graph's size is padding, and every seed takes weight from it
    assert found[0]["cell"] == list(first((heads * len(sizes), seeds, nodes),
                                          lambda r, q, k: k >= sizes[r % len(sizes)]))
    assert "softmax runs over the queries (dim 1)" in found[0]["message"]
    assert "a matmul (weights @ values) sums them" in found[0]["message"]


def test_perceiver_latents_softmax_over_latents(tmp_path):
    """Written another way: a Perceiver's latents cross-attend left-padded inputs (b=3, h=2, 4 latents, 9 inputs),
    masked_fill over (b, 1, 1, inputs), sim.softmax(dim=-2) over the latents, einsum "bhij,bhjd->bhid"."""
    found = check_bug(tmp_path, "perceiver_latents_masked_softmax_over_latents", CODE, OVER)
    lengths, latents, inputs = [9, 6, 3], 4, 9
    assert found[0]["cell"] == list(first((len(lengths), latents, inputs),
                                          lambda b, q, k: k < inputs - lengths[b]))
    assert "batch row 1, head 0" in found[0]["message"]
    assert "einsum 'bhij,bhjd->bhid' sums them" in found[0]["message"]


def test_slot_attention_and_dual_softmax_quiet(tmp_path):
    """Slot Attention's softmax over the slots, its padded inputs zeroed by a 0/1 mask and renormalised before the
    product; LoFTR's dual softmax, two softmaxes multiplied, no product with values: neither is said."""
    status, found, report = traced(tmp_path, "slot_attention_and_dual_softmax_padded_correct", False, OVER)
    assert status == 0, report
    assert [f for f in found if f["severity"] in ("wrong", "suspicious") or f["code"] == CODE] == [], report
