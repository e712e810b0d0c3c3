"""blocks-seen-before-they-end (checks/branchrows.py): a branch over keys fewer than its queries (compressed blocks)
whose queries each see the blocks after them, beside a causal branch over the same queries."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

import maskcli
from checkbugs import check_bug

BRANCHES = Path(__file__).parent / "data" / "branches"


def _ended(q_len: int, k_len: int, block: int, stride: int) -> torch.Tensor:
    """Bool (Lq, Lk): query p sees block j where the block (tokens j*stride .. j*stride + block - 1) has ended by p, a
    double loop over positions (the tests' reference)."""
    out = torch.zeros(q_len, k_len, dtype=torch.bool)
    for p in range(q_len):
        for j in range(k_len):
            out[p, j] = j * stride + block - 1 <= p
    return out


def test_nsa_compressed_mask_mod_turned(tmp_path):
    """tilde-research/nsa-release#3 (written blind): the compressed branch's mask_mod keeps the blocks that end after
    the query; FlexAttention keeps where it is True. The fix (the blocks that have ended) is quiet."""
    found = check_bug(tmp_path, "nsa_compressed_branch_flex_mask_polarity_inverted", "blocks-seen-before-they-end")
    want = _ended(16, 4, 4, 4)
    assert int(want[0].sum()) == 0 and int(want[15].sum()) == 4  # (causally: query 0 sees no block, query 15 all four)
    message = found[0]["message"]
    assert "to 4 keys, fewer than its 16 queries" in message
    assert "key 0 by queries 0 .. 2, key 1 by queries 0 .. 6, key 2 by queries 0 .. 10, key 3 by queries 0 .. 14" \
        in message
    assert "query 0 sees 4 keys and query 15 0" in message
    assert found[0]["cell"] == [0, 0, 3]


def test_pooled_sdpa_branch_turned(tmp_path):
    """Written another way: mean-pooled blocks of 2 (F.avg_pool1d), a bool keep mask `block_end > pos` handed to
    SDPA, a batch of two, beside a causal window of 3 over the same queries. The fix (`block_end <= pos`) is quiet."""
    found = check_bug(tmp_path, "pooled_branch_sdpa_block_end_comparison_turned", "blocks-seen-before-they-end", BRANCHES)
    assert "to 6 keys, fewer than its 12 queries" in found[0]["message"]
    assert "query 0 sees 6 keys and query 11 0" in found[0]["message"]


def _findings(compressed: torch.Tensor, local: torch.Tensor, same_queries: bool = True) -> list:
    q = torch.randn(1, 1, compressed.shape[0], 4)
    k, ck = torch.randn(1, 1, local.shape[1], 4), torch.randn(1, 1, compressed.shape[1], 4)
    with maskcli.trace() as t:
        F.scaled_dot_product_attention(q, ck, ck, attn_mask=compressed)
        F.scaled_dot_product_attention(q if same_queries else q.clone(), k, k, attn_mask=local)
    return [f.code for g in t.groups() for f in g.findings if f.code == "blocks-seen-before-they-end"]


def test_quiet_where_nothing_says_causal_or_the_blocks_are_ended():
    """The turned mask beside a causal branch is found; beside a full branch, beside another query tensor, or turned
    the right way (blocks seen once ended; the first rows given block 0 so that none is empty) it is quiet; and every
    query seeing every key (a memory before the sequence) is quiet."""
    ended = _ended(8, 4, 2, 2)
    turned = ~ended
    causal = torch.ones(8, 8, dtype=torch.bool).tril()
    assert _findings(turned, causal) == ["blocks-seen-before-they-end"]
    assert _findings(turned, torch.ones(8, 8, dtype=torch.bool)) == []
    assert _findings(turned, causal, same_queries=False) == []
    right = ended.clone()
    right[:, 0] = True
    assert _findings(right, causal) == []
    assert _findings(torch.ones(8, 4, dtype=torch.bool), causal) == []
