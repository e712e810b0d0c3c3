"""A BERT-style encoder that adds its padding flags (1 = pad) to the scores as they are.

Written for maskcli's ones-added rule on eager scores (a second program beside QEfficient#1159, written another
way): heads folded into the batch (torch.bmm, (B*H, L, L)), a right-padded batch, the key padding flags cast to
float and added in place (`scores += pad`), so the padded keys get +1 instead of a large negative value.
Fix: add `pad * -1e9`.
"""
import sys

import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv


class SelfAttention(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)

    def forward(self, x, pad):
        b, t, d = x.shape
        h = self.heads
        fold = lambda z: z.reshape(b, t, h, d // h).transpose(1, 2).reshape(b * h, t, d // h)
        q, k, v = fold(self.q(x)), fold(self.k(x)), fold(self.v(x))
        scores = torch.bmm(q, k.transpose(1, 2)) * (d // h) ** -0.5
        bias = pad.float().repeat_interleave(h, dim=0)[:, None, :]  # (B*H, 1, L)
        if FIXED:
            bias = bias * -1e9
        scores += bias
        weights = F.softmax(scores, dim=-1)
        return torch.bmm(weights, v).reshape(b, h, t, d // h).transpose(1, 2).reshape(b, t, d)


if __name__ == "__main__":
    torch.manual_seed(0)
    attn = SelfAttention(16, 4).eval()
    lengths = torch.tensor([5, 3])
    pad = torch.arange(5)[None, :] >= lengths[:, None]  # True = padding
    x = torch.randn(2, 5, 16)
    with torch.no_grad():
        out = attn(x, pad)
    print("row 1 token 0", [round(v, 4) for v in out[1, 0, :3].tolist()])
