"""checks/rowsonqueries.py: a (B, Lk) key padding broadcast by the kernel as (Lq, Lk), caught in the published bug's
reproduction (tests/data/bugs) and in a program written another way (tests/data/rowsonqueries), quiet on the fixes, on a
causal mask over right-padded rows of lengths 1 .. B and on a padding whose rows are all equal; the flagged cell against
a double loop over what the broadcast does."""

from __future__ import annotations

from pathlib import Path

import torch

import maskcli
from checkbugs import check_bug, first
from maskcli.checks.registry import severity

ROWSONQUERIES = Path(__file__).parent / "data" / "rowsonqueries"


def _broadcast_cell(real: list[list[int]]):
    """The first (b, q, k) where a real query q of row b sees key k, row b's padding, through row q's padding."""
    n, length = len(real), len(real[0])
    return first((n, n, length), lambda b, q, k: real[b][q] and real[q][k] and not real[b][k])


def test_vivit_temporal_frame_mask_handed_to_sdpa_as_two_d_is_found(tmp_path):
    # lucidrains/vit-pytorch 4c89017 (follow-up to PR #356, blind-ct): the (b, f + 1) temporal mask handed to SDPA
    # unreshaped, b == f + 1 == 3; clip 1 has 1 of its 2 frames real (with the temporal CLS token: 2 of 3 keys)
    found = check_bug(tmp_path, "vit_pytorch_vivit_temporal_mask_2d_to_sdpa_broadcasts_over_queries",
                      "batch-rows-on-queries")
    assert tuple(found[0]["cell"]) == _broadcast_cell([[1, 1, 1], [1, 1, 0], [1, 1, 1]])
    assert "broadcast as (queries, keys)" in found[0]["message"]


def test_keras_attention_two_d_value_mask_bias_unexpanded_is_found(tmp_path):
    # keras-team/keras#21595 (fixes #21483; written blind, batch blind-db): keras.layers.Attention's (B, Tv) value mask
    # turned into a -1e9 bias without expand_dims(axis=-2); right-padded rows of 4, 2, 3 and 1 tokens, B == Tq == 4
    found = check_bug(tmp_path, "keras_attention_2d_value_mask_broadcast_over_query_axis", "batch-rows-on-queries")
    real = [[1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 0], [1, 0, 0, 0]]
    assert tuple(found[0]["cell"]) == _broadcast_cell(real)


def test_a_left_padded_pad_mask_filled_into_eager_scores_unexpanded_is_found(tmp_path):
    # written otherwise: eager masked_fill, left-padded sentences of 2, 3, 4 and 1 tokens, True = padding
    found = check_bug(tmp_path, "left_padded_pad_mask_filled_unexpanded", "batch-rows-on-queries",
                      folder=ROWSONQUERIES)
    real = [[0, 0, 1, 1], [0, 1, 1, 1], [1, 1, 1, 1], [0, 0, 0, 1]]
    assert tuple(found[0]["cell"]) == _broadcast_cell(real)


def test_a_cross_attention_encoder_mask_filled_into_bmm_scores_unexpanded_is_found(tmp_path):
    # written another way than keras#21595: a seq2seq pointer attention's (B, S) encoder_attention_mask (1 = real,
    # sources of 7, 4 and 5 tokens) filled into 3-D bmm scores as it is, B == Tq == 3; decoder step q of sentence b
    # masked with sentence q's source padding (no real-query preference: a cross-attention's queries are not its keys)
    found = check_bug(tmp_path, "cross_attention_encoder_mask_unexpanded_bmm_scores", "batch-rows-on-queries",
                      folder=ROWSONQUERIES)
    real = [[int(k < n) for k in range(7)] for n in (7, 4, 5)]
    assert tuple(found[0]["cell"]) == first((3, 3, 7), lambda b, q, k: real[q][k] and not real[b][k])


def _codes(run) -> list:
    torch.manual_seed(0)
    with maskcli.trace() as t, torch.no_grad():
        run()
    return [(f.code, severity(f)) for group in t.groups() for f in group.findings]


def test_a_causal_mask_over_lengths_one_to_b_and_equal_rows_are_quiet():
    x = torch.randn(3, 2, 3, 8)

    def causal(attention_mask=torch.tensor([[1, 0, 0], [1, 1, 0], [1, 1, 1]])):
        # right-padded rows of 1, 2, 3 tokens: the causal triangle, one plane for every row, is the padding's table
        # too, and is right (no real query sees a later key, so none sees a right pad)
        torch.nn.functional.scaled_dot_product_attention(x, x, x, is_causal=True)
        hidden = torch.ones(3, 3, dtype=torch.bool).triu(1)
        (x @ x.transpose(-1, -2)).masked_fill(hidden, float("-inf")).softmax(-1)

    def equal(attention_mask=torch.tensor([[1, 1, 0], [1, 1, 0], [1, 1, 0]])):
        # every row padded alike: a (B, Lk) mask broadcast over the queries masks each row by its own padding
        (x @ x.transpose(-1, -2)).masked_fill(attention_mask == 0, float("-inf")).softmax(-1)

    assert [c for c in _codes(causal) + _codes(equal) if c[0] == "batch-rows-on-queries"] == []


def test_memformer_memory_update_mask_combined_with_the_batch_padding_in_place(tmp_path):
    """lucidrains/memformer ab3530e (written blind, batch blind-lt; caught once the padding could be combined with a mask
    of the program's own and read behind the memory slots): the memory update's (slots, slots + n) mask `&=`-ed with the
    (batch, slots + n) source padding, batch == slots, so memory slot i of every sample took sample i's padding."""
    found = check_bug(tmp_path, "memformer_memory_update_mask_rows_from_batch_samples", "batch-rows-on-queries")
    assert "batch row 1: query 0 sees key 9, which lengths in main()" in " ".join(found[0]["message"].split())


def test_slot_update_mask_and_padding_combined_in_place(tmp_path):
    """The same slip written another way (tests/data/rowsonqueries): each of 4 slots sees itself and the input tokens,
    the samples' key padding (4 samples, lengths 6, 3, 5, 2 behind the 4 slots) combined in place into that (slots,
    slots + n) mask. The fix lays the padding on each sample's keys."""
    found = check_bug(tmp_path, "latent_slots_update_mask_and_padding_combined_in_place", "batch-rows-on-queries",
                      ROWSONQUERIES)
    b, q, k = found[0]["cell"]
    lengths = [6, 3, 5, 2]
    assert k >= 4 + lengths[b] and q != b  # (a key batch row b pads, seen by a query masked with another row's padding)


def test_flashdeberta_eager_fallback_two_dimensional_mask_on_queries(tmp_path):
    """Knowledgator/FlashDeBERTa#6, fixed by 394604d (written blind, blind-sg, caught before any rule changed for it):
    the encoder's get_attention_mask override handed the eager attention the (B, L) padding unchanged, so its
    masked_fill read it as (queries, keys) against (B, H, L, L) scores, batch == L: query i took sentence i's padding.
    The fix builds the (B, 1, L, L) mask from the 2D one, as DebertaV2Encoder does."""
    found = check_bug(tmp_path, "flashdeberta_eager_fallback_encoder_2d_mask_batched_ner", "batch-rows-on-queries")
    assert tuple(found[0]["cell"]) == (1, 0, 4), found[0]
    assert "a (6, 6) key padding broadcast as (queries, keys)" in " ".join(found[0]["message"].split())
