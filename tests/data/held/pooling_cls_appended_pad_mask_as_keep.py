"""A pooling encoder that appends a learned summary token after the tokens and hands SDPA the padding mask as its
boolean attn_mask, where SDPA reads True as "attend": the padding is attended, the real tokens hidden.

Written for maskcli's tests (not a published bug): the second program padding-only-attended catches with keys beside
the ones the held padding covers (the first: fastNLP#138's relay node put before the tokens, tests/data/bugs). Here
the extra key comes after the tokens, the mask is `pad_mask` (True = padding), right-padded, and the kernel is SDPA.
Fix (--fixed): hand SDPA `~pad_mask` (True = a real token) for the tokens' keys.
"""
import sys

import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv


class SummaryPooling(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.summary = nn.Parameter(torch.randn(1, 1, dim))
        self.qkv = nn.Linear(dim, 3 * dim)

    def forward(self, x, pad_mask):
        b, n, d = x.shape
        x = torch.cat([x, self.summary.expand(b, 1, d)], dim=1)  # the summary token is key n
        q, k, v = (t.view(b, n + 1, self.heads, -1).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
        tokens = ~pad_mask if FIXED else pad_mask
        keep = torch.cat([tokens, torch.ones(b, 1, dtype=torch.bool)], dim=1)  # the summary is always seen
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=keep[:, None, None, :])
        return out.transpose(1, 2).reshape(b, n + 1, d)[:, -1]


def main():
    torch.manual_seed(0)
    lengths = torch.tensor([5, 3, 2])
    pad_mask = torch.arange(5)[None, :] >= lengths[:, None]  # True = padding
    x = torch.randn(3, 5, 16).masked_fill(pad_mask[..., None], 0.0)
    with torch.no_grad():
        pooled = SummaryPooling(16, 2).eval()(x, pad_mask)
    print("fixed" if FIXED else "buggy", f"{pooled.sum().item():.4f}")


if __name__ == "__main__":
    main()
