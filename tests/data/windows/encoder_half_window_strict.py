"""A local encoder whose symmetric window keeps |q - k| < W / 2, one key short on each side of W / 2.

Bug: the config (a dataclass on self.config: sliding_window=8, is_causal=False) states a window of 8 keys around each
token, |q - k| <= 4 as transformers' bidirectional Gemma 3 and Longformer keep it; the band is built with a strict
`< W // 2`, so each token sees 3 on either side. Fix: `<= W // 2`. A right-padded batch of two (its attention_mask),
an explicit softmax with masked_fill.
"""
import sys
from dataclasses import dataclass

import torch
from torch import nn

FIXED = "--fixed" in sys.argv


@dataclass
class EncoderConfig:
    hidden_size: int = 8
    num_heads: int = 2
    sliding_window: int = 8
    is_causal: bool = False


class LocalEncoder(nn.Module):
    def __init__(self, config: EncoderConfig):
        super().__init__()
        self.config = config
        self.qkv = nn.Linear(config.hidden_size, 3 * config.hidden_size)

    def forward(self, x, attention_mask):
        b, t, d = x.shape
        h = self.config.num_heads
        q, k, v = (z.view(b, t, h, d // h).transpose(1, 2) for z in self.qkv(x).chunk(3, dim=-1))
        pos = torch.arange(t)
        distance = (pos[:, None] - pos[None, :]).abs()
        half = self.config.sliding_window // 2
        band = distance <= half if FIXED else distance < half
        keep = band[None, None] & attention_mask[:, None, None, :].bool()
        scores = (q @ k.transpose(-1, -2)) / (d // h) ** 0.5
        weights = scores.masked_fill(~keep, torch.finfo(scores.dtype).min).softmax(-1)
        return (weights @ v).transpose(1, 2).reshape(b, t, d)


def main():
    torch.manual_seed(0)
    model = LocalEncoder(EncoderConfig()).eval()
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, 9:] = 0
    with torch.no_grad():
        out = model(torch.randn(2, 12, 8), mask)
    print("pooled", round(float((out * mask[..., None]).sum(1).norm()), 4))


if __name__ == "__main__":
    main()
