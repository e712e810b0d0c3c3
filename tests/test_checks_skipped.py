"""checks/skipped.py: a decode step whose model call was handed more new tokens than its cache took in."""

from __future__ import annotations

from pathlib import Path

from checkbugs import check_bug, traced

SKIPPED = Path(__file__).parent / "data" / "skipped"


def test_esm_inverse_folding_partial_seq_skipped_is_flagged(tmp_path):
    """facebookresearch/esm PR #438 (commit 1670483, "Fix sampling error with partial_seq"; written blind, batch
    blind-ep): GVPTransformerModel.sample() `continue`d past the positions partial_seq gives, so the decoder never ran
    on the tokens before them and their keys never entered the incremental state. The fix runs the decoder at every
    step and only skips the draw."""
    [hit] = check_bug(tmp_path, "esm_inverse_folding_partial_seq_sampling_skips_incremental_state",
                      "cache-tokens-skipped")
    # partial_seq leaves every third residue (index 2, 5, ...) to design, behind a BOS: the decoder is first called on
    # the 3 tokens before residue 2, then on the 6 before residue 5, running only the last: tokens 3 and 4 are skipped
    designed = [i + 1 for i in range(20) if i % 3 == 2]
    first, second = designed[:2]
    lost = ", ".join(str(p) for p in range(first, second - 1))
    assert f"handed {second} tokens, {second - first} more" in hit["message"], hit
    assert f"the token(s) at {lost} were never run" in hit["message"], hit


def test_forced_tokens_appended_without_a_step_are_flagged(tmp_path):
    # written another way: a nanoGPT-style decoder handed the whole sequence, a list cache per layer, a batch of two
    # through SDPA; forced tokens (a dict of position -> id) are appended without a model call
    [hit] = check_bug(tmp_path, "forced_tokens_appended_without_decoder_step", "cache-tokens-skipped", SKIPPED)
    forced = {6: 7, 7: 11}
    assert "the token(s) at " + ", ".join(str(p) for p in sorted(forced)) + " were never run" in hit["message"], hit


def test_a_windowed_cache_new_ids_alone_and_a_drafted_step_are_quiet(tmp_path):
    # the whole prefix handed behind a cache cut to a window (keys stop growing), each step's new token handed alone
    # (the ids do not extend the step before's), three drafted tokens run at once (the ids grow by the step's queries)
    status, found, report = traced(tmp_path, "window_cache_whole_prefix_and_new_ids_only", False, SKIPPED)
    assert status == 0 and [f for f in found if f["severity"] in ("wrong", "suspicious")] == [], report
