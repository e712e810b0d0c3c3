"""checks/shiftedrows.py: a cross-attention mask whose query rows were padded on the other side than the text; the
expected rows worked out here by a loop over each sample's tokens, padded as the ids are."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from checkbugs import check_bug, traced
from maskcli.checks.shiftedrows import _shifted

SHIFTED = Path(__file__).parent / "data" / "shiftedrows"


def selecting_rows(ids: list[int], image_id: int, pad: int, left: bool) -> list[int]:
    """The positions, in the padded row, of the tokens at or after the sample's first image token (a plain loop)."""
    found, seen = [], False
    for i, token in enumerate(ids):
        seen = seen or token == image_id
        if seen:
            found.append(i + (pad if left else 0))
    return found


def test_torchtune_left_padded_tokens_with_bottom_padded_encoder_masks(tmp_path):
    """meta-pytorch/torchtune#1601: [5, IMG, 7, 9] left-padded by 4 beside an 8-token sample; its encoder_mask padded
    at the bottom puts its image rows 1-3 on padding, where its tokens are at 5-7."""
    [hit] = check_bug(tmp_path, "torchtune_llama3_2_vision_left_pad_encoder_mask_padded_right", "memory-rows-shifted")
    unpadded = selecting_rows([5, 1, 7, 9], 1, 4, left=False)
    assert unpadded == [1, 2, 3] and hit["cell"][:2] == [0, unpadded[0]]
    assert f"real positions {selecting_rows([5, 1, 7, 9], 1, 4, left=True)[0]}-7" in hit["message"]


def test_a_media_mask_padded_at_the_top_beside_right_padded_text(tmp_path):
    """Written another way: right-padded ids, each sample's media mask padded at the top, an einsum softmax; the fix
    (padded at the bottom) is quiet."""
    status, found, report = traced(tmp_path, "media_mask_padded_at_top_right_padded_text", False, SHIFTED)
    assert status == 1, report
    [hit] = [f for f in found if f["code"] == "memory-rows-shifted"]
    short = [3, 1, 4]  # the sample's ids, padded by 5 on the right
    meant = selecting_rows(short, 1, 5, left=False)
    slid = [i + 5 for i in meant]
    assert hit["severity"] == "wrong" and hit["cell"][:2] == [1, slid[0]], report
    assert f"real positions {meant[0]}-{meant[-1]}" in hit["message"]
    status, found, report = traced(tmp_path, "media_mask_padded_at_top_right_padded_text", True, SHIFTED)
    assert status == 0 and not [f for f in found if f["severity"] == "wrong"], report


def test_quiet_where_the_padding_rows_hold_one_pattern_or_a_real_row_lines_up():
    """Padding rows that all see one key (kept against NaN) say nothing; rows that line up with the tokens neither."""
    pad = np.array([[True, True, False, False, False, False]])
    cells = np.zeros((1, 6, 4), dtype=bool)
    cells[0, :2, 0] = True  # every padding row sees key 0
    cells[0, 2:] = True  # the real rows see every key
    assert _shifted(cells, pad, "ids") is None
    cells[:] = False
    cells[0, 3:, :2] = True  # the real rows from 3 on select keys 0-1: the rows line up
    assert _shifted(cells, pad, "ids") is None
    cells[0, 1, :2] = True  # a padding row selects too, but moved by 2 the rows 3-5 fall past the row's end
    assert _shifted(cells, pad, "ids") is None
    cells[0, 2:] = True  # the real rows see every key (unmatched): the padding row 1 moved by 2 is real position 3
    assert _shifted(cells, pad, "ids").cell == (0, 1, 0)


def test_the_padding_a_handed_self_attention_mask_isolates():
    """torchtune's `tril & padding_mask | eye` over a left-padded row beside an unpadded one: the positions that see
    only themselves and that no other sees, found here by a loop, are the padding; a plain causal mask isolates none."""
    from maskcli.checks.context import Top
    from maskcli.checks.shiftedrows import isolated

    real = np.array([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]], dtype=bool)
    cells = (np.tril(np.ones((5, 5), dtype=bool))[None] & real[:, None, :]) | np.eye(5, dtype=bool)[None]
    loop = [[all(cells[b, q, k] == (q == k) for k in range(5)) and all(cells[b, q2, q] == (q2 == q) for q2 in range(5))
             for q in range(5)] for b in range(2)]
    top = Top("Model", None, {"handed_cells": ("mask", cells)}, 0, 1)
    found = isolated(top, 2, 5)
    assert found is not None and (~found[0]).tolist() == loop
    causal = Top("Model", None, {"handed_cells": ("mask", np.tril(np.ones((2, 5, 5), dtype=bool)))}, 0, 1)
    assert isolated(causal, 2, 5) is None
