"""A local (sliding-window) causal decoder whose blocked-cells mask is handed to SDPA, which reads True as attend.

Written here, beside checks/ownhidden.py, as Paddle3D#235's slip written another way: the layer builds its window the
nn.MultiheadAttention way, True where a query may not look (`(j > i) | (i - j >= window)`), and hands it on as SDPA's
boolean attn_mask, where True means the query may attend. Each token then sees the keys after it and those more than a
window back, and never itself. Fix: hand SDPA the complement (`~blocked`).
"""
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class LocalAttention(nn.Module):
    def __init__(self, dim=32, heads=4, window=3):
        super().__init__()
        self.heads, self.window = heads, window
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x):
        b, length, dim = x.shape
        q, k, v = self.qkv(x).view(b, length, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        i = torch.arange(length)[:, None]
        j = torch.arange(length)[None, :]
        blocked = (j > i) | (i - j >= self.window)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=~blocked if FIXED else blocked)
        return x + self.out(out.transpose(1, 2).reshape(b, length, dim))


class LocalDecoder(nn.Module):
    def __init__(self, vocab=40, dim=32, layers=2):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(LocalAttention(dim) for _ in range(layers))
        self.head = nn.Linear(dim, vocab)

    def forward(self, ids):
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def main():
    model = LocalDecoder().eval()
    ids = torch.randint(0, 40, (2, 10))
    with torch.no_grad():
        logits = model(ids)
    print("last logits[:, :3]", logits[:, -1, :3].tolist())


if __name__ == "__main__":
    main()
