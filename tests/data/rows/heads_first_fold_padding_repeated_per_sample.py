"""An encoder that folds its heads into the batch head-major (`permute(2, 0, 1, 3)`: row h * B + b), but lays its
(B, L) key padding on those rows sample by sample (`repeat_interleave(H, 0)`: row b * H + h), so most heads of each
utterance are masked with another's padding; the fix repeats it head-major (`repeat(H, 1, 1)`), as the scores are.
Checked: each utterance of the fix matches it run alone."""
import sys

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv


class Encoder(nn.Module):
    def __init__(self, d=16, heads=4):
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)

    def split(self, x):
        b, n, _ = x.shape
        return x.view(b, n, self.heads, -1).permute(2, 0, 1, 3).contiguous().view(self.heads * b, n, -1)

    def forward(self, feats, lengths):
        b, n, d = feats.shape
        q, k, v = self.split(self.q(feats)), self.split(self.k(feats)), self.split(self.v(feats))
        pad = torch.arange(n)[None, :] >= lengths[:, None]  # (B, L): True on padded frames
        pad = pad.repeat(self.heads, 1) if FIXED else pad.repeat_interleave(self.heads, 0)
        scores = torch.bmm(q, k.transpose(1, 2)) / (d // self.heads) ** 0.5
        scores = scores.masked_fill(pad[:, None, :], float("-inf"))
        out = torch.bmm(scores.softmax(-1), v)  # (H * B, L, d / H)
        return out.view(self.heads, b, n, -1).permute(1, 2, 0, 3).reshape(b, n, d)


torch.manual_seed(0)
model = Encoder().eval()
feats, lengths = torch.randn(3, 7, 16), torch.tensor([7, 4, 5])
with torch.no_grad():
    out = model(feats, lengths)
    alone = model(feats[1:2, :4], lengths[1:2])
print("utterance 1, frame 0:", out[1, 0, :4].numpy().round(3))
if FIXED:
    assert torch.allclose(out[1, :4], alone[0], atol=1e-5)
