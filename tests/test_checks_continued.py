"""checks/continued.py (fed by trace/samplerows.py's rows of each model call): rows run after the rows before them
that see fewer keys than the same rows in one pass over them all."""

from __future__ import annotations

from pathlib import Path

from checkbugs import check_bug

CONTINUED = Path(__file__).parent / "data" / "continued"


def test_tabpfn_thinking_tokens_added_again_at_cached_prediction(tmp_path):
    """PriorLabs/TabPFN#852 (commit 7437cf7): fit_with_cache fits on X[:10] then predicts X[10:]; the thinking tokens
    (4) are prepended again, so the 6 test rows see the 4 fresh thinking rows where the one pass over X shows them the
    4 thinking + 10 train rows."""
    found = check_bug(tmp_path, "tabpfn_perfeaturetransformer_kv_cache_thinking_tokens_replace_trainset",
                      "continued-keys-dropped")
    # the first test row is query 4 of the 4 + 6 the prediction call runs: 4 keys seen, 4 + 10 in the one pass
    assert "query 4 (row 0 of the 6 rows" in found[0]["message"]
    assert "sees 4 keys" in found[0]["message"] and "shows the same row 14" in found[0]["message"]


def test_time_major_decoder_cache_overwritten_on_continue(tmp_path):
    """Written another way: a time-major causal decoder run over 9 steps, then 6 + 3 with a module-held cache that the
    continuation overwrites: its first step (step 6) sees itself alone where the one pass shows it 7 keys."""
    found = check_bug(tmp_path, "time_major_decoder_cache_overwritten_on_continue", "continued-keys-dropped", CONTINUED)
    assert "query 0 (row 0 of the 3 rows" in found[0]["message"]
    assert "sees 1 keys" in found[0]["message"] and "shows the same row 7" in found[0]["message"]


def test_halves_run_apart_with_no_state_kept_are_two_sequences(tmp_path):
    """A bidirectional time-major encoder run over 8 steps, then over steps 0-3 and 4-7 apart, on purpose: no module
    state is assigned between the calls (trace/assigned.py counts none), so the second half is a sequence of its own,
    not a continuation, and its 4 keys where the one pass shows 8 are no finding."""
    from checkbugs import traced

    status, found, report = traced(tmp_path, "time_major_encoder_halves_evaluated_apart", False, CONTINUED)
    assert status == 0 and not [f for f in found if f["severity"] in ("wrong", "suspicious")], report
    assert "2 groups" in report and "(2,2,4,4)" in report  # (both halves were read: quiet by the rule, not unseen)


def test_a_one_pass_that_calls_a_site_in_pieces_holds_no_rows_to_align(tmp_path):
    """A vision encoder that attends image by image (one softmax per image at one line, GLM-4V's eager attention over
    cu_seqlens: quiet-r159b), run over three images at once and then over the first and the other two apart: its first
    call at the site is the first image's alone, not the one pass's rows, so the last image's 4 keys are not compared
    with the first image's 6. Quiet; each image's patches see their own image's in every run."""
    from checkbugs import traced

    status, found, report = traced(tmp_path, "vision_encoder_images_attended_apart_in_pieces", False, CONTINUED)
    assert status == 0 and not [f for f in found if f["severity"] in ("wrong", "suspicious")], report
    assert "(1,1,6,6)" in report and "(1,1,9,9)" in report and "(1,1,4,4)" in report  # (every image's call read)
