"""Padding found from all-zero key vectors after a learned position embedding was added: nothing is ever masked.

Written for maskcli's tests (checks/arguments.py, padding-ignored), Kyubyong/transformer#69 written another way: the
pad id (1) is the embedding row the model zeroes by hand (no `padding_idx`), the batch is left-padded and handed as
`words`, the heads are folded batch-major (`reshape(B * h, L, d)`), and the padding test is `abs().sum(-1) > 0` on the
keys after a learned position embedding was added, so every key passes. `--fixed` tests the words themselves.
"""
import sys

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv
PAD = 1


class Encoder(nn.Module):
    def __init__(self, vocab=30, dim=16, heads=4, max_len=8):
        super().__init__()
        self.heads = heads
        self.words = nn.Embedding(vocab, dim)
        with torch.no_grad():
            self.words.weight[PAD] = 0.0  # the pad word looks up zeros
        self.positions = nn.Embedding(max_len, dim)
        self.qkv = nn.Linear(dim, 3 * dim)

    def forward(self, words):
        B, L = words.shape
        x = self.words(words) + self.positions(torch.arange(L))[None]
        q, k, v = (t.reshape(B, L, self.heads, -1).transpose(1, 2).reshape(B * self.heads, L, -1)
                   for t in self.qkv(x).chunk(3, dim=-1))
        real = (words != PAD) if FIXED else (x.abs().sum(-1) > 0)  # (B, L)
        real = real.repeat_interleave(self.heads, dim=0)  # (B * h, L), batch-major as q, k, v
        scores = (q @ k.transpose(1, 2)) / q.shape[-1] ** 0.5
        scores = scores.masked_fill(~real[:, None, :], float("-inf"))
        return (torch.softmax(scores, dim=-1) @ v).reshape(B, self.heads, L, -1)


if __name__ == "__main__":
    torch.manual_seed(0)
    words = torch.tensor([[PAD, PAD, 5, 6, 7], [8, 9, 10, 11, 12], [PAD, 13, 14, 15, 16]])
    with torch.no_grad():
        out = Encoder().eval()(words)
    print("fixed" if FIXED else "buggy", tuple(out.shape))
