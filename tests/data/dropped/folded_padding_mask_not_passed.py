"""An encoder on a left-padded batch whose layer hands its helper a (batch * heads, L, L) additive padding mask that
the helper never passes to SDPA: every query attends the padding (python FILE; --fixed: the mask reaches SDPA)."""
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


def attend(q, k, v, bias_mask=None):
    b, h, n, d = q.shape
    given = None if bias_mask is None else bias_mask.view(b, h, n, n)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=given if FIXED else None)


class EncoderLayer(nn.Module):
    def __init__(self, dim=16, heads=4):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)

    def forward(self, x, n_pad):
        b, n, d = x.shape
        q, k, v = (t.view(b, n, self.heads, d // self.heads).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))
        pad = torch.arange(n)[None, :] < n_pad[:, None]  # left padding: the first n_pad keys of each row
        bias = torch.zeros(b, 1, n, n).masked_fill(pad[:, None, None, :], float("-inf"))
        bias = bias.expand(b, self.heads, n, n).reshape(b * self.heads, n, n)
        return attend(q, k, v, bias_mask=bias).transpose(1, 2).reshape(b, n, d)


def main():
    torch.manual_seed(0)
    layer = EncoderLayer()
    x = torch.randn(3, 5, 16)
    with torch.no_grad():
        out = layer(x, torch.tensor([0, 2, 1]))
    print("out[1,-1,:3] =", [round(v, 4) for v in out[1, -1, :3].tolist()])


if __name__ == "__main__":
    main()
