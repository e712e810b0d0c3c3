"""checks/slicedmask.py (and trace/slicedheld.py): a self-attention handed a window of the program's own (B, L, L) mask
whose rows begin at another token than its columns."""

from __future__ import annotations

from pathlib import Path

import torch

from checkbugs import check_bug
from maskcli.trace.slicedheld import _window

SLICED = Path(__file__).parent / "data" / "sliced"


def _token_rows(mask: list[list[bool]], row: int, column: int, n: int) -> list[tuple[int, int]]:
    """(query, key) of each cell the window keeps that the aligned window [column:, column:] does not (the reference:
    a double loop over the tokens' own rows)."""
    return [(q, k) for q in range(n) for k in range(n)
            if mask[row + q][column + k] and not mask[column + q][column + k]]


def test_easytpp_thp_slices_the_tokenizers_mask_rows_one_on(tmp_path):
    """ant-research/EasyTPP 2c4ce4e (written blind, batch blind-ge): the tokenizer's mask (True = masked) began to let
    an event see itself, and THP.loglike_loss still sliced it `[:, 1:, :-1]`: event i is given event i + 1's row and
    sees it, the event its intensity is scored on. The fix, `[:, :-1, :-1]`, is quiet."""
    hit = check_bug(tmp_path, "easytpp_thp_loglike_attention_mask_slice_sees_next_event", "mask-sliced-apart")[0]
    causal = [[k <= q for k in range(9)] for q in range(9)]  # (a row with no padding: the tokenizer's own causal rows)
    q, k = _token_rows(causal, 1, 0, 8)[0]
    assert "sliced [:, 1:9, 0:8]" in hit["message"] and f"query {q} sees key {k}" in hit["message"]
    assert hit["expected"] == "[:, 0:8, 0:8] or [:, 1:9, 1:9]" and hit["source"].startswith("attention_mask in loglike_loss()")


def test_a_keep_mask_narrowed_with_its_rows_one_on(tmp_path):
    """Written another way (tests/data/sliced): a collator's True = keep mask over right-padded rows, narrowed along
    each axis with a head axis added, handed to SDPA; the fix narrows both from token 0."""
    hit = check_bug(tmp_path, "collator_keep_mask_narrowed_rows_one_on_sdpa", "mask-sliced-apart", SLICED)[0]
    assert "sliced [:, 1:6, 0:5]" in hit["message"] and "its rows begin 1 token after its columns" in hit["message"]


def test_a_window_is_read_off_the_views_storage():
    """_window: (first row, first column, size) of each square window a view takes of a contiguous (B, L, L) mask,
    against the indices it was sliced with; a copy, a non-square slice or another batch row's are none."""
    base = torch.rand(3, 7, 7) > 0.5
    for row, column, n in [(1, 0, 6), (0, 1, 6), (2, 2, 4), (0, 0, 3), (3, 1, 4)]:
        assert _window(base[:, row:row + n, column:column + n], base) == (row, column, n)
        assert _window(base[:, row:row + n, column:column + n].unsqueeze(1), base) == (row, column, n)
        assert _window(base.narrow(1, row, n).narrow(2, column, n), base) == (row, column, n)
    assert _window(base[:, 1:, :-1].clone(), base) is None
    assert _window(base[:, 1:, :-2], base) is None
    assert _window(base[1:, 1:, :-1], base) is None
    assert _window(base, base) is None
