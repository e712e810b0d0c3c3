"""An encoder with a local (sliding) window whose hparams, a dataclass on `self.hparams`, state
use_bidirectional_attention=True and sliding_window=3: the window is built looking back only, as a decoder's;
--fixed: |i - j| < sliding_window, both ways."""

import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


@dataclass
class HParams:
    width: int = 4
    depth: int = 2
    sliding_window: int = 3
    use_bidirectional_attention: bool = True


class LocalEncoder(torch.nn.Module):
    def __init__(self, hparams):
        super().__init__()
        self.hparams = hparams
        self.mixers = torch.nn.ModuleList(torch.nn.Linear(hparams.width, hparams.width) for _ in range(hparams.depth))

    def forward(self, x, attention_mask):
        n, w = x.shape[-2], self.hparams.sliding_window
        distance = torch.arange(n)[:, None] - torch.arange(n)[None, :]
        near = distance.abs() < w if FIXED else (distance >= 0) & (distance < w)
        keep = near & attention_mask[:, None, None, :].bool()
        for mix in self.mixers:
            x = x + F.scaled_dot_product_attention(mix(x), x, x, attn_mask=keep)
        return x


torch.manual_seed(0)
with torch.no_grad():
    LocalEncoder(HParams())(torch.randn(2, 1, 8, 4), torch.tensor([[1] * 8, [1] * 6 + [0] * 2]))
