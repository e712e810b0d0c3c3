"""halonet-pytorch HaloAttention masked the real halo pixels and kept the zero padding.

Citation: lucidrains/halonet-pytorch#4 ("[Bug] the attention mask should be reversed"); the
upstream source was read at the buggy snapshot (`mask = mask.bool()`, commit ff0eb71) and at
a later stored version (commit 20210d5736d11caa9d32cbad89bccb83ff6bd4dc) with
`mask = ~mask.bool()`.

Bug: keys/values are each query block's neighbourhood of size block + 2*halo, cut with
`F.unfold(..., padding=halo)`, so blocks at the image border include zero padding.  The mask
is built by unfolding a map of ones the same way: 1 on real pixels, 0 on padding.  It is
then fed to `sim.masked_fill_(mask, max_neg_value)`, which fills where the mask is True —
so every real pixel was masked and border queries attended only to padding positions.
Fix: `mask = ~mask.bool()` (mask the padding).

Reproduction: HaloAttention on a 1x8x4x4 feature map, block_size=2, halo_size=1 (each block
is a border block).  einops is replaced by the equivalent view/permute calls, and the
relative position bias (`RelPosEmb`) is left out: it adds to `sim` and does not touch the mask.
"""
import sys

import torch
import torch.nn.functional as F
from torch import einsum, nn

FIXED = "--fixed" in sys.argv


class HaloAttention(nn.Module):
    def __init__(self, *, dim, block_size, halo_size, dim_head=64, heads=8):
        super().__init__()
        assert halo_size > 0, "halo size must be greater than 0"
        self.dim = dim
        self.heads = heads
        self.scale = dim_head ** -0.5
        self.block_size = block_size
        self.halo_size = halo_size
        inner_dim = dim_head * heads
        self.to_q = nn.Linear(dim, inner_dim, bias=False)
        self.to_kv = nn.Linear(dim, inner_dim * 2, bias=False)
        self.to_out = nn.Linear(inner_dim, dim)

    def forward(self, x):
        b, c, h, w, block, halo, heads, device = *x.shape, self.block_size, self.halo_size, self.heads, x.device
        assert h % block == 0 and w % block == 0, "fmap dimensions must be divisible by the block size"
        nh, nw = h // block, w // block

        # 'b c (h p1) (w p2) -> (b h w) (p1 p2) c'
        q_inp = x.view(b, c, nh, block, nw, block).permute(0, 2, 4, 3, 5, 1).reshape(b * nh * nw, block * block, c)
        kv_inp = F.unfold(x, kernel_size=block + halo * 2, stride=block, padding=halo)
        j, i = kv_inp.shape[1] // c, kv_inp.shape[2]
        # 'b (c j) i -> (b i) j c'
        kv_inp = kv_inp.view(b, c, j, i).permute(0, 3, 2, 1).reshape(b * i, j, c)

        q = self.to_q(q_inp)
        k, v = self.to_kv(kv_inp).chunk(2, dim=-1)

        def split_heads(t):  # 'b n (h d) -> (b h) n d'
            bb, n, hd = t.shape
            return t.view(bb, n, heads, hd // heads).permute(0, 2, 1, 3).reshape(bb * heads, n, hd // heads)

        q, k, v = map(split_heads, (q, k, v))
        q *= self.scale
        sim = einsum("b i d, b j d -> b i j", q, k)

        # mask out padding (in the paper, they claim to not need masks, but what about padding?)
        mask = torch.ones(1, 1, h, w, device=device)
        mask = F.unfold(mask, kernel_size=block + (halo * 2), stride=block, padding=halo)
        # '() j i -> (b i h) () j'
        mask = mask[0].t()[None, :, None, None, :].expand(b, i, heads, 1, j).reshape(b * i * heads, 1, j)
        mask = ~mask.bool() if FIXED else mask.bool()

        max_neg_value = -torch.finfo(sim.dtype).max
        sim.masked_fill_(mask, max_neg_value)
        attn = sim.softmax(dim=-1)
        out = einsum("b i j, b j d -> b i d", attn, v)

        # '(b h) n d -> b n (h d)'
        bh, n, d = out.shape
        out = out.view(bh // heads, heads, n, d).permute(0, 2, 1, 3).reshape(bh // heads, n, heads * d)
        out = self.to_out(out)
        # '(b h w) (p1 p2) c -> b c (h p1) (w p2)'
        out = out.view(b, nh, nw, block, block, c).permute(0, 5, 1, 3, 2, 4).reshape(b, c, h, w)
        return out


def main():
    torch.manual_seed(0)
    attn = HaloAttention(dim=8, block_size=2, halo_size=1, dim_head=4, heads=2)
    fmap = torch.randn(1, 8, 4, 4)
    with torch.no_grad():
        out = attn(fmap)
    print("out[0,:3,0,0] =", [round(x, 4) for x in out[0, :3, 0, 0].tolist()])


if __name__ == "__main__":
    main()
