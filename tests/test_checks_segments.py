"""checks/segments.py: a padded batch attended one sequence per call over fewer tokens than the rows' real ones, the
real tokens counted here by a loop over the program's own padding."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np

from checkbugs import ROWS, caught, check_bug, traced
from maskcli.checks.context import Run, Top
from maskcli.checks.segments import cut_segments

SEGMENTS = Path(__file__).parent / "data" / "segments"


def test_whisper_flash_attention2_mask_sliced_to_num_heads(tmp_path):
    """transformers#36477: the (B, L) decoder mask sliced to key_states.shape[-2] = 4 heads, so the varlen segments
    are rows of 4 where the padding says 8 and 6."""
    [hit, *_] = check_bug(tmp_path, "whisper_flash_attention2_mask_truncated_to_num_heads", "segments-cut")
    assert "over [4, 4] tokens" in hit["message"] and "rows [8, 6] real tokens" in hit["message"]


def test_lengths_from_ids_whose_pad_is_eos_drop_each_real_eos(tmp_path):
    """Written another way: three rows, pad id = EOS, lengths `input_ids.ne(EOS).sum(-1)`, a loop of causal SDPA
    calls over the packed tokens; the real tokens are the collator's attention_mask's, counted here."""
    mask = [[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0], [1, 1, 1, 0, 0, 0]]
    ids = [[5, 6, 7, 8, 9, 2], [5, 7, 9, 2, 2, 2], [6, 8, 2, 2, 2, 2]]
    real = [sum(1 for m in row if m) for row in mask]
    pieces = [sum(1 for t in row if t != 2) for row in ids]
    status, found, report = traced(tmp_path, "packed_lengths_from_ids_drop_eos", False, SEGMENTS)
    assert status == 1, report
    hits = [f for f in found if f["code"] == "segments-cut" and f["severity"] == "wrong"]
    assert hits and f"over {pieces} tokens" in hits[0]["message"] and f"rows {real} real tokens" in hits[0]["message"]
    status, found, report = traced(tmp_path, "packed_lengths_from_ids_drop_eos", True, SEGMENTS)
    assert status == 0 and [f for f in found if f["severity"] == "wrong"] == [], report


def run_of(pieces: list[int], mask: np.ndarray) -> Run:
    held = {"name": "attention_mask", "where": "forward()", "kind": "keep", "rows": mask.astype(bool)}
    calls = [SimpleNamespace(index=i, where="attn", api="sdpa", step=i, shape=(1, 2, n, n),
                             details={"held_padding": [held]}) for i, n in enumerate(pieces)]
    return Run(calls, [Top("Model", first=0, end=len(pieces), shapes=(("attention_mask", tuple(mask.shape)),))])


def test_quiet_on_whole_rows_the_wrong_count_and_no_padding():
    """Each row's real tokens: quiet. Each padded row whole (causal over right padding): quiet. Pieces as many as
    some other count, or a mask that pads no row: quiet. A row's real tokens cut: found, on every call."""
    mask = np.array([[1, 1, 1, 1], [1, 1, 0, 0]])
    assert cut_segments(run_of([4, 2], mask)) == []
    assert cut_segments(run_of([4, 4], mask)) == []
    assert cut_segments(run_of([2, 2, 2], mask)) == []
    assert cut_segments(run_of([2, 2], np.ones((2, 4)))) == []
    found = cut_segments(run_of([3, 3], mask))
    assert [f.code for _, f in found] == ["segments-cut"] * 2 and found[0][1].cell == (0, 3, 3)


def test_a_reference_run_of_one_sequence_whose_model_call_holds_no_batch_row_is_quiet():
    """gpt-neox's stream_tokens (written blind, quiet-r165b; segments-cut before): its reference runs one prompt alone
    through a loop over the layers, 3 calls of one length, while main() holds the batch's lengths [5, 9, 7]. The model
    call that made them was handed no tensor of the batch's 3 rows: they are one sequence's layers, not its rows."""
    mask = np.array([[1] * 5 + [0] * 4, [1] * 9, [1] * 7 + [0] * 2])
    run = run_of([5, 5, 5], mask)
    assert cut_segments(run) != []  # (a model call handed the (3, 9) batch: its rows cut)
    one = Run(run.calls, [Top("Model", first=0, end=3, shapes=(("hidden", (1, 5, 32)),))])
    assert cut_segments(one) == []


