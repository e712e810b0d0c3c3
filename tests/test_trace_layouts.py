"""trace/layouts.py: scores laid out other than (..., Lq, Lk), read against a double loop over the reference mask."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

import maskcli


def test_transformer_xls_scores_laid_out_queries_keys_batch_heads_and_softmaxed_over_dim_1_are_one_call():
    """Transformer-XL's and XLNet's original layout: einsum('ibnd,jbnd->ijbn') scores (Lq, Lk, B, H), masked_fill with a
    (Lq, Lk, 1, 1) mask over memory and segment (triu(ones(qlen, klen), 1 + mlen)), F.softmax(dim=1): one call,
    (B, H, Lq, Lk), its mask the reference triangle; a 4-D softmax over dim 1 that no q @ kᵀ made (a segmentation
    map's channels) is none."""
    torch.manual_seed(0)
    qlen, mlen, bsz, heads, d = 4, 3, 2, 2, 8
    klen = qlen + mlen
    q, k = torch.randn(qlen, bsz, heads, d), torch.randn(klen, bsz, heads, d)
    hidden = torch.triu(torch.ones(qlen, klen), diagonal=1 + mlen).bool()
    with maskcli.trace() as t:
        score = torch.einsum("ibnd,jbnd->ijbn", q, k).masked_fill(hidden[:, :, None, None], -float("inf"))
        F.softmax(score, dim=1)
        F.softmax(torch.randn(2, 5, 4, 4), dim=1)  # (B, classes, H, W)
    assert [(c.api, c.shape) for c in t.calls] == [("softmax", (bsz, heads, qlen, klen))]
    reference = np.array([[j <= i + mlen for j in range(klen)] for i in range(qlen)])  # a double loop
    assert np.array_equal(t.calls[0].keep()[1, 1], reference)


def test_scores_in_transformer_xl_axis_order_are_read_as_b_h_lq_lk():
    """Transformer-XL (kimiyoung/transformer-xl mem_transformer.py) makes scores (Lq, Lk, B, H) by einsum("ibnd,jbnd->
    ijbn"), adds a relative term, masks them with attn_mask[:, :, :, None] and softmaxes over dim 1: read through the
    einsum's own axis order, each (b, h) plane is the mask the program built (a double loop over absolute positions:
    mlen cached keys, then causal, the first `pad[b]` memory slots of row b padded). A softmax over heads is none."""
    g = torch.Generator().manual_seed(0)
    q_len, mlen, b, h, d = 4, 3, 2, 3, 8
    k_len, pad = mlen + q_len, (0, 2)

    def attend(q, k, v, rel, mask, dim=1):
        score = (torch.einsum("ibnd,jbnd->ijbn", q, k) + rel) * d ** -0.5
        score = score.float().masked_fill(mask[:, :, :, None], -float("inf")).type_as(score)
        return torch.einsum("ijbn,jbnd->ibnd", F.softmax(score, dim=dim), v)

    q, k, v = torch.randn(q_len, b, h, d, generator=g), torch.randn(k_len, b, h, d, generator=g), torch.randn(k_len, b, h, d, generator=g)
    rel = torch.randn(q_len, k_len, 1, h, generator=g)
    causal = torch.triu(torch.ones(q_len, k_len), diagonal=1 + mlen).bool()[:, :, None]
    mask = causal | (torch.arange(k_len)[None, :, None] < torch.tensor(pad)[None, None, :])  # (Lq, Lk, B): True masks
    plain = attend(q, k, v, rel, mask)
    with maskcli.trace() as t:
        traced = attend(q, k, v, rel, mask)
    assert torch.equal(plain, traced)
    assert [c.shape for c in t.calls] == [(b, h, q_len, k_len)]
    keep = t.calls[0].keep()
    for row in range(b):
        wanted = np.array([[pad[row] <= j <= mlen + i for j in range(k_len)] for i in range(q_len)])
        for head in range(h):
            assert np.array_equal(keep[row, head], wanted), (row, head)
    assert np.array_equal(keep, np.broadcast_to((~mask).permute(2, 0, 1)[:, None].numpy(), keep.shape))
    with maskcli.trace() as t:
        attend(q, k, v, rel, mask, dim=-1)  # (over the heads: no query-by-key weights)
    assert t.calls == []


def test_scores_laid_out_b_lq_h_lk_by_einsum_or_a_permute_are_read_as_b_h_lq_lk():
    """Scores (B, Lq, H, Lk) softmaxed over their last dim, made by einsum("bqhd,bkhd->bqhk") or by q @ kᵀ permuted
    (permute(0, 2, 1, 3), transpose(1, 2)), masked with a mask the program builds in that layout (each head its own
    window, each batch row its own keys): every (b, h) plane is that head's window of that row (a double loop)."""
    g = torch.Generator().manual_seed(1)
    b, h, q_len, k_len, d = 2, 3, 4, 6, 8
    lengths = (6, 5)
    wanted = np.array([[[[k_len - q_len + i - (head + 2) < j <= k_len - q_len + i and j < lengths[row] for j in range(k_len)]
                         for i in range(q_len)] for head in range(h)] for row in range(b)])
    mask = torch.from_numpy(wanted).permute(0, 2, 1, 3).contiguous()  # (B, Lq, H, Lk): True keeps

    def einsum(q, k):  # q (B, Lq, H, D), k (B, Lk, H, D)
        return torch.einsum("bqhd,bkhd->bqhk", q, k)

    def permuted(q, k):
        return (q.transpose(1, 2) @ k.transpose(1, 2).transpose(-1, -2)).permute(0, 2, 1, 3)

    def transposed(q, k):
        return torch.matmul(q.permute(0, 2, 1, 3), k.permute(0, 2, 3, 1)).transpose(1, 2)

    q, k = torch.randn(b, q_len, h, d, generator=g), torch.randn(b, k_len, h, d, generator=g)
    for scores in (einsum, permuted, transposed):
        def attend(q, k):
            return torch.softmax(scores(q, k).masked_fill(~mask, float("-inf")) / d ** 0.5, dim=-1)

        plain = attend(q, k)
        with maskcli.trace() as t:
            traced = attend(q, k)
        assert torch.equal(plain, traced), scores.__name__
        assert [c.shape for c in t.calls] == [(b, h, q_len, k_len)], scores.__name__
        assert np.array_equal(t.calls[0].keep(), wanted), scores.__name__


def test_scores_laid_out_heads_first_by_the_modules_head_count_are_read_as_b_h_lq_lk():
    """icefall's Zipformer attention: q (T, B, H, D) permuted to (H, B, T, D), scores (H, B, T, T) masked with a
    (B, 1, T) key padding broadcast over the heads, softmaxed over the keys; its module holds num_heads = H. Read as
    (B, H, Lq, Lk): every (b, h) plane is row b's padding (a double loop). Where the module's head count is the
    second axis (the usual (B, H, ..)), nothing is turned."""
    torch.manual_seed(0)
    heads, b, t, d = 4, 2, 6, 8
    lengths = (6, 4)

    class Attention(torch.nn.Module):
        def __init__(self, num_heads):
            super().__init__()
            self.num_heads = num_heads

        def forward(self, q, k, pad):  # pad (B, 1, T) over (H, B, T, T), or (B, 1, 1, T) over (B, H, T, T)
            scores = torch.matmul(q, k.transpose(-1, -2))
            return scores.masked_fill(pad, float("-inf")).softmax(dim=-1)

    pad = torch.arange(t)[None, :] >= torch.tensor(lengths)[:, None]  # (B, T): True = padding
    q, k = torch.randn(heads, b, t, d), torch.randn(heads, b, t, d)
    with maskcli.trace() as traced:
        Attention(heads)(q, k, pad.unsqueeze(1))
    assert [c.shape for c in traced.calls] == [(b, heads, t, t)]
    keep = traced.calls[0].keep()
    for row in range(b):
        wanted = np.array([[j < lengths[row] for j in range(t)] for i in range(t)])
        for head in range(heads):
            assert np.array_equal(keep[row, head], wanted), (row, head)
    with maskcli.trace() as traced:  # (B, H, ..) with its own head count second: as it is
        Attention(b)(q, k, pad.repeat(2, 1)[:, None, None, :])
    assert [c.shape for c in traced.calls] == [(heads, b, t, t)]
    assert np.array_equal(traced.calls[0].keep()[2, 1, 0], np.arange(t) < lengths[0])
