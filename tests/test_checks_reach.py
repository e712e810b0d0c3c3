"""checks/reach.py (and trace/stated.py's `model_causal`): a causal model's query that reads a later token through a
key it sees."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from checkbugs import check_bug, first, traced

REACH = Path(__file__).parent / "data" / "reach"


def test_recurrent_memory_transformer_pads_memories_true(tmp_path):
    """recurrent-memory-transformer-pytorch cdff28a: tokens see the write memories, which see the whole segment."""
    check_bug(tmp_path, "recurrent_memory_transformer_custom_causal_mask_pads_memories_true", "causal-leak-through")


def test_summary_tokens_visible_to_causal_tokens(tmp_path):
    """Written another way: `is_causal = True`, summary tokens appended after 5 tokens, nn.MultiheadAttention's bool
    mask (True = masked); the first cell is a double loop's (q masked from a later j that a key q sees itself sees)."""
    status, found, report = traced(tmp_path, "summary_tokens_visible_to_causal_tokens", False, REACH)
    assert status == 1, report
    hit = next(f for f in found if f["code"] == "causal-leak-through")
    assert hit["severity"] == "wrong"
    n, size = 5, 7
    sees = np.tril(np.ones((size, size), dtype=bool))
    sees[n:, :] = True
    sees[:, n:] = True
    assert tuple(hit["cell"]) == first((1, size, size), lambda _, q, j: j > q and not sees[q, j]
                                       and any(sees[q, k] and sees[k, j] for k in range(size)))
    status, found, report = traced(tmp_path, "summary_tokens_visible_to_causal_tokens", True, REACH)
    assert status == 0 and [f for f in found if f["severity"] == "wrong"] == [], report


def _look_ahead_leak(sees, size: int):
    """The reference of look-ahead-open over one plane `sees(q, k)`: q sees every key up to its own and not q + 1, and
    a later key k it sees sees a later j that q does not."""
    def bad(_, q, j):
        return (q + 1 < size and all(sees(q, k) for k in range(q + 1)) and not sees(q, q + 1) and j > q
                and not sees(q, j) and any(k > q and sees(q, k) and sees(k, j) for k in range(size)))
    return bad


def test_doctr_master_tgt_mask_keeps_padding_visible(tmp_path):
    """doctr#546: `~eq(target, pad) & look_ahead` handed as nn.TransformerDecoderLayer's tgt_mask (True = masked): the
    trailing `<pad>` keys open to every query, and their rows see the whole word; the first cell is a double loop's."""
    hit = check_bug(tmp_path, "doctr_master_tgt_mask_keeps_padding_visible", "look-ahead-open")[0]
    real = 7  # <sos>, five letters, <eos>; then three <pad>
    assert tuple(hit["cell"]) == first((2, 10, 10), _look_ahead_leak(lambda q, k: k <= q or k >= real, 10))


def test_doctr_master_pytorch_port_padding_polarity_inverted_written_blind(tmp_path):
    """mindee/doctr#546 again (commit d82a4bc, written blind, batch blind-db): `~eq(target, PAD) & look_ahead` as the
    bool tgt_mask of nn.TransformerDecoderLayer, three words of 3 letters padded to 12; the first cell is a double
    loop's."""
    hit = check_bug(tmp_path, "doctr_master_pytorch_tgt_mask_padding_polarity_inverted", "look-ahead-open")[0]
    real = 5  # <sos>, three letters, <eos>; then seven <pad>
    assert tuple(hit["cell"]) == first((3, 12, 12), _look_ahead_leak(lambda q, k: k <= q or k >= real, 12))


def test_causal_or_padding_keep_mask(tmp_path):
    """Written another way: SDPA's keep mask (True = may attend) built `causal | is_pad` over a right-padded batch of
    three lengths, three layers; the first cell is a double loop's over the rows' padding."""
    status, found, report = traced(tmp_path, "sdpa_causal_or_padding_keep_mask", False, REACH)
    assert status == 1, report
    hit = next(f for f in found if f["code"] == "look-ahead-open")
    assert hit["severity"] == "wrong"
    lengths = [6, 3, 4]
    cells = [_look_ahead_leak(lambda q, k, n=n: k <= q or k >= n, 6) for n in lengths]
    assert tuple(hit["cell"]) == first((3, 6, 6), lambda b, q, j: cells[b](b, q, j))
    status, found, report = traced(tmp_path, "sdpa_causal_or_padding_keep_mask", True, REACH)
    assert status == 0 and [f for f in found if f["severity"] == "wrong"] == [], report


def test_float_per_head_look_ahead_anded_with_real_keys(tmp_path):
    """Written another way than doctr#546: a float (B * heads, L, L) attn_mask of nn.MultiheadAttention, -inf where a
    key is later and real (`future & ~is_pad`), right-padded rows of 8, 5 and 6 tokens, two layers; the first cell is a
    double loop's over the rows' padding."""
    hit = check_bug(tmp_path, "mha_float_look_ahead_and_real_keys_per_head", "look-ahead-open", REACH)[0]
    cells = [_look_ahead_leak(lambda q, k, n=n: k <= q or k >= n, 8) for n in (8, 5, 6)]
    assert tuple(hit["cell"]) == first((3, 8, 8), lambda b, q, j: cells[b](b, q, j))


def test_quiet_on_persistent_memory_that_reads_no_token(tmp_path):
    """Learned memory slots after the tokens, which every token reads and which read only each other: no token reaches a
    later one through them (either form of the mask)."""
    for fixed in (False, True):
        status, found, report = traced(tmp_path, "persistent_memory_after_tokens", fixed, REACH)
        assert status == 0 and [f for f in found if f["severity"] == "wrong"] == [], report


def test_a_neighbour_set_per_row_is_no_look_ahead_mask_with_columns_opened():
    """quiet-yg's MTR (written blind, correct): each token attends its 5 nearest tokens of the scene, so query 0 sees
    itself and keys 2-4, 6, and query 1 sees 0-1, 3-4, 8: rows that look like a look-ahead row's, but whose later keys
    differ row by row. A look-ahead mask with padding columns opened keeps those columns open to every such row."""
    from maskcli.checks.reach import ahead_leaks

    length = 10
    knn = np.zeros((1, length, length), dtype=bool)
    for q, keys in enumerate([(0, 2, 3, 4, 6), (0, 1, 3, 4, 8), (1, 2, 3, 5, 7), (2, 3, 4, 5, 6), (3, 4, 5, 6, 7),
                              (4, 5, 6, 7, 8), (5, 6, 7, 8, 9), (5, 6, 7, 8, 9), (6, 7, 8, 9, 5), (7, 8, 9, 6, 5)]):
        knn[0, q, list(keys)] = True
    assert not ahead_leaks(knn).any()
    lengths = 7  # a triangle with the 3 trailing pad columns open to every row (doctr#546's mask), by a double loop
    opened = np.array([[[k <= q or k >= lengths for k in range(length)] for q in range(length)]])
    leaks = ahead_leaks(opened)
    assert leaks[0, 0, 1] and not leaks[0, 0, 0]  # query 0 reads token 1 through a pad key whose row sees it
