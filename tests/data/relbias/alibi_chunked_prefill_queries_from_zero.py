"""A right-padded batch of prompts prefilled in chunks of 4 through a key/value cache (as servers split a long prompt),
two decoder layers with ALiBi added by hand (MPT's slopes, bias = -slope * |k - q|). The bias numbers the chunk's
queries arange(q_len) while its keys run over the cache, arange(k_len), so from the second chunk on every query takes
the distances of a query 4 or 8 tokens earlier; the causal mask places them right (at k_len - q_len + i). --fixed
numbers the queries arange(k_len - q_len, k_len).
"""
import math
import sys

import torch
from torch import nn

FIXED = "--fixed" in sys.argv
CHUNK = 4


def alibi_slopes(heads):
    start = 2 ** (-8 / heads)
    return torch.tensor([start ** (i + 1) for i in range(heads)])


class Layer(nn.Module):
    def __init__(self, width=32, heads=4):
        super().__init__()
        self.heads, self.head_dim = heads, width // heads
        self.qkv = nn.Linear(width, 3 * width)
        self.out = nn.Linear(width, width)
        self.register_buffer("slopes", alibi_slopes(heads))

    def forward(self, x, key_real, cache):
        b, q_len, _ = x.shape
        q, k, v = self.qkv(x).view(b, q_len, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)
        if cache:
            k, v = torch.cat([cache[0], k], 2), torch.cat([cache[1], v], 2)
        cache[:] = [k, v]
        k_len = k.shape[2]
        key_pos = torch.arange(k_len)
        query_pos = torch.arange(k_len - q_len, k_len) if FIXED else torch.arange(q_len)
        bias = -self.slopes[:, None, None] * (key_pos[None, None, :] - query_pos[None, :, None]).abs()
        scores = q @ k.transpose(-1, -2) / math.sqrt(self.head_dim) + bias
        causal = key_pos[None, :] > torch.arange(k_len - q_len, k_len)[:, None]
        hidden = causal[None, None] | ~key_real[:, None, None, :k_len]
        scores = scores.masked_fill(hidden, torch.finfo(scores.dtype).min)
        weights = scores.softmax(-1)
        return x + self.out((weights @ v).transpose(1, 2).reshape(b, q_len, -1))


def run(layers, embed, tokens, key_real, chunk):
    caches = [[] for _ in layers]
    outs = []
    for start in range(0, tokens.shape[1], chunk):
        x = embed(tokens[:, start:start + chunk])
        for layer, cache in zip(layers, caches):
            x = layer(x, key_real, cache)
        outs.append(x)
    return torch.cat(outs, 1)


def main():
    torch.manual_seed(0)
    embed = nn.Embedding(50, 32)
    layers = nn.ModuleList([Layer() for _ in range(2)]).eval()
    lengths = torch.tensor([12, 9])
    tokens = torch.randint(1, 50, (2, 12))
    key_real = torch.arange(12)[None, :] < lengths[:, None]
    with torch.no_grad():
        chunked = run(layers, embed, tokens, key_real, CHUNK)
        whole = run(layers, embed, tokens, key_real, 12)
    print("max |chunked prefill - one pass| (real tokens): %.4f" % (chunked - whole)[key_real].abs().max().item())


if __name__ == "__main__":
    main()
