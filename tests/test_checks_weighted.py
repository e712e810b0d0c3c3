"""checks/weighted.py: keys a softmax's mask hides, given weight again after it (a second softmax over the weights, a
term added to them) before the weights reach the values."""

from __future__ import annotations

from pathlib import Path

from checkbugs import check_bug, first, traced

WEIGHTED = Path(__file__).parent / "data" / "weighted"


def test_diskt_second_softmax_over_probabilities(tmp_path):
    """DisKT#2: contradictory_attention() softmaxes the no-peek-masked scores, zeroes the counter-attention cells, then
    softmaxes the probabilities again: every future key gets weight exp(0). The first cell is a double loop's over
    the strictly-past mask's hidden cells, on the rows that mask leaves some key (query 0 sees none)."""
    found = check_bug(tmp_path, "diskt_contradictory_attention_double_softmax_unmasks_future", "unmasked-after-softmax")
    assert tuple(found[0]["cell"]) == first((2, 10, 10), lambda b, q, k: q >= 1 and k >= q)


def test_molecule_attention_transformer_adjacency_added_unmasked(tmp_path):
    """molecule-attention-transformer 23c9cbe: `attn + Lg * adjacency_mat` with the adjacency of the padded atoms
    unmasked (molecule b's 4 atoms padded to 7, near the origin where the pads sit): a real atom attends a padded one."""
    name = "molecule_attention_transformer_adjacency_not_masked_for_padded_atoms"
    status, found, report = traced(tmp_path, name, False)
    hits = [f for f in found if f["code"] == "unmasked-after-softmax" and f["severity"] == "wrong"]
    assert status == 1 and hits, report
    assert tuple(hits[0]["cell"]) == (1, 0, 4)
    assert "padding key" in hits[0]["message"]
    # the fix masks the adjacency; its head still pools `x.mean(dim=-2)` over every atom, molecule b's 3 padded ones
    # among them (true of the upstream code at the fix: its prediction changes with the padded length)
    status, found, report = traced(tmp_path, name, True)
    wrong = [f for f in found if f["severity"] == "wrong"]
    assert [f["code"] for f in wrong] == ["mean-over-padding"], report
    assert "batch row 1: a mean over axis 1 of a (2, 7, 16) tensor averages all 7 positions, the padding at " \
           "positions 4, 5, 6" in " ".join(wrong[0]["message"].split())


def test_sharpened_weights_second_softmax_padded_batch(tmp_path):
    """Written another way: a set encoder over a right-padded batch (the lowest value filled), `(attn /
    temperature).softmax(-1)` over the probabilities; the first padded key of batch row 1 (5 of 7 real)."""
    found = check_bug(tmp_path, "sharpened_weights_second_softmax_padded", "unmasked-after-softmax", WEIGHTED)
    assert tuple(found[0]["cell"]) == first((2, 7, 7), lambda b, q, k: b == 1 and q < 5 and k >= 5)


def test_recency_prior_added_after_causal_softmax(tmp_path):
    """Written another way: (B * H, T, T) bmm scores, a -inf causal fill, then a distance prior over every key mixed
    into the weights: each token reads later ones (a double loop over torch.tril's hidden cells)."""
    found = check_bug(tmp_path, "recency_prior_added_after_causal_softmax", "unmasked-after-softmax", WEIGHTED)
    assert tuple(found[0]["cell"]) == first((4, 6, 6), lambda b, q, k: k > q)
    assert "later key" in found[0]["message"]


def test_pykt_sparsekt_topk_resoftmax_of_first_rows(tmp_path):
    """pykt-toolkit b602c92 ("fix sparsekt"): sparseKT's top-k attention sliced the masked softmax's weights into the
    first k_index (5) rows and the rest, thresholded the rest at their k-th largest weight, joined the two along the
    queries and softmaxed all of it again: the first rows' hidden keys (the strictly-past no-peek mask hides key k >= q)
    got weight exp(0). The fix re-softmaxes only the rows after k_index (a slice of the weights' rows: quiet, its
    thresholded keys all among the ones the first softmax kept). The reference: the first cell, by a double loop, of a
    row before k_index that the mask leaves some key (query 0 sees none) and a key at or after the query."""
    found = check_bug(tmp_path, "pykt_sparsekt_topk_resoftmax_unmasks_future_for_first_rows", "unmasked-after-softmax")
    k_index = 5
    assert tuple(found[0]["cell"]) == first((4, 24, 24), lambda b, q, k: 1 <= q < k_index and k >= q)
    assert "runs over the weights of an earlier softmax" in found[0]["message"]


def test_early_rows_resoftmaxed_bmm_right_padded(tmp_path):
    """Written another way: (B * H, L, L) bmm scores of a right-padded batch, a causal mask with the diagonal and the
    padding added as -inf, the sizes in a dataclass; the dense rows (before 3) joined to the top-k rows and softmaxed
    again. The reference: batch row b of the folded scores is sample b // 2, a key hidden where it is later or padding."""
    found = check_bug(tmp_path, "early_rows_resoftmaxed_bmm_right_padded", "unmasked-after-softmax", WEIGHTED)
    lengths, dense_rows = (8, 6, 5), 3
    hidden = lambda b, q, k: k > q or k >= lengths[b // 2]  # noqa: E731
    assert tuple(found[0]["cell"]) == first((6, 8, 8), lambda b, q, k: q < dense_rows and hidden(b, q, k))
