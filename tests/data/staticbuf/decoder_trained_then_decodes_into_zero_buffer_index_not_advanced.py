"""A decoder trained on full causal passes, then decoding greedily into a fixed buffer of zeros (flax's decode cache).

The site's first calls are square training passes; the decode loop that follows starts from an empty cache, writing
each step's key at `cache_index` and masking the slots past it (`arange(length) <= cur_index`). Its first decode step
sees key 0 alone and is no top-left mask: the next step sees keys 0 and 1 over the same buffer, the cache filling from
its first slot (t5x's examples, written blind as quiet-r123a). The bug: the index is read but never written back, so
every step writes slot 0 and sees it alone, the cache never grows: a top-left mask at every step.
"""

import sys

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv
LENGTH = 8


class SelfAttention(nn.Module):
    def __init__(self, dim: int = 16, heads: int = 2):
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.qkv, self.out = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x, mask=None, cache=None):
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)
        if cache is not None:  # one query written into a buffer of LENGTH slots
            index = cache["cache_index"]
            one_hot = nn.functional.one_hot(torch.tensor(index), LENGTH).to(k.dtype)[:, None]
            k = cache["key"] + one_hot[None, None] * k
            v = cache["value"] + one_hot[None, None] * v
            cache["key"], cache["value"] = k, v
            if FIXED:
                cache["cache_index"] = index + 1
            mask = (torch.arange(LENGTH) <= index)[None, None, None, :]
        scores = q @ k.transpose(-1, -2) / self.head_dim ** 0.5
        scores = scores.masked_fill(~mask, float("-inf"))
        out = scores.softmax(-1) @ v
        return self.out(out.transpose(1, 2).reshape(b, -1, d))


class Decoder(nn.Module):
    def __init__(self, vocab: int = 20, dim: int = 16):
        super().__init__()
        self.embed, self.attn, self.head = nn.Embedding(vocab, dim), SelfAttention(dim), nn.Linear(dim, vocab)

    def forward(self, tokens, cache=None):
        n = tokens.shape[1]
        mask = None if cache is not None else torch.ones(n, n, dtype=torch.bool).tril()[None, None]
        x = self.embed(tokens)
        return self.head(x + self.attn(x, mask, cache))


def main() -> None:
    torch.manual_seed(0)
    model = Decoder()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    data = torch.randint(1, 20, (4, LENGTH))
    for _ in range(3):
        logits = model(data[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, 20), data[:, 1:].reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    cache = {"key": torch.zeros(1, 2, LENGTH, 8), "value": torch.zeros(1, 2, LENGTH, 8), "cache_index": 0}
    token, out = torch.tensor([[0]]), []
    with torch.no_grad():
        for _ in range(5):
            token = model(token, cache)[:, -1:].argmax(-1)
            out.append(int(token))
    print("loss", round(loss.item(), 4), "decoded", out)


if __name__ == "__main__":
    main()