def test_varlen_lengths_made_from_the_first_row_leave_the_longer_rows_tail_unattended(tmp_path):
    """Written another way (tests/data/segments): a BERT-style encoder unpads a right-padded batch by its
    attention_mask but repeats the first row's length for every row, so a varlen stand-in covers 2 x 3 tokens of the
    3 + 6 real ones. Found on both readings (the per-sequence calls, and the documents against the model call's mask);
    the fix's lengths are each row's."""
    [hit, *_] = check_bug(tmp_path, "encoder_varlen_lengths_from_first_row", "segments-cut", SEGMENTS)
    assert "over [3, 3] tokens" in hit["message"] and "rows [3, 6] real tokens" in hit["message"]


def test_fastvideo_clip_causal_mask_read_as_key_padding_runs_one_token(tmp_path):
    """hao-ai-lab/FastVideo cceacec99 (written blind, blind-kk): the (1, 1, S, S) causal mask's first query row read as
    a key padding mask keeps one key, so the varlen kernel runs over 1 token where the ids (pad id 0) hold 7 + 5; the
    fix hands flash_attn_func causal=True under SDPAMetadata(is_causal=True), beside a config that says is_causal=False
    (the metadata's word, nearer the call, speaks: no bidirectional-run-causal)."""
    ids = [[62, 11, 23, 5, 40, 17, 63] + [0] * 5, [62, 9, 31, 2, 63] + [0] * 7]
    real = [sum(1 for t in row if t != 0) for row in ids]
    [hit] = check_bug(tmp_path, "fastvideo_mmaudio_clip_causal_mask_read_as_key_padding_flash", "segments-cut")
    assert f"holds {sum(real)} real tokens ({real[0]}, {real[1]} a row" in hit["message"]
    assert "ran over 1 token (cu_seqlens [0, 1]" in hit["message"] and tuple(hit["cell"]) == (0, 1, 0)


def run_of_documents(cu: list[int], mask: list[list[int]], given: tuple | None = None) -> Run:
    mask = np.array(mask)
    call = SimpleNamespace(index=0, where="layers.0.attn", api="sdpa", step=0, shape=(1, 2, cu[-1], cu[-1]),
                           details={"documents": {"cu_seqlens": np.array(cu)}, "query_input": given or mask.shape})
    return Run([call], [Top("Model", arguments={"attention_mask": mask}, first=0, end=1)])


def test_documents_are_judged_against_the_real_tokens_a_loop_counts():
    """Documents that cover every real token (a row each, or packed otherwise) are quiet, as is a layer handed another
    shape than the mask's (a decode step); fewer are found, at the first real token past them, by a loop."""
    from maskcli.checks.segments import uncovered

    mask = [[1, 1, 0, 0], [1, 1, 1, 1]]
    assert uncovered(run_of_documents([0, 2, 6], mask), set()) == []
    assert uncovered(run_of_documents([0, 3, 6], mask), set()) == []
    assert uncovered(run_of_documents([0, 2, 4], mask, (2, 1)), set()) == []
    assert uncovered(run_of_documents([0, 2, 4], mask), {0}) == []
    [(_, finding)] = uncovered(run_of_documents([0, 2, 4], mask), set())
    flat = [(b, q) for b in range(2) for q in range(4) if mask[b][q]]
    assert finding.code == "segments-cut" and finding.cell == (*flat[4], 0)
    assert "2 real tokens attend nothing" in finding.message


def test_lobster_flash_cu_seqlens_count_rows_at_their_padded_length(tmp_path):
    """prescient-design/lobster#105 (written blind, batch blind-la): UME's flash path flattened the padded batch and
    set cu_seqlens = [0, L, 2L, ...], so each protein's residues attended its own pads (the flash stand-in a loop of one
    softmax per document). The fix unpads first: its documents hold only real tokens."""
    found = check_bug(tmp_path, "lobster_ume_flash_embed_cu_seqlens_span_padding", "documents-span-padding")
    assert "document 1 of cu_seqlens [0, 24, 48, 72, 96] holds 12 tokens that attention_mask" in \
        " ".join(found[0]["message"].split())


def test_flat_encoder_one_block_diagonal_call_over_padded_documents(tmp_path):
    """Written another way: one SDPA call over the flat batch with a block-diagonal mask from cu_seqlens [0, 6, 12,
    18], rows of 6, 3 and 4 real tokens: the second sentence's token 6 attends its pad 9. The fix's documents are the
    real lengths."""
    hit = caught(tmp_path, "flat_encoder_cu_seqlens_at_padded_length", ("documents-span-padding",))
    assert tuple(hit["cell"]) == (0, 6, 9)
    assert "holds 3 tokens that attention_mask of FlatEncoder states are padding" in " ".join(hit["message"].split())


