"""GPT-OSS-style attention (a learned sink logit per head joined to the scores, each row shifted by its max before the
softmax, the sink's weight dropped after), with a config's layer_types alternating sliding and full.

The model builds one causal bias for the forward and hands it to every layer. Buggy: a sliding layer cuts its window
into that shared tensor in place (`masked_fill_`), so every later layer, the full ones too, attends within the window.
Fixed: the sliding layer fills a copy.
"""

import sys
from typing import NamedTuple

import torch
from torch import nn

FIXED = "--fixed" in sys.argv


class Settings(NamedTuple):
    hidden: int = 16
    heads: int = 2
    window: int = 3
    layer_types: tuple = ("sliding_attention", "full_attention", "sliding_attention", "full_attention")


class Attention(nn.Module):
    def __init__(self, cfg, sliding):
        super().__init__()
        self.heads, self.sliding, self.window = cfg.heads, sliding, cfg.window
        self.qkv = nn.Linear(cfg.hidden, 3 * cfg.hidden)
        self.out = nn.Linear(cfg.hidden, cfg.hidden)
        self.sinks = nn.Parameter(torch.randn(cfg.heads))

    def forward(self, x, bias):
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        if self.sliding:
            i = torch.arange(n)
            band = i[None, :] <= i[:, None] - self.window
            bias = bias.masked_fill(band, float("-inf")) if FIXED else bias.masked_fill_(band, float("-inf"))
        scores = q @ k.transpose(-1, -2) / (d // self.heads) ** 0.5 + bias
        scores = torch.cat([scores, self.sinks.view(1, -1, 1, 1).expand(b, -1, n, 1)], dim=-1)
        scores = scores - scores.max(dim=-1, keepdim=True).values
        weights = torch.softmax(scores, dim=-1)[..., :-1]
        return x + self.out((weights @ v).transpose(1, 2).reshape(b, n, d))


class Model(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.embed = nn.Embedding(30, cfg.hidden)
        self.layers = nn.ModuleList([Attention(cfg, kind == "sliding_attention") for kind in cfg.layer_types])

    def forward(self, ids):
        n = ids.shape[1]
        bias = torch.full((n, n), float("-inf")).triu(1)
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x, bias)
        return x


def main():
    torch.manual_seed(0)
    cfg = Settings()
    model = Model(cfg).eval()
    with torch.no_grad():
        out = model(torch.tensor([[3, 8, 1, 4, 9, 2, 7, 5]]))
    print([round(v, 4) for v in out[0, -1, :4].tolist()])


if __name__ == "__main__":
    main()
