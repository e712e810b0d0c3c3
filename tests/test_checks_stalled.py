"""checks/stalled.py: a causal document of the mask whose position ids do not count one per token while another
document's of the same call do (a packed mask of segment ids read as a 0/1 mask)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from checkbugs import check_bug
from maskcli.checks.stalled import documents, step

STALLED = Path(__file__).parent / "data" / "stalled"


def _blocks(segments: list[int]) -> np.ndarray:
    """The reference: a double loop over one row's segment ids (0 = padding), each sample causal on its own."""
    n = len(segments)
    cells = np.zeros((n, n), dtype=bool)
    for q in range(n):
        for k in range(n):
            cells[q, k] = segments[q] != 0 and segments[q] == segments[k] and k <= q
    return cells


def test_documents_are_the_causal_blocks():
    segments = [1, 1, 1, 2, 2, 3, 3, 3, 3, 0, 0]
    assert documents(_blocks(segments)) == [(0, 2), (3, 4), (5, 8)]
    full = np.ones((4, 4), dtype=bool)  # an encoder's (or HF's unmasked padding) rows see later keys: no document
    assert documents(full) == []
    window = np.tril(np.ones((6, 6), dtype=bool)) & ~np.tril(np.ones((6, 6), dtype=bool), -3)
    assert documents(window) == [(0, 2)]  # a window of 3: its first rows only; each later one starts at another key


def test_step_reads_every_row_of_the_ids():
    text = np.array([[0, 1, 2, 3, 1, 1, 1]])
    assert step(text, 0, 3) == 1 and step(text, 4, 6) == 0 and step(text, 3, 5) is None
    image = np.array([[4, 4, 4, 4], [4, 4, 5, 5], [4, 5, 4, 5]])  # Qwen2-VL's (t, h, w) over a 2 x 2 grid
    assert step(image, 0, 3) is None
    padding = np.array([[0, 1, 2, 0, 0, 0, 0]])  # a collator's zeros, a varlen kernel's sequence of their own
    assert step(padding, 3, 6) is None


def test_llamafactory_qwen2vl_rope_index_packed_mask_segment_ids(tmp_path):
    # hiyouga/LlamaFactory#7754 (commit bd7bc31c7; written blind, batch blind-dk): the collator handed the neat-packing
    # mask of segment ids to Qwen2-VL's get_rope_index, which keeps the tokens where mask == 1; each later sample stays
    # at position 1 (all three rope rows) while the first counts 0, 1, 2 ..
    [hit] = check_bug(tmp_path, "llamafactory_collator_qwen2vl_rope_index_packed_mask_segment_ids", "positions-stalled")
    segments = [1] * 5 + [2] * 4 + [3] * 6 + [0]  # batch row 0: samples of 5, 4, 6 tokens
    assert documents(_blocks(segments))[1] == (5, 8)
    assert tuple(hit["cell"]) == (0, 6, 5)
    assert "stay at [1, 1, 1]" in hit["message"]


def test_packed_segment_mask_cumsum_position_ids(tmp_path):
    """Written another way: 1-D ids from `cumsum(attention_mask) - 1` over a mask of sample numbers, an eager softmax,
    right padding; the n-th sample counts by n. The fix's ids restart per sample (quiet)."""
    [hit] = check_bug(tmp_path, "packed_segment_mask_cumsum_position_ids", "positions-stalled", folder=STALLED)
    segments = [1] * 6 + [2] * 5 + [3] * 4 + [0]
    ids = np.cumsum(segments) - 1
    s, e = documents(_blocks(segments))[1]
    assert (s, e) == (6, 10) and set(np.diff(ids[s:e + 1]).tolist()) == {2}
    assert tuple(hit["cell"]) == (0, s + 1, s)
    assert "step by 2 per token" in hit["message"]
