"""checks/relindex.py (and trace/relindex.py): a window attention's relative_position_index that sends two different
offsets of its window to one row of a bias table sized one row per offset, against loops over the window's pairs."""

from __future__ import annotations

import itertools
import re
from pathlib import Path

import numpy as np
import torch

from checkbugs import check_bug
from maskcli.trace.relindex import _read

RELINDEX = Path(__file__).parent / "data" / "relindex"


def cells(window):
    return list(itertools.product(*[range(w) for w in window]))


def rows_used(window, strides):
    """The rows an index with these strides gives the window's pairs, by a loop over every pair of its cells."""
    index = {}
    for a, b in itertools.product(cells(window), repeat=2):
        offset = tuple(x - y for x, y in zip(a, b))
        index[a, b] = sum((o + w - 1) * s for o, w, s in zip(offset, window, strides))
    return index


def named_pairs_share_a_row(message, window, index):
    """The two token pairs the message names read one row by the loop's index, and their offsets differ."""
    at = cells(window)
    pairs = [(int(q), int(k)) for q, k in re.findall(r"token (\d+) to token (\d+)", message)]
    assert len(pairs) == 2, message
    (q1, k1), (q2, k2) = pairs
    offsets = [tuple(x - y for x, y in zip(at[q], at[k])) for q, k in pairs]
    assert offsets[0] != offsets[1]
    assert index[at[q1], at[k1]] == index[at[q2], at[k2]]


def test_nnformer_3d_strides_collide(tmp_path):
    """282857341/nnFormer PR #88 (commit fbf2244): WindowAttention_kv's strides (3 * Wh - 1, 2 * Wh - 1, 1) over a
    (2, 4, 4) window; the rows used and the pair named are the loop's."""
    [hit] = {f["message"]: f for f in check_bug(tmp_path, "nnformer_windowattention_kv_3d_relative_position_index_collides",
                                                 "relative-index-collides")}.values()
    window = (2, 4, 4)
    index = rows_used(window, (3 * 4 - 1, 2 * 4 - 1, 1))
    offsets = (2 * 2 - 1) * (2 * 4 - 1) * (2 * 4 - 1)
    assert f"one for each of the {offsets} offsets" in hit["message"], hit
    assert f"uses {len(set(index.values()))}:" in hit["message"], hit
    named_pairs_share_a_row(hit["message"], window, index)


def test_rectangular_window_strided_by_its_height(tmp_path):
    """Written another way: timm's helper on a 2 x 4 window striding rows by 2 * win_h - 1, the bias into SDPA as a
    float attn_mask; the rows used and the pair named are the loop's; the fix is quiet."""
    [hit] = check_bug(tmp_path, "rectangular_window_index_strided_by_height", "relative-index-collides", RELINDEX)
    index = rows_used((2, 4), (2 * 2 - 1, 1))
    assert f"uses {len(set(index.values()))}:" in hit["message"], hit
    named_pairs_share_a_row(hit["message"], (2, 4), index)


def test_quiet_on_swins_own_index_in_any_token_order_and_on_a_clipped_table():
    """Swin's own index (row-major, and its tokens read column-major) has a row per offset: nothing; a table with
    fewer rows than offsets (a clipped distance) is not read; an index over a class token's extra row is not read."""
    for window in ((7, 7), (2, 4), (2, 3, 5)):
        strides = [int(np.prod([2 * w - 1 for w in window[i + 1:]])) for i in range(len(window))]
        index = rows_used(window, strides)
        at = cells(window)
        table = torch.tensor([[index[a, b] for b in at] for a in at])
        rows = int(np.prod([2 * w - 1 for w in window]))
        assert _read(table, rows, window) is None
        order = torch.randperm(len(at))
        assert _read(table[order][:, order], rows, window) is None
    broken = torch.tensor([[index[a, b] % 10 for b in at] for a in at])
    assert _read(broken, rows, window) is not None
    assert _read(broken, 9, window) is None
    assert _read(torch.zeros(len(at) + 1, len(at) + 1, dtype=torch.long), rows, window) is None
