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
