# Written another way (checks/directions.py, causal-but-said-not): a sentence encoder whose attention module states
# `self.causal = False` hands SDPA `is_causal=attn_mask is None`, meant as "no mask, no masking" and read by SDPA as
# "causal": every batch this encoder sees is of equal length (no padding mask is built), so every call runs causal.
# --fixed: is_causal=self.causal.
import sys

import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class EncoderAttention(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads, self.causal = heads, False
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x, attn_mask=None):
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        causal = self.causal if FIXED else attn_mask is None
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=causal)
        return self.out(y.transpose(1, 2).reshape(b, n, d))


class Block(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = EncoderAttention(dim, heads)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x, attn_mask=None):
        x = x + self.attn(self.norm1(x), attn_mask)
        return x + self.mlp(self.norm2(x))


class SentenceEncoder(nn.Module):
    def __init__(self, vocab=50, dim=32, heads=4, layers=2):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.randn(16, dim) * 0.02)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))

    def forward(self, ids):
        x = self.embed(ids) + self.pos[: ids.shape[1]]
        for block in self.blocks:
            x = block(x)
        return F.normalize(x.mean(dim=1), dim=-1)


model = SentenceEncoder().eval()
with torch.no_grad():
    queries = model(torch.randint(1, 50, (3, 6)))
    documents = model(torch.randint(1, 50, (3, 6)))
print("similarities", [round(float(x), 4) for x in (queries @ documents.T).diagonal()])
