"""checks/positionrow.py: real tokens handed the padding row of the model's own learned position table."""

from __future__ import annotations

from pathlib import Path

from checkbugs import check_bug, traced

BLIND = Path(__file__).parent / "data" / "blind"
POSITIONROW = Path(__file__).parent / "data" / "positionrow"


def test_transformers_flattening_collator_positions_from_zero_are_flagged(tmp_path):
    """huggingface/transformers#47496, fixed by #47525 (written blind, blind-rm, missed before this rule): the
    flattening collator numbered each packed sentence from 0 for XLM-R, whose positions count from padding_idx + 1:
    every sentence's second token read the padding row. The fix's `position_ids_start=padding_idx + 1`: quiet."""
    [hit] = check_bug(tmp_path, "transformers_flattening_collator_roberta_position_ids_from_zero",
                      "position-padding-row", BLIND)
    assert "XLMRobertaModel was handed position_ids that put 3 real token(s)" in hit["message"], hit  # (3 sentences)
    assert "`embeddings.position_embeddings` (padding_idx=1" in hit["message"] and "from 2" in hit["message"], hit


def test_sentence_transformers_flattened_positions_held_in_a_batch_dict_are_flagged(tmp_path):
    """huggingface/sentence-transformers#3879 (7bfcf6cb; written blind, blind-rf, missed before this rule): the
    flattened batch's 0-based position_ids reach XLM-R inside the `features` dict the Transformer module is handed.
    The fix adds padding_idx + 1: quiet."""
    [hit] = check_bug(tmp_path, "sentence_transformers_flattened_xlmr_position_ids_from_zero",
                      "position-padding-row", BLIND)
    assert "position_ids (in its argument `features`) that put 4 real token(s)" in hit["message"], hit  # (4 texts)


def test_packed_rows_whose_positions_restart_at_zero_are_flagged(tmp_path):
    # written another way: a hand-written fairseq-style encoder (LearnedPositionalEmbedding, padding_idx 1), two
    # right-padded rows of two packed documents each, real tokens read off the attention_mask
    [hit] = check_bug(tmp_path, "packed_mlm_learned_positions_restart_at_zero", "position-padding-row", POSITIONROW)
    assert "put 4 real token(s) (attention_mask 1) at position 1" in hit["message"], hit  # (2 documents a row)
    assert "table `embed_positions` (padding_idx=1" in hit["message"] and tuple(hit["cell"]) == (0, 1, 1), hit


def test_own_numbering_generate_and_positions_from_the_padding_row_on_are_quiet(tmp_path):
    # LXMERT numbers from 0 itself (none handed); transformers' generate hands RobertaForCausalLM 0-based positions
    # (the library's, not the program's); XLM-R handed positions from padding_idx + 1 with its pads at padding_idx
    status, found, report = traced(tmp_path, "own_numbering_generate_and_offset_positions", False, POSITIONROW)
    assert status == 0 and not [f for f in found if f["code"] == "position-padding-row"], report
