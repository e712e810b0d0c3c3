"""A causal decoder with learned persistent-memory slots appended after its tokens (one tensor through the layers):
every token may read the memory slots, which are learned and read only each other, never a token, so no token reaches
a later one through them: correct as written, and --fixed (the same mask built as a float bias) too.
"""
import sys

import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv


class Block(nn.Module):
    def __init__(self, width=16, heads=2):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)

    def forward(self, x, mask):
        b, n, w = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, w // self.heads).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return x + out.transpose(1, 2).reshape(b, n, w)


class Model(nn.Module):
    def __init__(self, vocab=20, width=16, slots=3, layers=2):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.memory = nn.Parameter(torch.randn(slots, width))
        self.blocks = nn.ModuleList(Block(width) for _ in range(layers))

    def forward(self, tokens):
        b, n = tokens.shape
        m = self.memory.shape[0]
        keep = torch.zeros(n + m, n + m, dtype=torch.bool)
        keep[:n, :n] = torch.ones(n, n, dtype=torch.bool).tril()
        keep[:, n:] = True  # every row reads the memory slots; the slots read only each other
        mask = torch.zeros(keep.shape).masked_fill(~keep, float("-inf")) if FIXED else keep
        x = torch.cat([self.embed(tokens), self.memory.expand(b, m, -1)], dim=1)
        for block in self.blocks:
            x = block(x, mask)
        return x[:, :n]


def main():
    torch.manual_seed(0)
    with torch.no_grad():
        out = Model().eval()(torch.tensor([[1, 2, 3, 4, 5], [6, 7, 8, 9, 10]]))
    print("out", tuple(out.shape))


if __name__ == "__main__":
    main()
