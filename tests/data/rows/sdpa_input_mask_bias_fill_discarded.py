"""A set encoder over float features given `input_mask` (1 = a real element, right-padded), whose additive bias for
SDPA is filled out of place and the result discarded: the bias stays zero and every real element attends the padding
(--fixed: `masked_fill_`, in place)."""
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


class SetBlock(nn.Module):
    def __init__(self, dim=8, heads=2):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)

    def forward(self, x, bias):
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        return x + out.transpose(1, 2).reshape(b, n, d)


class SetEncoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(3, 8)
        self.blocks = nn.ModuleList([SetBlock(), SetBlock()])

    def forward(self, features, input_mask):
        bias = torch.zeros(features.shape[0], 1, 1, features.shape[1])
        if FIXED:
            bias.masked_fill_(input_mask[:, None, None, :] == 0, float("-inf"))
        else:
            bias.masked_fill(input_mask[:, None, None, :] == 0, float("-inf"))
        x = self.proj(features)
        for block in self.blocks:
            x = block(x, bias)
        return (x * input_mask[..., None]).sum(1)


if __name__ == "__main__":
    torch.manual_seed(0)
    lengths = torch.tensor([5, 2, 4])
    input_mask = (torch.arange(5)[None, :] < lengths[:, None]).long()
    with torch.no_grad():
        pooled = SetEncoder().eval()(torch.randn(3, 5, 3), input_mask)
    print("pooled", pooled.sum(-1).tolist())
