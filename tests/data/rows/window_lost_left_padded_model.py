"""Hand-written decoder, left-padded batch: the prefill keeps the window, decode drops it (--fixed keeps it)."""
import sys
import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
W = 3


class Attn(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)

    def forward(self, x, mask, cache):
        q, k, v = self.qkv(x).unsqueeze(1).chunk(3, dim=-1)
        if cache is not None:
            k, v = torch.cat([cache[0], k], 2), torch.cat([cache[1], v], 2)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask), (k, v)


class Model(nn.Module):
    def __init__(self, d=8):
        super().__init__()
        self.emb = nn.Embedding(20, d)
        self.attn = Attn(d)

    def forward(self, input_ids, attention_mask, cache=None):
        x = self.emb(input_ids)
        total = attention_mask.shape[1]
        q_pos = torch.arange(total - input_ids.shape[1], total)
        k_pos = torch.arange(total)
        keep = attention_mask.bool()[:, None, None, :] & (k_pos[None, :] <= q_pos[:, None])
        if cache is None or FIXED:
            keep = keep & (q_pos[:, None] - k_pos[None, :] < W)
        keep = keep | ~keep.any(-1, keepdim=True)  # padding rows see every key, as HF's SDPA path does (no NaN)
        return self.attn(x, keep, cache)


torch.manual_seed(0)
model = Model()
ids = torch.tensor([[0, 0, 5, 6, 7, 8], [1, 2, 3, 4, 5, 6]])
am = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
out, cache = model(ids, am)
for _ in range(3):
    am = torch.cat([am, torch.ones(2, 1, dtype=am.dtype)], 1)
    out, cache = model(torch.tensor([[9], [9]]), am, cache)
