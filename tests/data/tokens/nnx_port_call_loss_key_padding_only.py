"""A Flax NNX-style port (modules written with `__call__`, not `forward`) trained on next-token targets, masked for
padding only.

Written for maskcli's tests (not a published bug): the second program sees-its-target catches through a model whose
modules define their own `__call__` (the first: unsloth-zoo#963's MLX-VLM loss, tests/data/bugs). Two rows, right-
padded with 0, go through `TinyLM.__call__(inputs, pad_mask)`; the attention is a hand-written softmax over scores
filled where `pad_mask` (True = padding) says. The loss is `F.nll_loss` over the flattened log-probabilities of every
position but the last, its targets the ids one position on, padding ignored (`ignore_index=0`). The bug: the
attention never adds the causal part, so each query sees the token it is asked to predict.
Fix (--fixed): the scores are also filled above the diagonal.
"""
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


class SelfAttention(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.qkv = nn.Linear(dim, 3 * dim)

    def __call__(self, x, pad_mask):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        scores = q @ k.transpose(-2, -1) / x.shape[-1] ** 0.5
        hidden = pad_mask[:, None, :]
        if FIXED:
            n = x.shape[1]
            hidden = hidden | torch.ones(n, n, dtype=torch.bool).triu(1)[None]
        scores = scores.masked_fill(hidden, float("-inf"))
        return torch.softmax(scores, dim=-1) @ v


class TinyLM(nn.Module):
    def __init__(self, vocab=30, dim=16, depth=2):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList([SelfAttention(dim) for _ in range(depth)])
        self.head = nn.Linear(dim, vocab)

    def __call__(self, inputs, pad_mask):
        h = self.embed(inputs)
        for block in self.blocks:
            h = h + block(h, pad_mask)
        return self.head(h)


def main():
    torch.manual_seed(0)
    model = TinyLM()
    inputs = torch.tensor([[4, 9, 12, 7, 3, 18, 0, 0], [5, 11, 2, 26, 8, 14, 21, 6]])
    logits = model(inputs, inputs == 0)
    logp = F.log_softmax(logits[:, :-1], dim=-1).reshape(-1, logits.shape[-1])
    loss = F.nll_loss(logp, inputs[:, 1:].reshape(-1), ignore_index=0)
    print("fixed" if FIXED else "buggy", f"{loss.item():.4f}")


if __name__ == "__main__":
    main()
