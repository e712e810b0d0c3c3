"""A funnel-style encoder on a left-padded batch: blocks of full attention, the hidden states mean-pooled by 2 between
blocks and the keep mask (1 = token, 0 = padding) min-pooled along with them. Each block adds the mask to its scores
as `mask * -1e4` (the keep mask read as 1 = masked, its BERT `(1 - mask)` left out): in a padded row every query sees
the padding only (python FILE; --fixed: `(1 - mask) * -1e4`). The same bug as transformers#7374, written with nn.Module
blocks, einsum scores and an additive bias instead of Funnel's `- INF * mask`."""
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


class Block(nn.Module):
    def __init__(self, dim=24, heads=3):
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v = (nn.Linear(dim, dim) for _ in range(3))
        self.out = nn.Linear(dim, dim)
        self.norm = nn.LayerNorm(dim)

    def forward(self, x, attention_mask):
        b, n, d = x.shape
        split = lambda t: t.view(b, n, self.heads, d // self.heads)
        q, k, v = split(self.q(x)), split(self.k(x)), split(self.v(x))
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / (d // self.heads) ** 0.5
        bias = ((1.0 - attention_mask) if FIXED else attention_mask)[:, None, None, :] * -1e4
        weights = (scores + bias).softmax(dim=-1)
        return self.norm(x + self.out(torch.einsum("bhqk,bkhd->bqhd", weights, v).reshape(b, n, d)))


class PooledEncoder(nn.Module):
    def __init__(self, vocab=40, dim=24, stages=2):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(stages))

    def forward(self, ids, attention_mask):
        x, keep = self.embed(ids), attention_mask.float()
        for i, block in enumerate(self.blocks):
            if i:  # pool positions by 2: the states by their mean, the mask by its min (a pair with padding is padding)
                x = F.avg_pool1d(x.transpose(1, 2), 2).transpose(1, 2)
                keep = -F.max_pool1d(-keep[:, None], 2)[:, 0]
            x = block(x, keep)
        return x


def main():
    torch.manual_seed(0)
    model = PooledEncoder().eval()
    lengths = [8, 5, 6]  # left-padded to 8
    ids = torch.randint(1, 40, (3, 8))
    mask = torch.ones(3, 8, dtype=torch.long)
    for row, n in enumerate(lengths):
        mask[row, :8 - n] = 0
        ids[row, :8 - n] = 0
    with torch.no_grad():
        first = model.blocks[0](model.embed(ids), mask.float())
        alone = model.blocks[0](model.embed(ids[1:2, 3:]), mask[1:2, 3:].float())
        model(ids, attention_mask=mask)
    print(f"fixed={FIXED} max |row 1 padded - alone| over its tokens = {(first[1, 3:] - alone[0]).abs().max():.6f}")


main()
