"""checks/rowsout.py: query rows a row mask states masked out whose attention output reaches the residual stream
(masked-rows-reach-residual), caught in the published bug's reproduction (tests/data/bugs) and in a program written
another way (tests/data/rowsout), quiet on the fixes and on a block that zeroes those rows with torch.where; the
flagged cell against a plain loop over the rows before each row's image, the rows read against a plain loop."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from checkbugs import check_bug, first, traced
from maskcli.checks.rowsout import attended_dropped

ROWSOUT = Path(__file__).parent / "data" / "rowsout"


def _before_image(image_at: list[int], q_len: int, k_len: int):
    """(b, q, k): the first text row before its batch row's image token and the first key it is given (uniform weights
    over every image key: the bias row unmasked to 0)."""
    return first((len(image_at), q_len, k_len), lambda b, q, k: q < image_at[b])


def test_mllama_cross_attention_rows_before_the_image_reach_the_residual(tmp_path):
    # huggingface/transformers#39379: full_text_row_masked_out_mask applied to the MLP branch only
    found = check_bug(tmp_path, "transformers_mllama_cross_attn_decoder_layer_masked_rows_get_image_via_residual",
                      "masked-rows-reach-residual")
    assert tuple(found[0]["cell"]) == _before_image([3, 3], 10, 10)
    assert "query rows 0-2 of batch row 0" in found[0]["message"]
    assert "full_text_row_masked_out_mask" in found[0]["message"] and "residual" in found[0]["message"]


def test_an_sdpa_media_block_whose_row_mask_zeroes_only_its_feed_forward_is_found(tmp_path):
    # written another way: SDPA, a dict config, the image at another position in each batch row
    found = check_bug(tmp_path, "media_cross_attention_sdpa_row_mask_dropped_from_output",
                      "masked-rows-reach-residual", folder=ROWSOUT)
    assert tuple(found[0]["cell"]) == _before_image([2, 5], 8, 6)
    assert "rows_with_media_mask" in found[0]["message"] and "query rows 0-1 of batch row 0" in found[0]["message"]


def test_rows_zeroed_by_torch_where_before_the_residual_are_quiet(tmp_path):
    status, found, report = traced(tmp_path, "quiet_mha_row_mask_where_before_residual", False, ROWSOUT)
    assert status == 0 and [f for f in found if f["severity"] in ("wrong", "suspicious")] == [], report


def test_the_rows_read_match_a_plain_loop():
    rng = np.random.default_rng(0)
    for _ in range(200):
        b, q, k = (int(x) for x in rng.integers(1, 6, 3))
        cells = rng.random((b, q, k)) < 0.4
        rows = rng.random((b, q)) < 0.5
        loop = []
        for i in range(b):
            for j in range(q):
                if not rows[i, j]:
                    seen = [x for x in range(k) if cells[i, j, x]]
                    if seen:
                        loop.append((i, j, seen[0]))
        assert attended_dropped(cells, rows) == loop
