"""checks/sidewindows.py: a layer's look-ahead one key short of the (left, right) window its config states for it;
the flagged cell against a double loop."""

from __future__ import annotations

from pathlib import Path

from checkbugs import check_bug, first

SIDE = Path(__file__).parent / "data" / "sidewindows"


def test_moonshine_streaming_right_window_one_frame_short(tmp_path):
    """huggingface/transformers#46305 (written blind): `-dist < right_window_size`, layer 0's (16, 4) window sees 3
    frames ahead; 24 frames, one row."""
    found = check_bug(tmp_path, "moonshine_streaming_right_window_one_frame_short", "window-right-short")
    assert tuple(found[0]["cell"]) == first((1, 24, 24), lambda b, q, k: k == q + 4)
    assert "sliding_windows[0]=(16, 4)" in found[0]["message"]


def test_a_dict_configs_lookahead_built_one_diagonal_short(tmp_path):
    """Written another way: a dict on `self.cfg`, [3, 2] per layer, `tril(diagonal=right - 1)`, a right-padded batch
    (lengths 10, 7): a query with 2 real keys ahead sees 1."""
    found = check_bug(tmp_path, "lookahead_diagonal_one_short", "window-right-short", folder=SIDE)
    lengths = (10, 7)
    assert tuple(found[0]["cell"]) == first((2, 10, 10), lambda b, q, k: k == q + 2 and k < lengths[b])


def test_a_pair_is_read_only_per_layer():
    from maskcli.checks.sidewindows import _pair

    assert _pair([(16, 4), (16, 0)], 1) == (16, 0)
    assert _pair([[3, 2]], 0) == (3, 2)
    assert _pair([(16, 4)], 1) is None and _pair([(16, 4)], None) is None and _pair([16, 4], 0) is None
