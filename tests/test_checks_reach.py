"""checks/reach.py (and trace/stated.py's `model_causal`): a causal model's query that reads a later token through a
key it sees."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from checkbugs import check_bug, first, traced

REACH = Path(__file__).parent / "data" / "reach"


def test_recurrent_memory_transformer_pads_memories_true(tmp_path):
    """recurrent-memory-transformer-pytorch cdff28a: tokens see the write memories, which see the whole segment."""
    check_bug(tmp_path, "recurrent_memory_transformer_custom_causal_mask_pads_memories_true", "causal-leak-through")


def test_summary_tokens_visible_to_causal_tokens(tmp_path):
    """Written another way: `is_causal = True`, summary tokens appended after 5 tokens, nn.MultiheadAttention's bool
    mask (True = masked); the first cell is a double loop's (q masked from a later j that a key q sees itself sees)."""
    status, found, report = traced(tmp_path, "summary_tokens_visible_to_causal_tokens", False, REACH)
    assert status == 1, report
    hit = next(f for f in found if f["code"] == "causal-leak-through")
    assert hit["severity"] == "wrong"
    n, size = 5, 7
    sees = np.tril(np.ones((size, size), dtype=bool))
    sees[n:, :] = True
    sees[:, n:] = True
    assert tuple(hit["cell"]) == first((1, size, size), lambda _, q, j: j > q and not sees[q, j]
                                       and any(sees[q, k] and sees[k, j] for k in range(size)))
    status, found, report = traced(tmp_path, "summary_tokens_visible_to_causal_tokens", True, REACH)
    assert status == 0 and [f for f in found if f["severity"] == "wrong"] == [], report
