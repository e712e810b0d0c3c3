"""A decoder run by a plain function over its blocks, whose prompt pass into a KV cache goes unmasked.

Bug: `run(blocks, embed, input_ids, caches)` is no module: the outermost module calls are the blocks. Its attention
(einsum scores, a hand-written softmax) adds a causal bias only where the call has no cache (`caches is None`); the
sampler prefills the prompt into an empty cache, so the prompt's queries see later tokens. The program checks its
logits against the same ids fed one at a time from an empty cache, which never show a later key. Fix: the bias is
laid on the last q of the keys whenever the call has several queries. A batch of two, unpadded.
"""
import sys

import torch
from torch import nn

FIXED = "--fixed" in sys.argv


class Block(nn.Module):
    def __init__(self, dim=16, heads=2):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x, cache, cached):
        b, t, d = x.shape
        q, k, v = (z.view(b, t, self.heads, d // self.heads) for z in self.qkv(x).chunk(3, dim=-1))
        if cache is not None:
            if cache:
                k, v = torch.cat([cache["k"], k], 1), torch.cat([cache["v"], v], 1)
            cache["k"], cache["v"] = k, v
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / (d // self.heads) ** 0.5
        s = k.shape[1]
        if (not cached or FIXED) and t > 1:
            later = torch.ones(t, s, dtype=torch.bool).triu(s - t + 1)
            scores = scores + torch.zeros(t, s).masked_fill(later, float("-inf"))
        weights = scores.softmax(-1)
        return x + self.proj(torch.einsum("bhqk,bkhd->bqhd", weights, v).reshape(b, t, d))


def run(blocks, embed, input_ids, caches=None):
    h = embed(input_ids)
    for i, block in enumerate(blocks):
        h = block(h, None if caches is None else caches[i], caches is not None)
    return h @ embed.weight.T


def main():
    torch.manual_seed(0)
    blocks, embed = nn.ModuleList([Block() for _ in range(2)]).eval(), nn.Embedding(32, 16)
    input_ids = torch.randint(0, 32, (2, 6))
    with torch.no_grad():
        caches = [{} for _ in blocks]
        prompt = run(blocks, embed, input_ids, caches)  # prefill into the cache
        steps = [{} for _ in blocks]
        stepped = torch.cat([run(blocks, embed, input_ids[:, i:i + 1], steps) for i in range(6)], 1)
    print("max |prompt - one at a time| = %.5f" % (prompt - stepped).abs().max().item())


if __name__ == "__main__":
    main()
