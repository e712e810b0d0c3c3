"""A seq2seq decoder that keeps its padding as (B, 1, 1, L) bools, True = a padded token, held as `target_padding_mask`
and `source_padding_mask` (fairseq's and MHA's polarity, broadcast over heads and queries), an einsum attention with a -inf fill and softmax: the decoder
layer hands its self-attention no mask at all (a refactor passed `mask=None` where the combined causal and padding mask
was meant), so every target token sees the padding and the future. The source is as long as the target and padded in
another row, so the memory's padding, kept by the cross-attention, is held beside the target's. --fixed hands the
self-attention the target padding AND the causal triangle.
"""
import sys

import torch
from torch import nn

FIXED = "--fixed" in sys.argv


class Attention(nn.Module):
    def __init__(self, width, heads):
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v, self.o = (nn.Linear(width, width) for _ in range(4))

    def forward(self, x, memory, mask=None):
        b, n, d = x.shape
        split = lambda t: t.view(b, -1, self.heads, d // self.heads)  # noqa: E731
        q, k, v = split(self.q(x)), split(self.k(memory)), split(self.v(memory))
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / (d // self.heads) ** 0.5
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        weights = scores.softmax(dim=-1)
        return self.o(torch.einsum("bhqk,bkhd->bqhd", weights, v).reshape(b, n, d))


class DecoderLayer(nn.Module):
    def __init__(self, width=16, heads=2):
        super().__init__()
        self.self_attn = Attention(width, heads)
        self.src_attn = Attention(width, heads)
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)

    def forward(self, x, memory, self_mask, memory_mask):
        h = self.norm1(x)
        x = x + self.self_attn(h, h, self_mask if FIXED else None)
        return x + self.src_attn(self.norm2(x), memory, memory_mask)


class Decoder(nn.Module):
    def __init__(self, vocab=40, width=16, layers=2, pad_id=0):
        super().__init__()
        self.pad_id = pad_id
        self.embed = nn.Embedding(vocab, width, padding_idx=pad_id)
        self.layers = nn.ModuleList(DecoderLayer(width) for _ in range(layers))

    def forward(self, target_ids, memory, source_ids):
        length = target_ids.shape[1]
        target_padding_mask = (target_ids == self.pad_id)[:, None, None, :]  # (B, 1, 1, L), True = padding
        source_padding_mask = (source_ids == self.pad_id)[:, None, None, :]
        future = torch.ones(length, length, dtype=torch.bool).tril()
        self_mask = ~target_padding_mask & future
        x = self.embed(target_ids)
        for layer in self.layers:
            x = layer(x, memory, self_mask, ~source_padding_mask)
        return x


def main():
    torch.manual_seed(0)
    source_ids = torch.tensor([[5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 0, 0]])
    target_ids = torch.tensor([[1, 21, 22, 23, 0, 0], [1, 24, 25, 26, 27, 28]])
    memory = torch.randn(2, 6, 16)
    with torch.no_grad():
        out = Decoder().eval()(target_ids, memory, source_ids)
    print("decoded", tuple(out.shape))


if __name__ == "__main__":
    main()
