"""trace/pairedids.py: a held decoder_attention_mask goes with the decoder_input_ids held beside it."""

from __future__ import annotations

import torch

from maskcli.trace.pairedids import other_tokens

MASK = torch.tensor([[1, 1, 1, 1], [0, 1, 1, 1]])
IDS = torch.tensor([[1, 11, 12, 13], [0, 1, 14, 15]])


def test_other_tokens_of_the_masks_width_are_another_sequence():
    assert other_tokens("decoder_attention_mask", MASK, {"decoder_input_ids": IDS},
                        {"decoder_input_ids": torch.tensor([[1, 5, 6, 7], [1, 5, 6, 8]])})


def test_the_same_ids_their_prefix_or_their_last_token_are_the_masks():
    held = {"decoder_input_ids": IDS}
    for handed in (IDS, IDS.clone(), IDS[:, :2], IDS[:, -1:], torch.cat([IDS, IDS[:, :1]], 1)):
        assert not other_tokens("decoder_attention_mask", MASK, held, {"decoder_input_ids": handed})


def test_nothing_said_without_the_pair_of_the_masks_shape_or_for_other_masks():
    handed = {"decoder_input_ids": torch.tensor([[1, 5, 6, 7], [1, 5, 6, 8]])}
    assert not other_tokens("decoder_attention_mask", MASK, {}, handed)
    assert not other_tokens("decoder_attention_mask", MASK, {"decoder_input_ids": IDS[:, :3]}, handed)
    assert not other_tokens("frame_mask", MASK, {"decoder_input_ids": IDS}, handed)
    assert not other_tokens("decoder_attention_mask", MASK, {"decoder_input_ids": IDS}, {})


def test_inner_other_reads_the_ids_of_the_function_nearest_the_call():
    """The innermost frame holding `decoder_input_ids` decides: the loop's own tokens (other), the batch's (the same)."""
    import sys
    from maskcli.trace.pairedids import inner_other

    def frame_holding(decoder_input_ids):
        return sys._getframe()

    batch = {"decoder_input_ids": IDS, "decoder_attention_mask": MASK}
    loop = torch.tensor([[1, 5, 6, 7], [1, 5, 6, 8]])
    assert inner_other("decoder_attention_mask", MASK, batch, [(frame_holding(loop), ())])
    assert not inner_other("decoder_attention_mask", MASK, batch, [(frame_holding(IDS), ())])
    assert not inner_other("decoder_attention_mask", MASK, batch, [])
