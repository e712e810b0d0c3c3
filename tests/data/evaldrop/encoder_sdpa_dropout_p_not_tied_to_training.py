"""A hand-written text encoder whose attention hands SDPA its dropout rate whatever the module's mode.

`dropout_p=self.attn_dropout` (not `self.attn_dropout if self.training else 0.0`): after `model.eval()` every forward
still drops attention weights at random, so encoding the same batch twice gives two different embeddings. --fixed ties
the rate to the mode; --functional writes the weights out by hand and drops them with `F.dropout(attn, p)`, whose
`training` defaults to True (its --fixed passes `training=self.training`); --train runs the model in training mode,
where dropping is meant.
"""
import sys

import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv
FUNCTIONAL = "--functional" in sys.argv
TRAIN = "--train" in sys.argv
torch.manual_seed(0)


class SelfAttention(nn.Module):
    def __init__(self, dim, heads, attn_dropout=0.2):
        super().__init__()
        self.heads, self.attn_dropout = heads, attn_dropout
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x, keep):
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        allowed = keep[:, None, None, :]
        if FUNCTIONAL:
            scores = (q @ k.transpose(-1, -2)) / (d // self.heads) ** 0.5
            attn = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
            attn = F.dropout(attn, self.attn_dropout, training=self.training) if FIXED else F.dropout(attn, self.attn_dropout)
            y = attn @ v
        else:
            p = (self.attn_dropout if self.training else 0.0) if FIXED else self.attn_dropout
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, dropout_p=p)
        return self.out(y.transpose(1, 2).reshape(b, n, d))


class Encoder(nn.Module):
    def __init__(self, vocab=30, dim=16, heads=2, layers=2):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim, padding_idx=0)
        self.layers = nn.ModuleList(SelfAttention(dim, heads) for _ in range(layers))

    def forward(self, ids, keep):
        x = self.embed(ids)
        for layer in self.layers:
            x = x + layer(x, keep)
        return (x * keep[..., None]).sum(1) / keep.sum(1, keepdim=True)


model = Encoder()
model.train(TRAIN)
ids = torch.tensor([[5, 6, 7, 8, 9], [3, 4, 2, 0, 0]])
keep = ids != 0
with torch.no_grad():
    first, second = model(ids, keep), model(ids, keep)
print("two encodings of one batch differ by", float((first - second).abs().max()))
