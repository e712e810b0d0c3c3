"""A fairseq-style encoder over left-padded `src_tokens` that builds its key padding mask with the wrong pad id.

Written here (a second program for padding-ignored read off `src_tokens`, beside Uni-Mol2's blind reproduction
deepmodeling/Uni-Mol#364): the embedding states the pad id (`padding_idx=1`, fairseq's Dictionary.pad()), the batch
of three sentences is left-padded with it, and the key padding mask is `src_tokens.eq(0)`, an id the batch never
holds, so every real token attends the padding. `--fixed` masks `src_tokens.eq(self.padding_idx)`.
"""
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


class Encoder(nn.Module):
    def __init__(self, vocab=12, dim=16, heads=2):
        super().__init__()
        self.padding_idx = 1
        self.embed = nn.Embedding(vocab, dim, padding_idx=self.padding_idx)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.heads = heads

    def forward(self, src_tokens):
        x = self.embed(src_tokens)
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-1, -2) / (d // self.heads) ** 0.5
        pad = src_tokens.eq(self.padding_idx if FIXED else 0)
        scores = scores.masked_fill(pad[:, None, None, :], float("-inf"))
        out = F.softmax(scores, dim=-1) @ v
        return out.transpose(1, 2).reshape(b, n, d)


def main():
    torch.manual_seed(0)
    src_tokens = torch.tensor([[2, 5, 7, 3, 9], [1, 1, 4, 6, 8], [1, 1, 1, 10, 11]])
    with torch.no_grad():
        out = Encoder()(src_tokens)
    print("out", tuple(out.shape))


if __name__ == "__main__":
    main()
