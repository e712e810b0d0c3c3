"""checks/emptytrained.py (fed by trace/losses.py's `loss_counted`): query rows that see no key under a finite fill, in
an otherwise causal self-attention, whose targets the model call's loss counts: DALLE-pytorch 9bf1f0f written blind
twice, and the same slip written another way (a left-padded LM trained on its pad rows' predictions); the fixes quiet;
the targets laid over the queries against a loop over rows and positions."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from checkbugs import check_bug, traced
from maskcli.checks.context import Top
from maskcli.checks.emptytrained import _counted

EMPTY = Path(__file__).parent / "data" / "emptytrained"


@pytest.mark.parametrize("name, rows", [
    # lucidrains/DALLE-pytorch 9bf1f0f (written blind by two writers, rounds 49): the caption's padding mask applied
    # to the queries too, so padded caption rows, filled whole with the causal fill's value, attend every image token
    ("dalle_pytorch_full_attention_query_times_key_text_mask", "query rows 4-6 of batch row 1"),
    ("dalle_pytorch_full_attention_padded_text_rows_fully_masked", "query rows 6-8 of batch row 1"),
])
def test_dalle_padded_caption_rows_filled_whole_and_trained_on_are_flagged(tmp_path, name, rows):
    [hit] = check_bug(tmp_path, name, "empty-rows-trained")
    assert hit["message"].startswith(f"{rows} see no key (uniform weights over every key")
    assert "the loss of DALLE counts the targets there" in hit["message"]


def test_a_left_padded_lm_trained_on_its_pad_rows_predictions_is_flagged_and_ignoring_them_is_not(tmp_path):
    [hit] = check_bug(tmp_path, "left_padded_lm_trained_on_pad_rows_finite_fill", "empty-rows-trained", EMPTY)
    assert hit["message"].startswith("query rows 0-2 of batch row 1 see no key")
    assert "(5 such rows in all)" in hit["message"]  # (rows 0-2 of batch row 1, 0-1 of batch row 2)
    assert tuple(hit["cell"]) == (1, 0, 6)


def test_targets_are_laid_over_the_queries_as_a_loop_reads_them():
    rows, q_len = 2, 4
    flat = np.array([1, 0, 1, 1, 0, 0, 1, 1], bool)  # (B * Lq) targets, row-major
    shifted = np.array([1, 0, 1, 0, 1, 1], bool)  # (B * (Lq - 1)): the last position's prediction left out
    for counted, width in ((flat, q_len), (shifted, q_len - 1)):
        laid = _counted(Top("m", loss_counted=(counted,)), rows, q_len)
        for b in range(rows):
            for q in range(q_len):
                assert laid[b, q] == (q < width and counted[b * width + q])
    assert _counted(Top("m", loss_counted=(np.ones(5, bool),)), rows, q_len) is None


def test_a_per_token_loss_weighed_after_it_returns_by_an_unnamed_mask_counts_nothing_known(tmp_path):
    """The same left-padded LM, its per-token loss (`reduction="none"`) weighed inline by each position's attention
    mask: the pad rows' predictions count for nothing (the program checks its loss against the rows run alone), so the
    empty rows are not trained on. Read against the loss of the program above, which counts them."""
    status, found, report = traced(tmp_path, "left_padded_lm_per_token_loss_weighed_inline_quiet", False, EMPTY)
    assert [f for f in found if f["severity"] in ("wrong", "suspicious")] == [], report
    assert status == 0, report
