"""A hand-written sliding-window decoder (its window in a SimpleNamespace held as `self.args`) generating from a
left-padded batch with a KV cache: the prefill mask has the window, each decode step's mask is the attention_mask
alone, so a new token sees its whole past; --fixed: the window and-ed at decode too."""

import sys
from types import SimpleNamespace

import torch
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


class Attention(torch.nn.Module):
    def __init__(self, args):
        super().__init__()
        self.qkv = torch.nn.Linear(args.dim, 3 * args.dim)

    def forward(self, x, keep, cache):
        q, k, v = self.qkv(x).unsqueeze(1).chunk(3, dim=-1)
        if cache:
            k, v = torch.cat([cache[0], k], dim=2), torch.cat([cache[1], v], dim=2)
        cache[:] = [k, v]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=keep).squeeze(1)


class Decoder(torch.nn.Module):
    def __init__(self, args):
        super().__init__()
        self.args = args
        self.layers = torch.nn.ModuleList(Attention(args) for _ in range(args.n_layers))

    def forward(self, x, attention_mask, caches):
        total, new = attention_mask.shape[1], x.shape[1]
        q = torch.arange(total - new, total)[:, None]
        k = torch.arange(total)[None, :]
        keep = (k <= q) & attention_mask[:, None, None, :].bool()
        if new > 1 or FIXED:
            keep = keep & (q - k < self.args.sliding_window)
        keep = keep | ~keep.any(-1, keepdim=True)  # a padding query sees every key (its output is dropped)
        for layer, cache in zip(self.layers, caches):
            x = x + layer(x, keep, cache)
        return x


torch.manual_seed(0)
args = SimpleNamespace(dim=8, n_layers=2, sliding_window=3)
model = Decoder(args)
mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
caches = [[] for _ in range(args.n_layers)]
with torch.no_grad():
    x = model(torch.randn(2, 6, 8), mask, caches)
    for _ in range(3):
        mask = torch.cat([mask, torch.ones(2, 1, dtype=mask.dtype)], dim=1)
        x = model(x[:, -1:], mask, caches)
