"""A speech encoder whose blocks attend within fixed windows of frames (a chunked local self-attention, hand-written:
scores = q @ kᵀ per window, masked_fill over the padded frames, softmax). Its config dataclass states the window
(`EncoderConfig.local_window = 16`); the encoder keeps the config (`self.cfg`) but builds each block's attention with
`BlockLocalAttention(dim, heads)`, whose default window of 64 frames is what runs (the bug of hubertsiuzdak/snac
946c3bf, written another way: a config object, a padded batch, softmax attention). The fix passes
`window=cfg.local_window`."""

import math
import sys
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


@dataclass
class EncoderConfig:
    dim: int = 32
    heads: int = 2
    layers: int = 2
    local_window: int = 16


class BlockLocalAttention(nn.Module):
    def __init__(self, dim, heads, window=64):
        super().__init__()
        self.heads, self.window = heads, window
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x, real):  # x: (B, T, D), T a multiple of the window; real: (B, T) bool
        b, t, d = x.shape
        n, w = t // self.window, self.window
        q, k, v = (z.reshape(b * n, w, self.heads, d // self.heads).transpose(1, 2)
                   for z in self.qkv(x).chunk(3, dim=-1))  # (B * blocks, H, window, d)
        scores = q @ k.transpose(-1, -2) / math.sqrt(d // self.heads)
        keep = real.reshape(b * n, 1, 1, w)
        attn = F.softmax(scores.masked_fill(~keep, float("-inf")), dim=-1)
        out = (attn @ v).transpose(1, 2).reshape(b, t, d)
        return x + self.proj(out)


class SpeechEncoder(nn.Module):
    def __init__(self, cfg: EncoderConfig):
        super().__init__()
        self.cfg = cfg
        if FIXED:
            self.blocks = nn.ModuleList([BlockLocalAttention(cfg.dim, cfg.heads, window=cfg.local_window)
                                         for _ in range(cfg.layers)])
        else:
            self.blocks = nn.ModuleList([BlockLocalAttention(cfg.dim, cfg.heads) for _ in range(cfg.layers)])

    def forward(self, feats, lengths):
        window = self.blocks[0].window
        t = math.ceil(feats.shape[1] / window) * window
        x = F.pad(feats, (0, 0, 0, t - feats.shape[1]))
        real = torch.arange(t)[None, :] < lengths[:, None]
        for block in self.blocks:
            x = block(x, real)
        return x[:, : feats.shape[1]]


cfg = EncoderConfig()
encoder = SpeechEncoder(cfg).eval()
lengths = torch.tensor([108, 100])
feats = torch.randn(2, 108, cfg.dim)
with torch.no_grad():
    out = encoder(feats, lengths)
print(f"fixed={FIXED} block window {encoder.blocks[0].window} (configured {cfg.local_window}); out {tuple(out.shape)}")
