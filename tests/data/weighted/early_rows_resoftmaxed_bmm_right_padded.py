"""Sparse top-k attention whose warm-up rows go through a second softmax over their probabilities.

Written for checks/weighted.py another way than sparseKT (pykt-toolkit b602c92: (B, H, L, L) scores, a strictly-past
no-peek mask filled with -1e32, the first k_index rows sliced off, the rest thresholded at their k-th largest weight,
the two joined along the queries and softmaxed again): a decoder over a right-padded batch, its heads folded into the
batch ((B * H, L, L) scores from torch.bmm), a causal mask with the diagonal and the padding added as -inf, the sizes
kept in a dataclass. The rows before `cfg.dense_rows` keep every weight; the later ones keep their `cfg.top_k` largest.
The bug joins the two parts and runs `torch.softmax` over all of them: the dense rows' masked (later and padded) keys
get weight exp(0). `--fixed` softmaxes only the thresholded rows again, and joins them after.
"""
import sys
from dataclasses import dataclass

import torch
from torch import nn

FIXED = "--fixed" in sys.argv


@dataclass
class SparseConfig:
    dim: int = 16
    heads: int = 2
    dense_rows: int = 3
    top_k: int = 3


class TopKSelfAttention(nn.Module):
    def __init__(self, cfg: SparseConfig):
        super().__init__()
        self.cfg = cfg
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim)

    def forward(self, x, keep):
        cfg = self.cfg
        b, n, d = x.shape
        h, hd = cfg.heads, d // cfg.heads
        q, k, v = (t.reshape(b, n, h, hd).permute(0, 2, 1, 3).reshape(b * h, n, hd) for t in self.qkv(x).chunk(3, -1))
        causal = torch.ones(n, n, dtype=torch.bool).tril()
        allowed = causal[None] & keep[:, None, :]  # (B, L, L): earlier real keys
        bias = torch.zeros(b, n, n).masked_fill(~allowed, float("-inf")).repeat_interleave(h, dim=0)
        weights = torch.softmax(torch.bmm(q, k.transpose(1, 2)) / hd ** 0.5 + bias, dim=-1)  # (every row sees key 0)
        dense = weights[:, :cfg.dense_rows]
        rest = weights[:, cfg.dense_rows:]
        kth = rest.topk(cfg.top_k, dim=-1).values[..., -1:]
        rest = rest.masked_fill(rest < kth, float("-inf"))
        if FIXED:
            weights = torch.cat([dense, torch.softmax(rest, dim=-1)], dim=1)
        else:
            weights = torch.softmax(torch.cat([dense, rest], dim=1), dim=-1)
        out = torch.bmm(weights, v).reshape(b, h, n, hd).permute(0, 2, 1, 3).reshape(b, n, d)
        return x + out


def main():
    torch.manual_seed(0)
    cfg = SparseConfig()
    layer = TopKSelfAttention(cfg)
    lengths = [8, 6, 5]  # right-padded: every thresholded row (from position 3 on) sees at least top_k keys
    n = max(lengths)
    keep = torch.arange(n)[None, :] < torch.tensor(lengths)[:, None]
    x = torch.randn(len(lengths), n, cfg.dim)
    y = layer(x, keep)
    print("out", tuple(y.shape), round(float(y.sum()), 4))


if __name__ == "__main__":
    main()
