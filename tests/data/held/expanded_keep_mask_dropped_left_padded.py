"""A left-padded encoder (a batch of prompts padded on the left, as a decoder-only embedder pads them) whose forward
expands the padding into a (B, L, L) keep mask over the cells (`attn_mask`, True = may attend) and hands it to each
layer, whose attention module drops it on the way to its softmax: every token attends the left padding. --fixed
passes it on.
"""
import sys

import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv
PAD = 3


class SelfAttention(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.qkv = nn.Linear(width, 3 * width)

    def forward(self, x, attn_mask=None):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        scores = q @ k.transpose(-1, -2) / x.shape[-1] ** 0.5
        if attn_mask is not None:
            scores = scores.masked_fill(attn_mask.logical_not(), torch.finfo(scores.dtype).min)
        return F.softmax(scores, dim=-1) @ v


class Layer(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.attention = SelfAttention(width)
        self.mlp = nn.Sequential(nn.Linear(width, width), nn.GELU())

    def forward(self, x, attn_mask):
        x = x + (self.attention(x, attn_mask) if FIXED else self.attention(x))
        return x + self.mlp(x)


class Embedder(nn.Module):
    def __init__(self, vocab=50, width=16, depth=2):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.layers = nn.ModuleList(Layer(width) for _ in range(depth))

    def forward(self, ids, valid):
        length = ids.shape[1]
        attn_mask = valid[:, None, :].expand(-1, length, -1)  # (B, L, L): query i may see key j
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x, attn_mask)
        return x[:, -1]  # last token pooling (left padding puts every row's last token at the end)


def main():
    torch.manual_seed(0)
    ids = torch.tensor([[PAD, PAD, 7, 8, 9], [10, 11, 12, 13, 14], [PAD, PAD, PAD, 15, 16]])
    valid = ids != PAD
    with torch.no_grad():
        pooled = Embedder().eval()(ids, valid)
    print("pooled", tuple(pooled.shape))


if __name__ == "__main__":
    main()
