"""A fairseq-style decoder (heads folded into the batch, a (B * H, Lq, Lk) softmax) whose cached decode steps number
each token by the cache's length, the left padding counted.

Written here, beside checks/positioned.py, as transformers#22828 (XGLM before position_ids) written another way: the
prompt's positions count each row's real tokens (`mask.cumsum(-1) - 1`), and each decode step hands the model
`position = cache length`, so a left-padded row's first new token jumps ahead by its padding. Fix: the step's position
is the row's real tokens so far (`mask.sum(-1)`).
"""
import sys

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class Attention(nn.Module):
    def __init__(self, dim=32, heads=2):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x, bias, cache):
        b, length, dim = x.shape
        q, k, v = (t.view(b, length, self.heads, -1).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
        if cache:
            k, v = torch.cat([cache[0], k], dim=2), torch.cat([cache[1], v], dim=2)
        cache[:] = [k, v]
        fold = lambda t: t.reshape(b * self.heads, t.shape[2], -1)  # noqa: E731 - (B * H, L, D), fairseq's layout
        scores = torch.bmm(fold(q), fold(k).transpose(1, 2)) / (dim // self.heads) ** 0.5
        weights = torch.softmax(scores + bias.repeat_interleave(self.heads, dim=0), dim=-1)
        out = torch.bmm(weights, fold(v)).view(b, self.heads, length, -1).transpose(1, 2).reshape(b, length, dim)
        return x + self.out(out)


class Decoder(nn.Module):
    def __init__(self, vocab=40, dim=32, layers=2):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.positions = nn.Embedding(64, dim)
        self.layers = nn.ModuleList(Attention(dim) for _ in range(layers))
        self.head = nn.Linear(dim, vocab)

    def forward(self, ids, positions, mask, caches):
        x = self.embed(ids) + self.positions(positions.clamp(min=0))
        q_len, k_len = ids.shape[1], mask.shape[1]
        causal = torch.ones(q_len, k_len, dtype=torch.bool).tril(k_len - q_len)
        keep = causal[None] & mask[:, None, :].bool()
        bias = torch.zeros(keep.shape).masked_fill(~keep, -1e9)
        for layer, cache in zip(self.layers, caches):
            x = layer(x, bias, cache)
        return self.head(x)


def main():
    model = Decoder().eval()
    ids = torch.tensor([[5, 6, 7, 8, 9, 10], [0, 0, 0, 11, 12, 13]])
    mask = (ids != 0).long()
    positions = mask.cumsum(-1) - 1
    caches = [[] for _ in model.layers]
    out = []
    with torch.no_grad():
        logits = model(ids, positions, mask, caches)
        for _ in range(3):
            token = logits[:, -1].argmax(-1, keepdim=True)
            step = mask.sum(-1, keepdim=True) if FIXED else torch.full_like(token, mask.shape[1])
            mask = torch.cat([mask, torch.ones_like(token)], dim=1)
            logits = model(token, step, mask, caches)
            out.append(token)
    print("generated", torch.cat(out, dim=1).tolist())


if __name__ == "__main__":
    main()
