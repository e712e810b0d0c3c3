"""An encoder that unpads a left-padded batch by taking each row's first `attention_mask.sum()` tokens.

Written another way than diffusers#14115 (tests/data/bugs/diffusers_fa3_varlen_hub_mask_taken_as_key_prefix.py):
keys laid (B, H, L, D), a 0/1 integer `attention_mask` (B, L) from a tokenizer that pads on the LEFT, and the
sequences run one at a time through SDPA after slicing `q[b, :, :n]`, `k[b, :, :n]` (a right-padding habit): on a
left-padded row that takes the pads and drops the last real tokens. Fixed: index by the mask itself
(`k[b, :, attention_mask[b].bool()]`), which holds on either side.
"""
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


class UnpaddedSelfAttention(nn.Module):
    def __init__(self, dim=24, heads=3):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)

    def forward(self, x, attention_mask):
        b, length, d = x.shape
        q, k, v = self.qkv(x).view(b, length, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)  # (B, H, L, D)
        out = torch.zeros(b, self.heads, length, d // self.heads)
        for i in range(b):
            if FIXED:
                keep = attention_mask[i].bool()
                qi, ki, vi = q[i][:, keep], k[i][:, keep], v[i][:, keep]
                out[i][:, keep] = F.scaled_dot_product_attention(qi[None], ki[None], vi[None])[0]
            else:
                n = int(attention_mask[i].sum())
                qi, ki, vi = q[i, :, :n], k[i, :, :n], v[i, :, :n]
                out[i, :, :n] = F.scaled_dot_product_attention(qi[None], ki[None], vi[None])[0]
        return out.transpose(1, 2).reshape(b, length, d)


def main():
    torch.manual_seed(0)
    layer = UnpaddedSelfAttention().eval()
    attention_mask = torch.tensor([[1, 1, 1, 1, 1, 1, 1], [0, 0, 0, 1, 1, 1, 1], [0, 1, 1, 1, 1, 1, 1]])
    x = torch.randn(3, 7, 24)
    with torch.no_grad():
        y = layer(x, attention_mask)
    print("out", tuple(y.shape), [round(v, 4) for v in y[1, -1, :3].tolist()])


if __name__ == "__main__":
    main()
