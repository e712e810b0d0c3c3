"""A hand-written T5-style encoder whose loop over the layers drops the position bias its first layer computes
(maskcli's own reproduction of pytorch/audio#3350's kind of bug, written another way: eager softmax, not SDPA).

Only layer 0 holds the relative-attention-bias embedding (`has_relative_attention_bias = i == 0`, as T5 does); it
returns the bias it computed and every later layer takes it as `position_bias`. The buggy loop keeps only the hidden
states (`x, _ = layer(x, pad)`), so layers 1-3 attend with no position bias at all; the fix threads it on. A
right-padded batch of three sentences, the padding masked with masked_fill(-inf) in every layer.
"""

import math
import sys

import torch
from torch import nn

FIXED = "--fixed" in sys.argv


def relative_bucket(relative_position, num_buckets=16, max_distance=32):
    """T5's bidirectional bucketing of k - q."""
    num_buckets //= 2
    buckets = (relative_position > 0).long() * num_buckets
    n = relative_position.abs()
    max_exact = num_buckets // 2
    large = max_exact + (torch.log(n.float().clamp(min=1) / max_exact) / math.log(max_distance / max_exact)
                         * (num_buckets - max_exact)).long()
    large = torch.minimum(large, torch.full_like(large, num_buckets - 1))
    return buckets + torch.where(n < max_exact, n, large)


class Attention(nn.Module):
    def __init__(self, d, heads, has_relative_attention_bias):
        super().__init__()
        self.heads, self.d = heads, d
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.o = nn.Linear(d, d, bias=False)
        self.relative_attention_bias = nn.Embedding(16, heads) if has_relative_attention_bias else None

    def compute_bias(self, n):
        position = torch.arange(n)
        buckets = relative_bucket(position[None, :] - position[:, None])
        return self.relative_attention_bias(buckets).permute(2, 0, 1)[None]  # (1, H, n, n)

    def forward(self, x, pad, position_bias=None):
        b, n, _ = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-1, -2)
        if position_bias is None and self.relative_attention_bias is not None:
            position_bias = self.compute_bias(n)
        if position_bias is not None:
            scores = scores + position_bias
        scores = scores.masked_fill(pad[:, None, None, :], float("-inf"))
        out = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, n, self.d)
        return self.o(out), position_bias


class Layer(nn.Module):
    def __init__(self, d, heads, first):
        super().__init__()
        self.attention = Attention(d, heads, first)
        self.norm = nn.LayerNorm(d)
        self.ff = nn.Sequential(nn.Linear(d, 2 * d), nn.ReLU(), nn.Linear(2 * d, d))

    def forward(self, x, pad, position_bias=None):
        y, position_bias = self.attention(self.norm(x), pad, position_bias)
        x = x + y
        return x + self.ff(x), position_bias


class Encoder(nn.Module):
    def __init__(self, vocab=40, d=32, heads=4, layers=4):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(Layer(d, heads, i == 0) for i in range(layers))

    def forward(self, ids, pad):
        x, position_bias = self.embed(ids), None
        for layer in self.layers:
            if FIXED:
                x, position_bias = layer(x, pad, position_bias)
            else:
                x, _ = layer(x, pad)
        return x


torch.manual_seed(0)
model = Encoder().eval()
lengths = torch.tensor([10, 7, 4])
ids = torch.randint(1, 40, (3, 10))
pad = torch.arange(10)[None, :] >= lengths[:, None]
ids = ids.masked_fill(pad, 0)
with torch.no_grad():
    hidden = model(ids, pad)
for row, length in enumerate(lengths.tolist()):
    print(f"sentence {row}: mean of its {length} states {hidden[row, :length].mean().item():+.5f}")
