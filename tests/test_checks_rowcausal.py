"""checks/rowcausal.py: a pass causal in one batch row and seeing every key in another, at a site that decodes."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np

from checkbugs import check_bug
from maskcli.checks.rowcausal import causal_row_lost

HERE = Path(__file__).parent / "data" / "rowcausal"


def _call(cells: np.ndarray, step: int = 0):
    return SimpleNamespace(shape=cells.shape, step=step, details={}, where="layers.0", api="sdpa")


def test_candle_qwen3_causal_mask_filled_for_one_row_is_found(tmp_path):
    """huggingface/candle#3582 (written blind, blind-vv; missed before): Qwen3's causal_mask filled one triangle and
    labelled it (B, 1, L, L), so batch row 0 was causal and row 1 read unfilled memory (zeros: no mask). Every row
    real, decode steps behind a cache after the prefill. The fix (one mask broadcast over the batch) quiet."""
    found = check_bug(tmp_path, "candle_qwen3_causal_mask_batch_rows_past_row0", "causal-lost")
    assert tuple(found[0]["cell"]) == (1, 0, 1)
    assert "batch row 1 of step 0" in found[0]["message"] and "batch row 0 of the same call is causal" in " ".join(
        found[0]["message"].split())


def test_a_mask_loop_that_stops_one_row_short_is_found(tmp_path):
    """Written another way: a (B, 1, L, L) mask of True whose rows are made triangles in `range(batch - 1)`: the last
    of 3 prompts sees its later tokens at the prefill. The fix (every row) quiet."""
    found = check_bug(tmp_path, "batched_prompts_mask_loop_skips_last_row", "causal-lost", HERE)
    assert tuple(found[0]["cell"]) == (2, 0, 1)


def test_rows_against_a_loop_over_cells():
    """The finding only where some row is exactly the triangle and another sees every key, and a step behind a cache
    follows: a row that sees later keys in a block alone (an image's span), rows all causal, or no decode step after
    the pass, say nothing. The reference: each row compared with a triangle built cell by cell."""
    length = 5
    triangle = np.array([[k <= q for k in range(length)] for q in range(length)])
    block = triangle.copy()
    block[1:3, 1:3] = True  # (keys 1-2 both ways: a span)
    decode = [SimpleNamespace(shape=(3, 1, 1, length + 1))]
    full = np.ones((length, length), dtype=bool)
    cases = [((triangle, full, triangle), decode, 1), ((triangle, block, triangle), decode, None),
             ((triangle, triangle, triangle), decode, None), ((triangle, full, triangle), [], None),
             ((full, full, full), decode, None)]
    for rows, after, want in cases:
        cells = np.stack(rows)[:, None]
        found = causal_row_lost("layers.0", _call(cells), cells, after)
        assert (found is None) == (want is None), rows
        if want is not None:
            assert found.cell == (want, 0, 1) and found.code == "causal-lost"
