"""A hand-written decoder over a right-padded batch: its keep mask for SDPA (True = may attend) is built as
`causal | is_pad`, so every query sees the trailing padding, whose rows see the whole sequence: one layer on, each
token reads the tokens after it. --fixed builds `causal & ~is_pad`.
"""
import sys

import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv
PAD = 0


class Block(nn.Module):
    def __init__(self, width=16, heads=2):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)

    def forward(self, x, keep):
        b, n, w = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, w // self.heads).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
        return x + self.proj(out.transpose(1, 2).reshape(b, n, w))


class Decoder(nn.Module):
    def __init__(self, vocab=20, width=16, layers=3):
        super().__init__()
        self.embed = nn.Embedding(vocab, width, padding_idx=PAD)
        self.blocks = nn.ModuleList(Block(width) for _ in range(layers))
        self.head = nn.Linear(width, vocab)

    def forward(self, ids):
        n = ids.shape[1]
        causal = torch.ones(n, n, dtype=torch.bool).tril()
        is_pad = (ids == PAD)[:, None, None, :]
        keep = (causal & ~is_pad) if FIXED else (causal | is_pad)
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x, keep)
        return self.head(x)


def main():
    torch.manual_seed(0)
    ids = torch.tensor([[5, 6, 7, 8, 9, 10], [3, 4, 11, PAD, PAD, PAD], [12, 13, 14, 15, PAD, PAD]])
    with torch.no_grad():
        logits = Decoder().eval()(ids)
    print("logits", tuple(logits.shape))


if __name__ == "__main__":
    main()
