# Correct, of a shape dropout-keeps-padding-share reads: a Linformer-style encoder layer in training over a right-padded
# batch, its keys projected from n = 16 positions to k = 12 (the 0.75 share of a `dropout = 0.25` it states), the padded
# positions zeroed before the projection. Every row sees all 12 projected keys: no sequence dropout, nothing to say.
import sys

import torch
from torch import nn

torch.manual_seed(0)


class LinformerSelfAttention(nn.Module):
    def __init__(self, dim=32, heads=4, seq_len=16, k=12, dropout=0.25):
        super().__init__()
        self.heads, self.dropout = heads, dropout
        self.to_q, self.to_k, self.to_v = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.proj_k = nn.Parameter(torch.randn(seq_len, k) / seq_len ** 0.5)
        self.proj_v = nn.Parameter(torch.randn(seq_len, k) / seq_len ** 0.5)
        self.drop = nn.Dropout(dropout)
        self.out = nn.Linear(dim, dim)

    def forward(self, x, mask):
        b, n, d = x.shape
        h = self.heads
        x = x * mask[..., None]
        q = self.to_q(x).view(b, n, h, -1).transpose(1, 2)
        k = torch.einsum("bnd,nk->bkd", self.to_k(x), self.proj_k).view(b, -1, h, d // h).transpose(1, 2)
        v = torch.einsum("bnd,nk->bkd", self.to_v(x), self.proj_v).view(b, -1, h, d // h).transpose(1, 2)
        scores = q @ k.transpose(-1, -2) * (d // h) ** -0.5
        attn = self.drop(scores.softmax(dim=-1))
        return self.out((attn @ v).transpose(1, 2).reshape(b, n, d))


class Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.dropout = 0.25
        self.attn = LinformerSelfAttention(dropout=self.dropout)
        self.norm = nn.LayerNorm(32)

    def forward(self, x, mask):
        return x + self.attn(self.norm(x), mask)


model = Encoder().train()
lengths = torch.tensor([16, 5, 10])
mask = (torch.arange(16)[None, :] < lengths[:, None]).long()
out = model(torch.randn(3, 16, 32), mask)
out.pow(2).mean().backward()
print("fixed" if "--fixed" in sys.argv else "buggy", tuple(out.shape))
