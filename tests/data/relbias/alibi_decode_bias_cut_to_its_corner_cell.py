"""An ALiBi decoder whose cached decode step adds one bias value per head to every key: the distances lost.

Written another way (ssbuild/deep_training 54a9d1b, Baichuan-13B: `attention_mask[:, :, -seq_length:]` kept the last
key column at decode, so each head added one constant): the model builds its ALiBi bias over the whole sequence,
(heads, L, L) with slope * (k - q) and -inf past each query, and at a decode step takes the cell of the new query's
own key alone, `bias[:, -1:, -1:]`, a (heads, 1, 1) value broadcast over the keys; softmax ignores a constant, so
the cached keys lose their distance to the query. The fix takes the query's row, `bias[:, -1:, :]`.
"""

import math
import sys

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv


def slopes(heads: int) -> torch.Tensor:
    start = 2 ** (-8 / heads)
    return torch.tensor([start ** (i + 1) for i in range(heads)])


def alibi_bias(heads: int, length: int) -> torch.Tensor:
    at = torch.arange(length)
    distance = (at[None, :] - at[:, None]).float()  # k - q
    bias = slopes(heads)[:, None, None] * distance[None]
    return bias.masked_fill(distance[None] > 0, float("-inf"))


class Attention(nn.Module):
    def __init__(self, dim: int = 32, heads: int = 4):
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.qkv, self.out = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x, bias, cache):
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)
        if cache:
            k, v = torch.cat([cache[0], k], dim=2), torch.cat([cache[1], v], dim=2)
        scores = q @ k.transpose(-1, -2) / math.sqrt(self.head_dim) + bias
        out = torch.softmax(scores, dim=-1) @ v
        return self.out(out.transpose(1, 2).reshape(b, n, d)), (k, v)


class Model(nn.Module):
    def __init__(self, vocab: int = 48, dim: int = 32, heads: int = 4, layers: int = 2):
        super().__init__()
        self.heads = heads
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Attention(dim, heads) for _ in range(layers))
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens, caches=None):
        past = 0 if caches is None else caches[0][0].shape[2]
        n = tokens.shape[1]
        bias = alibi_bias(self.heads, past + n)
        if past:
            bias = bias[:, -n:, :] if FIXED else bias[:, -n:, -n:]
        h, new = self.embed(tokens), []
        for i, layer in enumerate(self.layers):
            out, cache = layer(h, bias, None if caches is None else caches[i])
            h = h + out
            new.append(cache)
        return self.head(h), new


def main() -> None:
    torch.manual_seed(0)
    model = Model().eval()
    tokens = torch.tensor([[3, 17, 8, 25, 11, 30, 2, 41, 9, 14]])
    with torch.no_grad():
        logits, caches = model(tokens)
        out = []
        for _ in range(6):
            token = logits[:, -1:].argmax(-1)
            out.append(int(token))
            logits, caches = model(token, caches)
    print("generated", out, "last logits", [round(v, 4) for v in logits[0, -1, :4].tolist()])


if __name__ == "__main__":
    main()
