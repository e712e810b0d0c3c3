"""checks/batchaxis.py (and trace/tops.py's first_ids, which records a hand-written model's ids): attention along the
batch axis, the call's keys the samples of the model call's padded ids and its batch rows their tokens."""

from __future__ import annotations

from pathlib import Path

from checkbugs import check_bug, first, traced

BATCH = Path(__file__).parent / "data" / "batchaxis"


def test_molecule_generator_batch_first_false(tmp_path):
    """Molecule-Generator#22: nn.TransformerEncoder/DecoderLayer at batch_first=False handed (batch, seq, embed); the ids
    `x` are right-padded with the embedding's padding_idx 4 along their 6 tokens, the calls' 3 keys are the samples."""
    found = check_bug(tmp_path, "molecule_generator_vae_batch_first_false_no_pad_mask", "batch-axis-attended")
    # every token sees the same token of every other sample: the first such cell of a double loop over (token, sample,
    # sample), a sample's own cell left out
    assert tuple(found[0]["cell"]) == first((6, 3, 3), lambda b, q, k: q != k)


def test_batch_first_true_handed_time_major(tmp_path):
    """Written the other way round: batch_first=True layers handed the transpose, the pad id in a config object, the ids
    left-padded and named `tokens`."""
    status, found, report = traced(tmp_path, "batch_first_true_handed_time_major", False, BATCH)
    assert status == 1, report
    hit = next(f for f in found if f["code"] == "batch-axis-attended")
    assert hit["severity"] == "wrong" and "4 samples of `tokens`" in hit["message"]
    assert tuple(hit["cell"]) == first((5, 4, 4), lambda b, q, k: q != k)
    status, found, report = traced(tmp_path, "batch_first_true_handed_time_major", True, BATCH)
    assert status == 0 and [f for f in found if f["severity"] == "wrong"] == [], report


def test_time_major_source_quiet(tmp_path):
    """Time-major `src` padded down its columns, handed (seq, batch, embed) to a batch_first=False layer: correct."""
    status, found, report = traced(tmp_path, "time_major_source_correct", False, BATCH)
    assert status == 0 and [f for f in found if f["code"] == "batch-axis-attended"] == [], report


def test_deeptab_encoder_layer_not_batch_first(tmp_path):
    """OpenTabular/DeepTab commit d2abc5a: the FT-Transformer's nn.TransformerEncoderLayer at batch_first=False handed
    (batch, features, d_model); no ids, but the program runs each of its 3 samples alone (every argument one row of the
    batch's), where the site has 1 key: the batch's 3 keys are its samples, its 5 batch rows the features."""
    found = check_bug(tmp_path, "deeptab_fttransformer_encoder_layer_not_batch_first_attends_across_rows",
                      "batch-axis-attended")
    assert "3 samples given to FTTransformer" in found[0]["message"]
    assert tuple(found[0]["cell"]) == first((5, 3, 3), lambda b, q, k: q != k)


def test_feature_tokens_permuted_to_samples(tmp_path):
    """Written another way: a hand-written feature-token block on SDPA handed its tokens permuted to (features, batch,
    dim), keyword arguments, only sample 2 of 5 run alone (a tensor index)."""
    found = check_bug(tmp_path, "feature_tokens_permuted_to_samples_sdpa", "batch-axis-attended", BATCH)
    assert "5 samples given to TableNet" in found[0]["message"] and "sample 2 alone" in found[0]["message"]
    assert tuple(found[0]["cell"]) == first((7, 5, 5), lambda b, q, k: q != k)


def test_torch_rechub_bst_encoder_batch_axis(tmp_path):
    """datawhalechina/torch-rechub PR #195: BST's nn.TransformerEncoderLayer built without batch_first=True, handed
    (batch, history + target, embed). No ids by a known name and no pad id the embeddings state: the batch dict's
    fields (a user id, a gender and a target item, one value per sample, beside the (16, 50) history) state that 16 is
    the batch; the calls' 16 keys are the samples, their 51 batch rows the history and the target of each."""
    found = check_bug(tmp_path, "torch_rechub_bst_encoder_batch_axis_as_sequence", "batch-axis-attended")
    message = found[0]["message"]
    assert "16 keys are the 16 samples of the fields given to BST" in message and "51 batch rows" in message
    # batch_first=False reads (L, N, E) = (16, 51, 16): batch row b is history slot b of every user, query q and key k
    # are users; a user's own cell (q == k) is the only one the upstream fix (one user's tokens) keeps
    assert tuple(found[0]["cell"]) == first((51, 16, 16), lambda b, q, k: q != k)


def test_time_major_block_handed_batch_first(tmp_path):
    """Written another way: a fairseq-style time-major block on SDPA handed (batch, seq + 1, embed), the features
    handed one by one (user, right-padded history, target), sizes in a dataclass; the fix hands it the transpose."""
    found = check_bug(tmp_path, "time_major_block_handed_batch_first_sdpa", "batch-axis-attended", BATCH)
    message = found[0]["message"]
    assert "6 samples of the fields given to SeqRec" in message and "`user_id` one value per sample" in message
    assert tuple(found[0]["cell"]) == first((10, 6, 6), lambda b, q, k: q != k)
    status, found, report = traced(tmp_path, "time_major_block_handed_batch_first_sdpa", True, BATCH)
    assert [f for f in found if f["severity"] in ("wrong", "suspicious")] == [], report


