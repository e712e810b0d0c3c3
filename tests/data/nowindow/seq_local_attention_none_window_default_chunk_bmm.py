# Written another way (the bug of lucidrains/vit-pytorch c2b2db2, on a sequence): a 1-D local attention over (B, N, D)
# tokens whose module states `window_size=None` for its global layers; its chunking falls back to a default chunk of
# a quarter of the sequence for a missing window, so the "global" layer attends in 4 chunks. Heads folded into the
# batch for torch.bmm, softmax by hand. The fix chunks a None window as the whole sequence.
import sys

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class LocalAttention(nn.Module):
    def __init__(self, dim, heads, window_size=None):
        super().__init__()
        self.heads, self.window_size = heads, window_size
        self.qkv, self.out = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x):
        B, N, D = x.shape
        w = self.window_size or (N if FIXED else N // 4)
        d = D // self.heads
        t = self.qkv(x).view(B, N // w, w, 3, self.heads, d).permute(3, 0, 1, 4, 2, 5).reshape(3, -1, w, d)
        q, k, v = t[0], t[1], t[2]
        weights = torch.bmm(q, k.transpose(1, 2)).mul(d ** -0.5).softmax(dim=-1)
        out = torch.bmm(weights, v).view(B, N // w, self.heads, w, d).permute(0, 1, 3, 2, 4).reshape(B, N, D)
        return x + self.out(out)


layers = nn.Sequential(LocalAttention(16, 2, window_size=8), LocalAttention(16, 2, window_size=None))
x = torch.randn(2, 32, 16)
loss = layers(x).pow(2).mean()
loss.backward()
print("fixed" if FIXED else "buggy", "loss %.5f" % loss.item())
