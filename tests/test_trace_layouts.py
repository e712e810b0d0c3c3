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