def test_feature_dict_intersample_quiet(tmp_path):
    """Correct: a batch dict of per-sample features, field attention with as many fields as samples, a time-major
    encoder handed (seq, batch, embed), and SAINT's intersample attention (one row, the samples as keys, on purpose)."""
    status, found, report = traced(tmp_path, "feature_dict_intersample_correct", False, BATCH)
    assert status == 0 and [f for f in found if f["severity"] in ("wrong", "suspicious")] == [], report


def test_breizhcrops_encoder_attends_across_parcels(tmp_path):
    """dl4sits/BreizhCrops#20 (796a923): the (N, T, D) batch of parcel series a DataLoader drew (batch_size 8, its
    default collate) went into a seq-first nn.TransformerEncoder inside a Sequential: (L, N, E) read as (8, 45, 64),
    each of the 45 time steps attends over the 8 parcels. No ids, no pad id, no sample run alone: the loader states
    the batch axis. The fix transposes to (T, N, D) around the encoder."""
    found = check_bug(tmp_path, "breizhcrops_transformer_encoder_attends_across_batch_not_time", "batch-axis-attended")
    message = found[0]["message"]
    assert "8 keys are the 8 samples of `x` given to TransformerModel" in message and "DataLoader `dataloader`" in message
    # batch row b is time step b of every parcel, query q and key k are parcels: only a parcel's own cell is its own
    assert tuple(found[0]["cell"]) == first((45, 8, 8), lambda b, q, k: q != k)


def test_loader_dict_batch_time_major_sdpa(tmp_path):
    """Written another way: a fairseq-style time-major block on SDPA (`tgt_len, bsz, embed_dim = x.size()`) handed the
    batch-first series a DataLoader collated from a dataset of dicts, the sizes in a dict; the fix transposes first."""
    found = check_bug(tmp_path, "loader_dict_batch_time_major_sdpa", "batch-axis-attended", BATCH)
    assert "6 samples of `series` given to SeriesClassifier" in found[0]["message"]
    assert tuple(found[0]["cell"]) == first((20, 6, 6), lambda b, q, k: q != k)
    status, found, report = traced(tmp_path, "loader_dict_batch_time_major_sdpa", True, BATCH)
    assert [f for f in found if f["severity"] in ("wrong", "suspicious")] == [], report


def test_loader_time_major_collate_quiet(tmp_path):
    """Correct: a loader whose own collate pads time-major into a batch_first=False encoder, and a default-collated
    loader into a batch_first=True one."""
    status, found, report = traced(tmp_path, "loader_time_major_collate_correct", False, BATCH)
    assert status == 0 and [f for f in found if f["severity"] in ("wrong", "suspicious")] == [], report


def test_a_beam_search_rerunning_its_prefix_whose_length_meets_the_batch_size_is_quiet(tmp_path):
    """quiet-zx (written blind): CodeXGLUE's code-to-text Seq2Seq beam search over 4 sources, each source's 3 beams
    re-running their whole prefix through a seq-first nn.TransformerDecoder, then one source run alone. At its fourth
    turn the decoder's self-attention has 4 keys, the batch's 4 samples by number alone; the run alone has 4 there too
    at the same turn (its first turn's 1 key is no statement about the fourth): quiet."""
    folder = Path(__file__).parent / "data" / "quiet_blind"
    status, found, report = traced(tmp_path, "quiet_codexglue_code_to_text_beam_reorder_full_prefix_memory_pad_mask",
                                   False, folder)
    assert [f for f in found if f["code"] == "batch-axis-attended"] == [], report
    assert status == 0, report


def test_an_engines_flat_token_stream_beside_its_positions_is_no_batch_of_samples(tmp_path):
    """SGLang's model call (sglang#22688's MLA chunked-prefix port, written blind, batch blind-pe: batch-axis-attended
    on the buggy run and its fix alike, before) hands `input_ids` and `positions` of every request's tokens, one flat
    axis: positions number tokens, so the 1-D ids are no field of one value per sample."""
    import torch

    from maskcli.trace.samplefields import sample_fields

    assert sample_fields({"input_ids": torch.arange(6), "positions": torch.arange(6)}) == {}
    assert sample_fields({"user_id": torch.arange(6), "hist": torch.zeros(6, 4)})["sample_fields"][1] == 6
    for fixed in (False, True):
        status, found, report = traced(tmp_path, "sglang_trtllm_mla_chunked_prefix_zero_kv_rows_stale_lse", fixed,
                                       Path(__file__).parent / "data" / "blind")
        assert [f for f in found if f["code"] == "batch-axis-attended"] == [], report


def test_a_sequence_first_pass_of_one_column_and_its_first_step_alone_are_no_batch(tmp_path):
    """pytorch/examples' word language model (quiet-r97b, written blind): nn.Transformer's encoder is sequence-first,
    and the program checks each column's prefixes: the first step alone is one row of every argument of a longer
    prefix, 1 key and 1 batch row as the longer one has 1 batch row. A sample's tokens as the batch rows need two of
    them to say so."""
    status, found, report = traced(tmp_path, "quiet_pytorch_examples_word_language_model_transformer_src_mask", False,
                                   Path(__file__).parent / "data" / "quiet_blind")
    assert [f for f in found if f["severity"] == "wrong"] == [] and status == 0, report
