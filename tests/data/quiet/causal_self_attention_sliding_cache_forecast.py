"""A correct decoder-only forecaster (a lag-llama / nanoGPT-style time-series model): its attention class is named
`CausalSelfAttention`, its model call is given float features (no token ids), the first pass of a cached forecast is
causal and the later steps each add one query to a cache that slides (drops its oldest step), so the key count stays
the context's. A model that names its layer causal and keeps it so: no finding. Beside it an encoder layer of the
same program (`SelfAttention`, over the same context, both ways, no cache), which names nothing causal."""
import torch
import torch.nn as nn
import torch.nn.functional as F


class CausalSelfAttention(nn.Module):
    def __init__(self, dim=16, heads=2):
        super().__init__()
        self.heads, self.qkv, self.out = heads, nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.cache = None

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = (z.view(b, t, self.heads, -1).transpose(1, 2) for z in self.qkv(x).chunk(3, dim=-1))
        first = self.cache is None
        if not first:
            k = torch.cat([self.cache[0], k], dim=2)[:, :, 1:]
            v = torch.cat([self.cache[1], v], dim=2)[:, :, 1:]
        self.cache = (k, v)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=first)  # (a step's one query sees the whole cache)
        return self.out(y.transpose(1, 2).reshape(b, t, d))


class SelfAttention(nn.Module):
    def __init__(self, dim=16, heads=2):
        super().__init__()
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)

    def forward(self, x):
        return self.attn(x, x, x, need_weights=False)[0]


class Forecaster(nn.Module):
    def __init__(self, features=5, dim=16):
        super().__init__()
        self.embed, self.head = nn.Linear(features, dim), nn.Linear(dim, features)
        self.context = SelfAttention(dim)
        self.layers = nn.ModuleList(CausalSelfAttention(dim) for _ in range(2))

    def forward(self, past_values, encode=False):
        h = self.embed(past_values)
        if encode:
            h = h + self.context(h)
        for layer in self.layers:
            h = h + layer(h)
        return self.head(h)


torch.manual_seed(0)
model = Forecaster().eval()
series = torch.randn(2, 7, 5)
with torch.no_grad():
    out = model(series, encode=True)
    for _ in range(3):
        nxt = out[:, -1:]
        out = model(nxt)
        series = torch.cat([series, nxt], dim=1)
print("forecast", tuple(series.shape))