def test_causal_documents_whose_padding_follows_their_tokens_are_quiet(tmp_path):
    """The same collator under causal layers: a right-padded row's pads come after its real tokens, so no real token
    attends one (only pads see pads). Quiet on both runs."""
    for fixed in (False, True):
        status, found, report = traced(tmp_path, "flat_encoder_cu_seqlens_at_padded_length", fixed, ROWS, ("--causal",))
        assert status == 0 and not [f for f in found if f["code"] == "documents-span-padding"], report


def test_gemma2_flash_sliding_layer_slices_the_prefill_mask(tmp_path):
    """huggingface/transformers#32522 (written blind, batch blind-ld): Gemma 2's flash path cut the padding mask to its
    last sliding_window columns with no cache, so the sliding layer unpadded rows of 12 and 9 tokens with a (2, 4)
    mask: one call per row over 4 and 1 tokens (the flash stand-in puts the heads on the batch axis)."""
    name = "transformers_gemma2_fa2_sliding_layer_slices_prefill_mask"
    status, found, report = traced(tmp_path, name, False)
    cut = [f for f in found if f["code"] == "segments-cut" and f["severity"] == "wrong"]
    assert status == 1 and cut, report
    assert "over [4, 1] tokens" in cut[0]["message"] and "[12, 9] real tokens" in " ".join(cut[0]["message"].split())
    # the fix as 4.44.2 shipped it hands flash window_size=(W, W): one key too many, transformers#39408's, true
    status, fixed, report = traced(tmp_path, name, True)
    assert {f["code"] for f in fixed if f["severity"] == "wrong"} == {"window-off-by-one"}, report


def test_a_row_loop_whose_sliding_layer_unpads_with_its_windowed_mask(tmp_path):
    """Written another way: a loop over batch rows (heads on the loop's batch axis) whose sliding layer takes each
    row's length from `attention_mask[:, -window:]`: rows of 10 and 7 tokens run over 4 and 1. The fix unpads with the
    whole mask."""
    hit = caught(tmp_path, "per_row_loop_lengths_from_windowed_mask", ("segments-cut",))
    assert "over [4, 1] tokens" in hit["message"] and "[10, 7] real tokens" in " ".join(hit["message"].split())


BLIND = Path(__file__).parent / "data" / "blind"


def test_transformer_engine_padding_mask_true_counted_as_tokens(tmp_path):
    """NVIDIA/TransformerEngine#818 (written blind, blind-ps, caught after tuning): the flash backend read its
    True = padding mask as the tokens (`mask.sum(dim=1)`), so the varlen documents are each row's padding, 0 + 2 + 4
    tokens where the batch's lengths, held in main(), say 6 + 4 + 2; the layer is handed only a (B, 1, 1, L) mask,
    which states no padding the model call can be read by."""
    lengths, width = [6, 4, 2], 6
    [hit, *_] = check_bug(tmp_path, "transformer_engine_flash_padding_mask_true_counted_as_tokens", "segments-cut", BLIND)
    documents = ", ".join(str(width - n) for n in lengths)
    assert f"documents of {documents}" in hit["message"] and f"holds {sum(lengths)} real tokens" in hit["message"]
    assert "by lengths in main()" in hit["message"] and "read the wrong way round" in hit["message"]


def test_a_key_padding_mask_counted_as_tokens_on_a_left_padded_batch(tmp_path):
    """Written another way (tests/data/segments): `key_padding_mask` (B, 1, 1, L) of a left-padded batch, its lengths
    held as `seq_lens`, a loop of SDPA calls standing for the varlen kernel; the documents are the padding's."""
    seq_lens, width = [5, 3, 4], 5
    [hit, *_] = check_bug(tmp_path, "unpad_key_padding_mask_counted_as_tokens", "segments-cut", SEGMENTS)
    pads = [width - n for n in seq_lens]
    assert f"ran over {sum(pads)} tokens" in hit["message"] and f"holds {sum(seq_lens)} real tokens" in hit["message"]
    assert "by seq_lens in main()" in hit["message"]


def test_gpt_neox_stream_tokens_reference_layers_are_not_rows_cut(tmp_path):
    """The program behind the unit test above (tests/data/quiet_blind, quiet-r165b): quiet."""
    status, found, report = traced(tmp_path, "quiet_gpt_neox_stream_tokens_right_padded_layer_past_min_context_start",
                                   False, Path(__file__).parent / "data" / "quiet_blind")
    assert status == 0 and not [f for f in found if f["code"] == "segments-cut"], report
