"""trace/headquery.py: one query per head scored by an einsum with no query axis (a paged decode written per request)."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import maskcli
from maskcli.trace.headquery import one_query


def test_which_einsums_are_one_query_per_head():
    q, k3, k4 = torch.randn(2, 8), torch.randn(5, 2, 8), torch.randn(3, 5, 2, 8)
    assert one_query(("hd,nhd->hn", q, k3), torch.einsum("hd,nhd->hn", q, k3))
    assert one_query(("hd,hnd->hn", q, k3.transpose(0, 1)), torch.einsum("hd,hnd->hn", q, k3.transpose(0, 1)))
    qb = torch.randn(3, 2, 8)
    assert one_query(("bhd,bnhd->bhn", qb, k4), torch.einsum("bhd,bnhd->bhn", qb, k4))
    w = torch.randn(2, 5)  # weights by values: the contracted axis is the keys', not the features' (last of both)
    assert not one_query(("hn,nhd->hd", w, k3), torch.einsum("hn,nhd->hd", w, k3))
    qq = torch.randn(4, 2, 8)  # a query axis of its own: q @ kᵀ, read by scores.py as it always was
    assert not one_query(("qhd,khd->hqk", qq, k3), torch.einsum("qhd,khd->hqk", qq, k3))
    assert not one_query(("hd,hd->h", q, q), torch.einsum("hd,hd->h", q, q))  # no key axis


def _gathered(q, pool_k, idx):
    """One request's decode: keys gathered by index out of a pool (n, H, D), scored per head, softmaxed."""
    k = pool_k[idx]
    return (torch.einsum("hd,nhd->hn", q, k) * 0.25).softmax(-1)


class Attention(nn.Module):
    num_heads = 2

    def forward(self, q, pool_k, idx):
        return _gathered(q, pool_k, idx)


def test_a_gathered_decode_is_one_query_of_each_head_at_the_last_of_its_keys():
    """Each call is one query of H heads, (1, H, 1, n), seeing every key it gathered, as SDPA of that one query over
    those keys sees them (its attention weights the same); a module that states no head count matching the rows
    records nothing (they may be batch rows of one decoder state each)."""
    torch.manual_seed(0)
    pool = torch.randn(10, 2, 8)
    q = torch.randn(2, 8)
    attention = Attention()
    with maskcli.trace() as t:
        weights = [attention(q, pool, torch.arange(0, 7)), attention(q, pool, torch.arange(4, 8))]
    assert [c.shape for c in t.calls] == [(1, 2, 1, 7), (1, 2, 1, 4)]
    for call, idx, got in zip(t.calls, (torch.arange(0, 7), torch.arange(4, 8)), weights):
        assert call.details["head_query"].startswith("one query per head")
        assert np.array_equal(call.keep(), np.ones(call.shape, bool))  # every gathered key, no mask
        k = pool[idx].transpose(0, 1)[None]  # (1, H, n, D): SDPA of the one query, its weights the reference
        reference = torch.softmax(q[None, :, None] @ k.transpose(-1, -2) * 0.25, -1)[0, :, 0]
        assert torch.allclose(got, reference)
        assert torch.allclose(F.scaled_dot_product_attention(q[None, :, None], k, k, scale=0.25)[0, :, 0],
                              got[..., None].mul(pool[idx].transpose(0, 1)).sum(1), atol=1e-6)

    class Plain(nn.Module):
        def forward(self, q, pool_k, idx):
            return _gathered(q, pool_k, idx)

    with maskcli.trace() as t:
        Plain()(q, pool, torch.arange(0, 7))
    assert t.calls == []
