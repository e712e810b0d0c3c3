# Written another way for padding-holds-fill (the google-research/timesfm 1b95563 bug, in the style of a praxis /
# lingvo encoder ported to PyTorch): a right-padded batch of frame features, `padding` flags of 1.0 on the padded
# frames, each layer zeroing its output there (`x * (1 - padding)`) and the classifier pooling the real frames. The
# encoder builds its additive mask as `padding.view(b, 1, 1, n).mul_(-1e9)`: the view is multiplied in place, so the
# flags every layer and the pooling read hold -1e9; the padded frames blow up and the pooled mean is wrong. The fix
# multiplies out of place (`padding.view(b, 1, 1, n) * -1e9`).
import sys

import torch
from torch import nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class EncoderLayer(nn.Module):
    def __init__(self, d=16, heads=2):
        super().__init__()
        self.heads = heads
        self.qkv, self.out = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.ff = nn.Sequential(nn.Linear(d, 32), nn.ReLU(), nn.Linear(32, d))
        self.norm = nn.LayerNorm(d)

    def forward(self, x, atten_mask, padding):
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        logits = q @ k.transpose(-1, -2) / (d // self.heads) ** 0.5 + atten_mask
        y = (logits.softmax(-1) @ v).transpose(1, 2).reshape(b, n, d)
        x = self.norm(x + self.out(y))
        return (x + self.ff(x)) * (1.0 - padding)[..., None]


class FrameClassifier(nn.Module):
    def __init__(self, d=16, layers=2, classes=3):
        super().__init__()
        self.proj = nn.Linear(4, d)
        self.layers = nn.ModuleList(EncoderLayer(d) for _ in range(layers))
        self.head = nn.Linear(d, classes)

    def forward(self, features, padding):
        b, n, _ = features.shape
        atten_mask = padding.view(b, 1, 1, n) * -1e9 if FIXED else padding.view(b, 1, 1, n).mul_(-1e9)
        x = self.proj(features)
        for layer in self.layers:
            x = layer(x, atten_mask, padding)
        real = 1.0 - padding
        return self.head((x * real[..., None]).sum(1) / real.sum(1, keepdim=True))


model = FrameClassifier().eval()
lengths = torch.tensor([6, 9, 4])
features = torch.randn(3, 9, 4)
with torch.no_grad():
    padding = (torch.arange(9)[None, :] >= lengths[:, None]).float()
    batched = model(features, padding)
    alone = model(features[:1, :6], torch.zeros(1, 6))
print(f"fixed={FIXED}: |logits of clip 0 in the batch - alone| = {(batched[0] - alone[0]).abs().max().item():.3e}")
