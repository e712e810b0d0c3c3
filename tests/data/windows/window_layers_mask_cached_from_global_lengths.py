"""The vLLM Qwen2.5-VL precomputed-seqlens bug (vllm-project/vllm#15200, a regression from #14377) written another way.

A vision encoder whose windowed layers (the config dataclass's `window_layers`) get the windows' cu_seqlens and the
others the images', by keyword. To save work the encoder builds one additive float mask, from the images' lengths, the
first time a layer asks for one, and every layer after reads that cached mask: each windowed layer, handed its windows,
runs over whole images (an explicit softmax, three images of 12, 8 and 16 patches, windows of 4). Fixed: the mask is
built from the cu_seqlens each layer is handed.
"""
import sys
from dataclasses import dataclass

import torch
from torch import nn

FIXED = "--fixed" in sys.argv


@dataclass
class EncoderConfig:
    dim: int = 16
    heads: int = 2
    depth: int = 4
    window: int = 4  # patches a window holds
    window_layers: tuple = (0, 2, 3)


def block_mask(cu_seqlens: torch.Tensor, n: int) -> torch.Tensor:
    mask = torch.full((n, n), float("-inf"))
    for a, b in zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist()):
        mask[a:b, a:b] = 0.0
    return mask


class Layer(nn.Module):
    def __init__(self, cfg, owner):
        super().__init__()
        self.heads, self.owner = cfg.heads, [owner]  # (a list: not a submodule)
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim)
        self.proj = nn.Linear(cfg.dim, cfg.dim)

    def forward(self, x, cu_seqlens):
        n, d = x.shape
        q, k, v = self.qkv(x).view(1, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)  # (1, heads, n, .)
        mask = block_mask(cu_seqlens, n) if FIXED else self.owner[0].cached_mask(cu_seqlens, n)
        weights = torch.softmax(q @ k.transpose(-1, -2) / (d // self.heads) ** 0.5 + mask, dim=-1)
        return x + self.proj((weights @ v)[0].transpose(0, 1).reshape(n, d))


class Encoder(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.config = cfg
        self.layers = nn.ModuleList(Layer(cfg, self) for _ in range(cfg.depth))
        self._mask = None

    def cached_mask(self, cu_seqlens, n):
        if self._mask is None:  # built once per forward, from whichever lengths come first
            self._mask = block_mask(self.image_cu, n)
        return self._mask

    def forward(self, patches, image_sizes):
        self._mask = None
        self.image_cu = nn.functional.pad(torch.cumsum(image_sizes, 0), (1, 0)).to(torch.int32)
        windows = torch.cat([torch.full((int(s) // self.config.window,), self.config.window) for s in image_sizes])
        window_cu = nn.functional.pad(torch.cumsum(windows, 0), (1, 0)).to(torch.int32)
        for i, layer in enumerate(self.layers):
            patches = layer(patches, cu_seqlens=window_cu if i in self.config.window_layers else self.image_cu)
        return patches


torch.manual_seed(0)
sizes = torch.tensor([12, 8, 16])
model = Encoder(EncoderConfig()).eval()
with torch.no_grad():
    out = model(torch.randn(int(sizes.sum()), 16), sizes)
print("encoded", tuple(out.shape))
