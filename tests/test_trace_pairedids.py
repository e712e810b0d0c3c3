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


def test_a_step_equal_to_a_column_every_row_holds_alike_is_another_sequence():
    """A greedy loop's first step hands the start token in every row; the training batch's decoder ids begin with it
    too. That column matches any loop, so it says nothing of which tokens the held mask describes."""
    ids = torch.tensor([[0, 5, 21, 8, 1, 0], [0, 35, 13, 46, 28, 38], [0, 36, 1, 0, 0, 0]])
    mask = (ids != 0).long()
    mask[:, 0] = 1
    start = torch.zeros(3, 1, dtype=torch.long)
    assert other_tokens("decoder_attention_mask", mask, {"decoder_input_ids": ids}, {"decoder_input_ids": start})
    # a column whose rows differ still matches its own step: the last token of the held ids
    assert not other_tokens("decoder_attention_mask", mask, {"decoder_input_ids": ids},
                            {"decoder_input_ids": ids[:, -1:].clone()})


def test_encoder_decoders_decoding_beside_a_training_batchs_decoder_mask_are_quiet(tmp_path):
    """quiet-ye (written blind): UMT5 and PEGASUS-X, a teacher-forced batch handed decoder_attention_mask, then
    generate(), a cached greedy loop and each pair alone, none handed it. The decoder ids those calls run are held by
    the model's own forward (T5ForConditionalGeneration's, a library frame: between()) and are not the mask's; a batch
    of one row is no batch of three. Each program checks itself against each pair run alone."""
    from pathlib import Path

    from checkbugs import traced

    folder = Path(__file__).parent / "data" / "quiet_blind"
    for name in ("quiet_umt5_per_layer_relative_bias_padded_sources_cached_greedy",
                 "quiet_pegasus_x_global_local_staggered_blocks_padded_sources"):
        status, found, report = traced(tmp_path, name, False, folder)
        assert status == 0 and [f for f in found if f["severity"] in ("wrong", "suspicious")] == [], report
        assert "\nMATCH\n" in report and "MISMATCH" not in report, report  # (the program's own comparisons)
