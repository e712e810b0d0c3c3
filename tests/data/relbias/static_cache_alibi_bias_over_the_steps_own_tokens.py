"""An ALiBi decoder over a static cache whose bias spans the step's own tokens: at decode, no distance bias at all.

keras-team/keras-hub#2977 (tests/data/bugs/keras_hub_falcon_cached_decode_alibi_over_query_window.py: the bias built
over the step's own token at `cache_update_index`) written another way: a hand-written decoder preallocates its keys
and values for `max_len` positions (a static cache: the slots past the step unwritten, hidden by the mask), writes
each step at `cache_position`, and adds `-slope * (q - k)` to the eager scores. The bias is built over the distances
among the step's own tokens, padded out to the buffer with 0, where the fix takes each query's `cache_position` against
every slot: right at the prefill (its tokens are the first slots), but a decode step's one token gets a single 0, so
the keys before it lose their distance to it.
"""
import math
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


def slopes(heads):
    start = 2 ** (-8 / heads)
    return torch.tensor([start ** (i + 1) for i in range(heads)])


class StaticCacheAttention(nn.Module):
    def __init__(self, dim, heads, max_len, batch):
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)
        self.register_buffer("k_cache", torch.zeros(batch, heads, max_len, self.head_dim), persistent=False)
        self.register_buffer("v_cache", torch.zeros(batch, heads, max_len, self.head_dim), persistent=False)
        self.register_buffer("slopes", slopes(heads), persistent=False)

    def forward(self, x, cache_position):
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)
        self.k_cache[:, :, cache_position] = k
        self.v_cache[:, :, cache_position] = v
        keys, values = self.k_cache, self.v_cache
        max_len = keys.shape[2]
        key_pos = torch.arange(max_len)
        if FIXED:
            distance = (cache_position[:, None] - key_pos[None, :]).float()  # (t, max_len)
        else:  # (the distances among the step's own tokens, padded out to the buffer)
            own = torch.arange(t)
            distance = F.pad((own[:, None] - own[None, :]).float(), (0, max_len - t))
        bias = -self.slopes[:, None, None] * distance  # (heads, t, max_len)
        scores = q @ keys.transpose(-1, -2) / math.sqrt(self.head_dim) + bias
        visible = key_pos[None, :] <= cache_position[:, None]  # (t, max_len): the written slots up to each query
        scores = scores.masked_fill(~visible, float("-inf"))
        y = scores.softmax(-1) @ values
        return self.out(y.transpose(1, 2).reshape(b, t, d))


class Decoder(nn.Module):
    def __init__(self, vocab=40, dim=32, heads=4, layers=2, max_len=16, batch=2):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(StaticCacheAttention(dim, heads, max_len, batch) for _ in range(layers))
        self.head = nn.Linear(dim, vocab)

    def forward(self, ids, cache_position):
        x = self.embed(ids)
        for layer in self.layers:
            x = x + layer(x, cache_position)
        return self.head(x)


@torch.no_grad()
def main():
    torch.manual_seed(0)
    model = Decoder().eval()
    prompt = torch.tensor([[4, 17, 9, 30, 12], [8, 3, 25, 11, 6]])
    logits = model(prompt, torch.arange(prompt.shape[1]))
    out = []
    for step in range(6):
        nxt = logits[:, -1].argmax(-1, keepdim=True)
        out.append(nxt)
        logits = model(nxt, torch.tensor([prompt.shape[1] + step]))
    print("generated:", torch.cat(out, dim=1).tolist())


if __name__ == "__main__":
    main()
