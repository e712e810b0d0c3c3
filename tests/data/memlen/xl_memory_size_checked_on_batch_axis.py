"""A Transformer-XL style layer that keeps a batch-first memory of its past hidden states and states `self.mem_len`:
the buggy step cuts the memory only when `mem.size(0)` (the batch) exceeds mem_len, so it grows without bound and
every segment's queries see the whole history. --fixed keeps the whole buffer but hides the keys older than mem_len
in the mask handed to SDPA (a correct program: what a query sees is within its memory).
"""
import sys

import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv


class XLLayer(nn.Module):
    def __init__(self, width=16, heads=2, mem_len=4):
        super().__init__()
        self.mem_len = mem_len
        self.heads = heads
        self.q = nn.Linear(width, width)
        self.kv = nn.Linear(width, 2 * width)

    def forward(self, h, mem):
        b, n, d = h.shape
        both = h if mem is None else torch.cat([mem, h], dim=1)
        m = both.shape[1] - n
        q = self.q(h).view(b, n, self.heads, -1).transpose(1, 2)
        k, v = (t.view(b, m + n, self.heads, -1).transpose(1, 2) for t in self.kv(both).chunk(2, dim=-1))
        at = m + torch.arange(n)[:, None]  # each query's own position among the keys
        keys = torch.arange(m + n)[None, :]
        allowed = keys <= at
        if FIXED:
            allowed = allowed & (keys >= m - self.mem_len)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
        return out.transpose(1, 2).reshape(b, n, d)


def main():
    torch.manual_seed(0)
    layer = XLLayer()
    tokens = torch.randn(2, 12, 16)
    mem = None
    with torch.no_grad():
        for start in range(0, 12, 3):
            h = layer(tokens[:, start:start + 3], mem)
            mem = h if mem is None else torch.cat([mem, h], dim=1)
            if not FIXED and mem.size(0) > layer.mem_len:
                mem = mem[:, -layer.mem_len:]
    print("memory kept:", mem.shape[1], "out[0, 0, :3]:", [round(v, 4) for v in h[0, 0, :3].tolist()])


if __name__ == "__main__":
    main()
