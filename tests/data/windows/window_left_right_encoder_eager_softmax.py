"""A local-attention encoder (ModernBERT style, written as a hand-made eager softmax): each local layer holds its
window both ways as `window_left` and `window_right` (here 2 and 2: |i - j| <= 2) on the way to the attention, over a
right-padded batch (lengths 10 and 6, key padding from the lengths). The buggy run's fast path (taken when no key is
padded in the first row) forgets the window and masks the padding alone; the fixed run keeps the band."""
import sys

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


def eager_local_attention(q, k, v, key_real, window_left, window_right, fast):
    scores = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
    L = q.shape[-2]
    i = torch.arange(L)[:, None]
    j = torch.arange(L)[None, :]
    keep = key_real[:, None, None, :]
    if not fast:
        keep = keep & (j >= i - window_left) & (j <= i + window_right)
    scores = scores.masked_fill(~keep, torch.finfo(scores.dtype).min)
    return scores.softmax(-1) @ v


class LocalEncoderLayer(nn.Module):
    def __init__(self, dim=16, heads=2, window_left=2, window_right=2):
        super().__init__()
        self.heads, self.window_left, self.window_right = heads, window_left, window_right
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x, lengths):
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        key_real = torch.arange(n)[None, :] < lengths[:, None]
        fast = bool(key_real[0].all()) and not FIXED
        y = eager_local_attention(q, k, v, key_real, self.window_left, self.window_right, fast)
        return x + self.out(y.transpose(1, 2).reshape(b, n, d))


class LocalEncoder(nn.Module):
    def __init__(self, vocab=40, dim=16, depth=2):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList([LocalEncoderLayer(dim) for _ in range(depth)])

    def forward(self, input_ids, lengths):
        h = self.embed(input_ids)
        for layer in self.layers:
            h = layer(h, lengths)
        return h


lengths = torch.tensor([10, 6])
ids = torch.randint(1, 40, (2, 10)) * (torch.arange(10)[None, :] < lengths[:, None])
model = LocalEncoder().eval()
with torch.no_grad():
    out = model(ids, lengths)
print(f"fixed={FIXED} output norm {out.norm():.3f}")
