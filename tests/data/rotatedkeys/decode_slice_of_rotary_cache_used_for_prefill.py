"""A decoder whose rotary module caches cos/sin for every position and hands back the slice at `offset` for one new
token, the shape a decode step needs, (1, 1, 1, head_dim); the attention calls it for the prompt as well.

Bug: the prefill asks `rotary(offset)` too, so the one row at the prompt's start is broadcast over all of its tokens
(`q * cos + rotate_half(q) * sin` raises nothing): the whole prompt sits at position 0 and the causal mask alone orders
it. Fixed (--fixed): the prefill takes `rotary.span(offset, length)`, a row per token. The output differs silently.
"""

import sys

import torch
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(7)
DIM, HEADS, VOCAB = 32, 4, 40
HEAD = DIM // HEADS


def rotate_half(x):
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


class Rotary(torch.nn.Module):
    def __init__(self, most=64):
        super().__init__()
        inv = 1.0 / (10000.0 ** (torch.arange(0, HEAD, 2).float() / HEAD))
        freqs = torch.outer(torch.arange(most).float(), inv)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos()[None, None], persistent=False)
        self.register_buffer("sin", emb.sin()[None, None], persistent=False)

    def forward(self, offset):  # one new token's row
        return self.cos[:, :, offset:offset + 1], self.sin[:, :, offset:offset + 1]

    def span(self, offset, length):
        return self.cos[:, :, offset:offset + length], self.sin[:, :, offset:offset + length]


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = torch.nn.Linear(DIM, 3 * DIM)
        self.out = torch.nn.Linear(DIM, DIM)
        self.rotary = Rotary()

    def forward(self, x, cache):
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, HEADS, HEAD).permute(2, 0, 3, 1, 4)
        offset = 0 if cache is None else cache[0].shape[2]
        cos, sin = self.rotary.span(offset, s) if FIXED or s == 1 else self.rotary(offset)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        if cache is not None:
            k, v = torch.cat([cache[0], k], dim=2), torch.cat([cache[1], v], dim=2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=cache is None)
        return x + self.out(y.transpose(1, 2).reshape(b, s, DIM)), (k, v)


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, DIM)
        self.blocks = torch.nn.ModuleList(Block() for _ in range(2))
        self.head = torch.nn.Linear(DIM, VOCAB)

    def forward(self, ids, caches):
        x, new = self.embed(ids), []
        for block, cache in zip(self.blocks, caches):
            x, kept = block(x, cache)
            new.append(kept)
        return self.head(x), new


@torch.no_grad()
def main():
    model = Model().eval()
    ids = torch.tensor([[3, 17, 8, 25, 11, 30]])
    logits, caches = model(ids, [None, None])
    out = []
    for _ in range(4):
        token = logits[:, -1].argmax(-1, keepdim=True)
        out.append(int(token))
        logits, caches = model(token, caches)
    print(out, f"{float(logits.abs().sum()):.4f}")


main()
