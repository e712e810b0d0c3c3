# Written another way for ones-added (the pytorch-ts d0a19ab bug, in the style of a hand-rolled forecasting decoder on
# F.scaled_dot_product_attention): the future steps and the right-padded steps of each series are marked with 1 in a
# float "hide" mask, `torch.triu(torch.ones(L, L), diagonal=1)` maxed with the padding flags, and that float mask is
# handed to SDPA as attn_mask, which adds it (+1 on a hidden step): every step reads the later ones and the padding.
# The fix hands SDPA the bool keep mask `hide == 0` (True = attend).
import sys

import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class ForecastDecoderLayer(nn.Module):
    def __init__(self, d=16, heads=2):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, d)
        self.ff = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)

    def forward(self, x, hide):
        b, n, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        mask = (hide == 0) if FIXED else hide
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        x = x + self.out(y.transpose(1, 2).reshape(b, n, d))
        return x + self.ff(self.norm2(x))


class Forecaster(nn.Module):
    def __init__(self, d=16, layers=2):
        super().__init__()
        self.embed = nn.Linear(2, d)
        self.layers = nn.ModuleList(ForecastDecoderLayer(d) for _ in range(layers))
        self.head = nn.Linear(d, 1)

    def forward(self, values, time_feat, lengths):
        n = values.shape[1]
        future = torch.triu(torch.ones(n, n), diagonal=1)              # 1 = a later step, hidden
        padded = (torch.arange(n)[None, :] >= lengths[:, None]).float()  # 1 = past the end of the series
        hide = torch.maximum(future[None], padded[:, None, :])[:, None]  # (B, 1, L, L), 1 = hidden
        x = self.embed(torch.stack([values, time_feat], dim=-1))
        for layer in self.layers:
            x = layer(x, hide)
        return self.head(x).squeeze(-1)


model = Forecaster().eval()
lengths = torch.tensor([10, 6, 8])
values = torch.randn(3, 10).cumsum(-1)
values[torch.arange(10)[None, :] >= lengths[:, None]] = 0.0
time_feat = torch.linspace(0, 1, 10).expand(3, 10)
with torch.no_grad():
    before = model(values, time_feat, lengths)
    later = values.clone()
    later[:, 5:] += 10.0                                                # change steps 5.. only
    after = model(later, time_feat, lengths)
print(f"fixed={FIXED}: max |change of the forecast at steps 0-4| when steps 5.. change: "
      f"{(before[:, :5] - after[:, :5]).abs().max().item():.3e}")
