"""A left-padded batch whose `key_padding_mask` (True = padding) becomes an additive bias over the query rows: written
otherwise than Pix2Struct#23974 (checks/queryaxis.py's padding-on-queries).

Bug: `bias = key_padding_mask.unsqueeze(1).unsqueeze(-1)` is (B, 1, L, 1): the padded query rows get finfo.min on
every key (uniform weights), while each real query still attends the pads on its left (SDPA with a float mask).
Fix: `key_padding_mask.unsqueeze(1).unsqueeze(2)`, (B, 1, 1, L): the padding keys are hidden.
"""
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class Block(nn.Module):
    def __init__(self, dim=8, heads=2):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)

    def forward(self, x, key_padding_mask):
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        hidden = key_padding_mask.unsqueeze(1).unsqueeze(2) if FIXED else key_padding_mask.unsqueeze(1).unsqueeze(-1)
        bias = torch.zeros(hidden.shape, dtype=x.dtype).masked_fill(hidden, torch.finfo(x.dtype).min)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        return x + out.transpose(1, 2).reshape(b, n, d)


def encode(block, sequences):
    width = max(len(s) for s in sequences)
    x = torch.stack([torch.cat([torch.zeros(width - len(s), 8), s]) for s in sequences])
    key_padding_mask = torch.tensor([[j < width - len(s) for j in range(width)] for s in sequences])
    return block(x, key_padding_mask)


if __name__ == "__main__":
    block = Block().eval()
    a, c = torch.randn(4, 8), torch.randn(2, 8)
    with torch.no_grad():
        out = encode(block, [a, c])
        alone = encode(block, [c])
    print("fixed" if FIXED else "buggy", "padded vs alone:", f"{(out[1, -2:] - alone[0]).abs().max().item():.4f}")
