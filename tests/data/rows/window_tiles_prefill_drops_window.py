"""Chunked prefill written as a kernel's query tiles: each tile of 3 queries attends every key of the right-padded
batch row so far through SDPA, the function holding window_size = (2, 0) as flash_attn takes it. The first tile masks
the window; the later tiles take a path that masks causality and padding alone (--fixed: every tile masks the
window). maskcli cannot tell where a tile's queries sit; the window's span says it wherever they do."""
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
TILE = 3


def tile_attention(q, k, v, start, lengths, window_size=(2, 0)):
    """q: (B, H, tile, D) the queries at positions start .. start + tile - 1; k, v: (B, H, Lk, D); lengths: real keys."""
    pos = torch.arange(start, start + q.shape[2])[:, None]
    col = torch.arange(k.shape[2])[None, :]
    keep = (col <= pos) & (col < lengths[:, None, None, None])
    if start == 0 or FIXED:
        keep = keep & (col >= pos - window_size[0])
    return F.scaled_dot_product_attention(q, k, v, attn_mask=keep)


class Prefill(nn.Module):
    def __init__(self, dim=16, heads=2):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)

    def forward(self, x, lengths):
        b, t, d = x.shape
        q, k, v = (y.view(b, t, self.heads, -1).transpose(1, 2) for y in self.qkv(x).chunk(3, -1))
        tiles = [tile_attention(q[:, :, s:s + TILE], k, v, s, lengths) for s in range(0, t, TILE)]
        return torch.cat(tiles, 2).transpose(1, 2).reshape(b, t, d)


def main():
    torch.manual_seed(0)
    x = torch.randn(2, 9, 16)
    lengths = torch.tensor([9, 7])
    with torch.no_grad():
        out = Prefill().eval()(x, lengths)
    print(tuple(out.shape), "%.4f" % out.sum().item())


if __name__ == "__main__":
    main()
