"""checks/weighted.py: keys a softmax's mask hides, given weight again after it (a second softmax over the weights, a
term added to them) before the weights reach the values."""

from __future__ import annotations

from pathlib import Path

from checkbugs import check_bug, first

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
    found = check_bug(tmp_path, "molecule_attention_transformer_adjacency_not_masked_for_padded_atoms",
                      "unmasked-after-softmax")
    assert tuple(found[0]["cell"]) == (1, 0, 4)
    assert "padding key" in found[0]["message"]


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
