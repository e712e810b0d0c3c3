"""A left-padded encoder: the padding mask built from the batch's lengths (True = padding) is handed to SDPA, which
reads a bool mask as True = may attend, so each row attends its padding only and the whole row nothing (NaN).
--fixed hands SDPA the real tokens (`~padding`).
"""
import sys

import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv


class Layer(nn.Module):
    def __init__(self, width=16, heads=2):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)

    def forward(self, x, attn_mask):
        b, n, w = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, w // self.heads).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)
        return x + out.transpose(1, 2).reshape(b, n, w)


def encode(layers, x, seq_lens):
    length = x.shape[1]
    padding = torch.arange(length)[None, :] < (length - seq_lens)[:, None]  # left-padded: True = padding
    mask = (~padding if FIXED else padding)[:, None, None, :]
    for layer in layers:
        x = layer(x, mask)
    return x


def main():
    torch.manual_seed(0)
    layers = nn.ModuleList([Layer(), Layer()]).eval()
    seq_lens = torch.tensor([3, 7, 5])
    x = torch.randn(3, 7, 16)
    with torch.no_grad():
        out = encode(layers, x, seq_lens)
    print("nan rows", int(torch.isnan(out).any(-1).sum()))


if __name__ == "__main__":
    main()
