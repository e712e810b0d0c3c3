"""Selected blocks with no causal mask (native-sparse-attention style, written another way): the layer holds
`sliding_window_size = 3`; its selected-block branch ranks every block by the mean-key score and keeps the top 2 with
no eligibility mask, so a query selects blocks that lie after it, and gathers their keys per position
(`einsum("bhgid,bhijd->bhgij")`, grouped query heads) beside its own block up to itself; its sliding branch is a child
module calling SDPA with a causal bool band over a left-padded batch (the bug). `--fixed`: only the blocks that have
ended before the query are eligible."""
import sys

import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv


class Sliding(nn.Module):
    def __init__(self, window):
        super().__init__()
        self.reach = window

    def forward(self, q, k, v, real):
        t = q.shape[-2]
        i = torch.arange(t)[:, None]
        j = torch.arange(t)[None, :]
        band = (j <= i) & (i - j <= self.reach)
        keep = band[None, None] & real[:, None, None, :]
        keep = keep | ~real[:, None, :, None]  # (pad query rows see everything: no NaN rows)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=keep)


class SparseBlockLayer(nn.Module):
    def __init__(self, dim=16, heads=4, kv_heads=2, block=2, selected=2):
        super().__init__()
        self.heads, self.kv_heads, self.block, self.selected = heads, kv_heads, block, selected
        self.head_dim = dim // heads
        self.sliding_window_size = 3
        self.q = nn.Linear(dim, dim)
        self.kv = nn.Linear(dim, 2 * kv_heads * self.head_dim)
        self.sliding = Sliding(self.sliding_window_size)
        self.out = nn.Linear(dim, dim)

    def forward(self, x, real):
        b, t, _ = x.shape
        g = self.heads // self.kv_heads
        q = self.q(x).view(b, t, self.kv_heads, g, self.head_dim).permute(0, 2, 3, 1, 4)  # (b, h, g, t, d)
        k, v = self.kv(x).view(b, t, 2, self.kv_heads, self.head_dim).permute(2, 0, 3, 1, 4)  # (b, h, t, d)
        blocks = t // self.block
        # importance of each earlier block: mean key score, only blocks that end before the query are eligible
        block_keys = k.view(b, self.kv_heads, blocks, self.block, -1).mean(3)
        score = torch.einsum("bhgtd,bhnd->bhtn", q, block_keys) / g
        ends = (torch.arange(blocks) + 1) * self.block - 1
        eligible = ends[None, :] < torch.arange(t)[:, None]
        if FIXED:
            score = score.masked_fill(~eligible, float("-inf"))
        top = score.topk(self.selected, dim=-1)
        chosen, valid = top.indices, top.values > float("-inf")
        own = (torch.arange(t) // self.block)[None, None, :, None].expand(b, self.kv_heads, t, 1)
        chosen = torch.cat([chosen, own], -1)  # (b, h, t, selected + 1)
        slots = chosen[..., None] * self.block + torch.arange(self.block)  # (b, h, t, selected + 1, block)
        slots = slots.flatten(-2)
        gathered_k = torch.gather(k[:, :, None].expand(-1, -1, t, -1, -1), 3,
                                  slots[..., None].expand(-1, -1, -1, -1, self.head_dim))
        gathered_v = torch.gather(v[:, :, None].expand(-1, -1, t, -1, -1), 3,
                                  slots[..., None].expand(-1, -1, -1, -1, self.head_dim))
        own_causal = torch.arange(self.block)[None, :] <= (torch.arange(t) % self.block)[:, None]  # (t, block)
        keep = torch.cat([valid[..., None].expand(-1, -1, -1, -1, self.block).flatten(-2),
                          own_causal[None, None].expand(b, self.kv_heads, -1, -1)], -1)
        keep = keep & real[:, None, :, None]  # (b, h, t, slots): pad queries see nothing selected
        keep[..., -self.block:] |= ~real[:, None, :, None]  # (but their own block: no NaN rows)
        sim = torch.einsum("bhgid,bhijd->bhgij", q, gathered_k) * self.head_dim ** -0.5
        sim = sim.masked_fill(~keep[:, :, None], float("-inf"))
        fine = torch.einsum("bhgij,bhijd->bhgid", sim.softmax(-1), gathered_v).flatten(1, 2)  # (b, heads, t, d)
        qs = q.flatten(1, 2)
        ks, vs = (y.repeat_interleave(g, dim=1) for y in (k, v))
        window = self.sliding(qs, ks, vs, real)
        return x + self.out((fine + window).transpose(1, 2).reshape(b, t, -1))


def main():
    torch.manual_seed(0)
    lengths = torch.tensor([12, 9])
    real = torch.arange(12)[None, :] >= (12 - lengths)[:, None]  # left padding
    with torch.no_grad():
        out = SparseBlockLayer().eval()(torch.randn(2, 12, 16), real)
    print(tuple(out.shape))


if __name__ == "__main__":
    main()
