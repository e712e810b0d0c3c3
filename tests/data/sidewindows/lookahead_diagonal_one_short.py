"""A streaming speech encoder whose dict config (held as `self.cfg`) lists each layer's [left, right] window: the
layers with a look-ahead of 2 frames build their band as `tril(diagonal=right - 1) & triu(diagonal=-left)` for SDPA,
one frame short ahead, over a right-padded batch of two; --fixed: `tril(diagonal=right)`."""

import sys

import torch
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


class Block(torch.nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.qkv = torch.nn.Linear(dim, 3 * dim)

    def forward(self, x, keep):
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        return x + F.scaled_dot_product_attention(q, k, v, attn_mask=keep).transpose(1, 2).reshape(b, n, d)


class StreamingEncoder(torch.nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.blocks = torch.nn.ModuleList(Block(cfg["d_model"], cfg["n_heads"]) for _ in range(cfg["n_layers"]))

    def forward(self, frames, lengths):
        b, n, _ = frames.shape
        ones = torch.ones(n, n, dtype=torch.bool)
        real = torch.arange(n)[None, :] < lengths[:, None]
        for block, (left, right) in zip(self.blocks, self.cfg["sliding_windows"]):
            band = ones.tril(diagonal=right if FIXED else right - 1) & ones.triu(diagonal=-left)
            frames = block(frames, (band[None] & real[:, None, :])[:, None])
        return frames


if __name__ == "__main__":
    torch.manual_seed(0)
    cfg = {"d_model": 16, "n_heads": 2, "n_layers": 2, "sliding_windows": [[3, 2], [3, 2]]}
    with torch.no_grad():
        print(StreamingEncoder(cfg).eval()(torch.randn(2, 10, 16), torch.tensor([10, 7])).shape)
