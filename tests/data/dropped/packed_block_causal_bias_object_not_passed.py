"""A packed decoder whose attend() is handed an xformers-style BlockDiagonalCausalMask that its fast path drops.

Written for maskcli's tests (not a published bug): the second program that mask-argument-dropped catches through a
block-diagonal mask *object* (the first: mistral-inference#218's Pixtral block, tests/data/bugs). Three documents of
3, 4 and 2 tokens are packed into one row; `BlockDiagonalCausalMask.from_seqlens` states them as xformers does
(`q_seqinfo` / `k_seqinfo` with `seqstart_py`). The bug: the fast path of `attend` calls SDPA with `is_causal=True`
and never turns the object into a mask, so each document's tokens see the tail of the documents before them.
Fix (--fixed): materialise the object's blocks (each causal) and hand them to SDPA.
"""
import sys

import torch
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


class _SeqInfo:
    def __init__(self, seqlens):
        self.seqstart_py = [0]
        for n in seqlens:
            self.seqstart_py.append(self.seqstart_py[-1] + n)


class BlockDiagonalCausalMask:
    """The fields of xformers.ops.fmha.attn_bias.BlockDiagonalCausalMask used here."""

    def __init__(self, q_seqinfo, k_seqinfo):
        self.q_seqinfo, self.k_seqinfo = q_seqinfo, k_seqinfo

    @classmethod
    def from_seqlens(cls, seqlens):
        return cls(_SeqInfo(seqlens), _SeqInfo(seqlens))

    def to_dense(self, n):
        starts = self.q_seqinfo.seqstart_py
        doc = torch.zeros(n, dtype=torch.long)
        for i in range(len(starts) - 1):
            doc[starts[i]:starts[i + 1]] = i
        pos = torch.arange(n)
        return (doc[:, None] == doc[None, :]) & (pos[None, :] <= pos[:, None])


def attend(q, k, v, attn_bias=None, fast=True):
    if fast and not FIXED:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    mask = None if attn_bias is None else attn_bias.to_dense(q.shape[-2])
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def layer(x, weights, attn_bias):
    b, n, d = x.shape
    q, k, v = (x @ weights[0]).view(b, n, 2, d // 2).transpose(1, 2), x @ weights[1], x @ weights[2]
    k = k.view(b, n, 2, d // 2).transpose(1, 2)
    v = v.view(b, n, 2, d // 2).transpose(1, 2)
    return x + attend(q, k, v, attn_bias=attn_bias).transpose(1, 2).reshape(b, n, d)


def main():
    torch.manual_seed(0)
    d, seqlens = 8, [3, 4, 2]
    x = torch.randn(1, sum(seqlens), d)
    weights = [torch.randn(d, d) / d ** 0.5 for _ in range(3)]
    bias = BlockDiagonalCausalMask.from_seqlens(seqlens)
    out = x
    for _ in range(2):
        out = layer(out, weights, bias)
    print("fixed" if FIXED else "buggy", f"{out.sum().item():.4f}")


if __name__ == "__main__":
    main()
