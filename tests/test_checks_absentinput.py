"""checks/absentinput.py: a batch row the batch's `pad_mask_dict` says lacks an input that still sees every key the
rows holding it see, on a reproduction of a published bug (Octo's language group, one unpadded batch) and on a program
written otherwise (a goal image, plain SDPA, a left-padded history), both fixes quiet; and hides_none against a loop
over rows and keys."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from checkbugs import check_bug
from maskcli.checks.absentinput import hides_none

ABSENT = Path(__file__).parent / "data" / "absent"


def test_octo_language_tokenizer_all_ones_pad_mask_is_flagged_and_its_fix_is_not(tmp_path):
    # s1lent4gnt/octo-pytorch commit b2fd085: LanguageTokenizer's pad mask was all ones, so samples whose
    # pad_mask_dict marks no language instruction still attended task_language tokens
    [hit] = check_bug(tmp_path, "octo_pytorch_language_tokenizer_all_ones_pad_mask", "absent-input-attended")[:1]
    assert "row 1" in hit["message"] and "language_instruction" in hit["message"]


def test_goal_image_tokens_that_ignore_pad_mask_dict_are_flagged_and_the_fix_is_not(tmp_path):
    [hit] = check_bug(tmp_path, "goal_image_tokens_ignore_pad_mask_dict", "absent-input-attended", ABSENT)[:1]
    assert "batch row 1" in hit["message"] and "image_goal" in hit["message"]


def _reference(cells: np.ndarray, present: np.ndarray):
    """The first absent row that sees, by some query, every key each present row sees: loops over rows and keys."""
    rows, keys = cells.shape[0], cells.shape[-1]
    seen = [[bool(cells[b, ..., k].any()) for k in range(keys)] for b in range(rows)]
    common = [k for k in range(keys) if all(seen[b][k] for b in range(rows) if present[b])]
    if not common:
        return None
    for b in range(rows):
        if not present[b] and all(seen[b][k] for k in common):
            return b, common
    return None


def test_hides_none_matches_a_loop_over_rows_and_keys():
    rng = np.random.default_rng(0)
    for _ in range(300):
        rows, keys = int(rng.integers(2, 5)), int(rng.integers(1, 6))
        cells = rng.random((rows, 2, 3, keys)) < rng.choice([0.3, 0.7, 0.95])
        present = rng.random(rows) < 0.5
        got, want = hides_none(cells, present), _reference(cells, present)
        if want is None:
            assert got is None
        else:
            assert got[0] == want[0] and got[1].tolist() == want[1]


def test_an_absent_row_is_quiet_only_where_it_hides_a_key_every_present_row_sees():
    causal = np.tril(np.ones((4, 4), dtype=bool))
    cells = np.stack([causal, causal, causal])
    present = np.array([True, False, True])
    assert hides_none(cells, present)[0] == 1  # row 1's mask is the others': the input's tokens seen
    hidden = cells.copy()
    hidden[1][:, :2] = False  # row 1 hides the input's two tokens (keys 0-1) from every query
    assert hides_none(hidden, present) is None
    hidden[1][0, 0] = True  # one query still sees key 0: key 1 hidden is enough
    assert hides_none(hidden, present) is None
