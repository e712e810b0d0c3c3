# A point-set classifier trained on padded sets: one attention layer whose mask is the outer product of the real
# flags (query real and key real), filled with -inf, so each padded point's row is -inf everywhere and its softmax
# row NaN. The readout pools the real points only (h[real]), so the forward loss is finite, but backward multiplies
# the NaN rows into the values' gradient and every weight gets NaN. Fixed: mask the keys only (padded queries still
# see the real points; their outputs are dropped as before).
import sys

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class SetAttention(nn.Module):
    def __init__(self, d=16, heads=2):
        super().__init__()
        self.heads, self.dh = heads, d // heads
        self.to_qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)

    def forward(self, x, real):
        b, n, d = x.shape
        q, k, v = self.to_qkv(x).reshape(b, n, 3, self.heads, self.dh).permute(2, 0, 3, 1, 4)
        dots = torch.matmul(q, k.transpose(-1, -2)) * self.dh ** -0.5
        if FIXED:
            pair = real[:, None, None, :]
        else:
            pair = (real[:, :, None] & real[:, None, :])[:, None]
        dots = dots.masked_fill(~pair, float("-inf"))
        attn = dots.softmax(dim=-1)
        out = torch.matmul(attn, v).transpose(1, 2).reshape(b, n, d)
        return x + self.proj(out)


class PointSetClassifier(nn.Module):
    def __init__(self, d=16, classes=3):
        super().__init__()
        self.embed = nn.Linear(3, d)
        self.attn = SetAttention(d)
        self.head = nn.Linear(d, classes)

    def forward(self, points, real):
        h = self.attn(self.embed(points), real)
        pooled = torch.stack([h[i][real[i]].max(0).values for i in range(len(h))])
        return self.head(pooled)


model = PointSetClassifier()
sizes = [6, 4, 5]
points = torch.zeros(3, 6, 3)
real = torch.zeros(3, 6, dtype=torch.bool)
for i, n in enumerate(sizes):
    points[i, :n] = torch.randn(n, 3)
    real[i, :n] = True
loss = nn.functional.cross_entropy(model(points, real), torch.tensor([0, 2, 1]))
loss.backward()
bad = sum(int(torch.isnan(p.grad).any()) for p in model.parameters())
print(f"fixed={FIXED} loss={loss.item():.4f} parameters with NaN gradients: {bad}")
