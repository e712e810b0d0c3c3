"""A Llama-style model (forward(tokens, start_pos), its own KV cache) whose window bias is laid on the chunk's rows.

Bug: each chunk's mask is causal by position (start_pos columns of zeros, then triu), but the sliding window's bias is
`full(-inf).tril(-W)` on the (seqlen, start_pos + seqlen) grid: row i masks keys up to i - W, the window of position
i, not of position start_pos + i, so from the second chunk on a query sees every earlier key back to key 0 .. (i - W
+ 1). Fix: `tril(start_pos - W)`. The window is stated in a dataclass the model keeps (self.params); a batch of two,
a prompt of 8 in chunks of 4, then decode steps.
"""
import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv


@dataclass
class ModelArgs:
    dim: int = 8
    n_heads: int = 2
    sliding_window: int = 3
    max_seq_len: int = 16


class Transformer(nn.Module):
    def __init__(self, params: ModelArgs):
        super().__init__()
        self.params = params
        self.wqkv = nn.Linear(params.dim, 3 * params.dim)
        self.cache_k = torch.zeros(2, params.n_heads, params.max_seq_len, params.dim // params.n_heads)
        self.cache_v = torch.zeros_like(self.cache_k)

    def forward(self, h, start_pos: int):
        b, seqlen, d = h.shape
        heads = self.params.n_heads
        q, k, v = (z.view(b, seqlen, heads, d // heads).transpose(1, 2) for z in self.wqkv(h).chunk(3, dim=-1))
        self.cache_k[:b, :, start_pos:start_pos + seqlen] = k
        self.cache_v[:b, :, start_pos:start_pos + seqlen] = v
        keys, values = self.cache_k[:b, :, :start_pos + seqlen], self.cache_v[:b, :, :start_pos + seqlen]
        mask = torch.full((seqlen, seqlen), float("-inf")).triu(1)
        mask = torch.hstack([torch.zeros(seqlen, start_pos), mask])
        shift = start_pos if FIXED else 0
        mask = mask + torch.full((seqlen, start_pos + seqlen), float("-inf")).tril(shift - self.params.sliding_window)
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask).transpose(1, 2).reshape(b, seqlen, d)


def main():
    torch.manual_seed(0)
    model = Transformer(ModelArgs()).eval()
    prompt = torch.randn(2, 8, 8)
    with torch.no_grad():
        h = model(prompt[:, :4], 0)
        h = model(prompt[:, 4:], 4)
        for pos in range(8, 11):
            h = model(h[:, -1:], pos)
    print("out", round(float(h.abs().sum()), 4))


if __name__ == "__main__":
    main()
