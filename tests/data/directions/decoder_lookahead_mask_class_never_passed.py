"""Encoder-decoder whose look-ahead mask class exists but is never used.

A toy transformer (encoder + decoder, hand-written softmax attention) is
evaluated with teacher forcing on a batch of two source
sequences (length 6) and their target sequences (length 5, no padding).
The module defines ``LookAheadMask``, which builds a lower-triangular
boolean mask (1 = this query may attend to that key) for the decoder's
self-attention.

The bug: the model never builds a ``LookAheadMask``; the decoder's
self-attention is called with ``mask=None``.  Under teacher forcing every
target position can then read the later target tokens, including the very
token it is supposed to predict, so the decoder output at position 0 depends
on the whole target and the loss is not the loss of an autoregressive model.

The fix: build ``LookAheadMask(T).mask`` for the target length T and pass it
to every decoder layer's self-attention.  Cross-attention over the encoder
output stays unmasked in both modes (the sources have no padding).

The script prints the first four values of the decoder output at the first
target position (they change with the fix, because only the buggy run lets
that position see later ones) and the mean cross-entropy loss.
"""
import math
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)

D_MODEL, N_HEADS, D_FF, N_LAYERS = 32, 4, 64, 2
SRC_VOCAB, TGT_VOCAB = 30, 30
BOS = 1


class LookAheadMask:
    """Lower-triangular mask: entry [i, j] is True when query i may attend to key j."""

    def __init__(self, size):
        self.mask = torch.tril(torch.ones(size, size)).bool()[None, None]


class MultiHeadAttention(nn.Module):
    def __init__(self, d_model, n_heads):
        super().__init__()
        self.h = n_heads
        self.d = d_model // n_heads
        self.w_q = nn.Linear(d_model, d_model)
        self.w_k = nn.Linear(d_model, d_model)
        self.w_v = nn.Linear(d_model, d_model)
        self.w_o = nn.Linear(d_model, d_model)

    def _heads(self, x):
        b, n, _ = x.shape
        return x.view(b, n, self.h, self.d).transpose(1, 2)

    def forward(self, query, key, value, mask=None):
        q = self._heads(self.w_q(query))
        k = self._heads(self.w_k(key))
        v = self._heads(self.w_v(value))
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.d)
        if mask is not None:
            scores = scores.masked_fill(mask == 0, float("-inf"))
        weights = torch.softmax(scores, -1)
        out = (weights @ v).transpose(1, 2).reshape(query.shape[0], query.shape[1], -1)
        return self.w_o(out)


def feed_forward():
    return nn.Sequential(nn.Linear(D_MODEL, D_FF), nn.ReLU(), nn.Linear(D_FF, D_MODEL))


class EncoderLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = MultiHeadAttention(D_MODEL, N_HEADS)
        self.ff = feed_forward()
        self.norm1 = nn.LayerNorm(D_MODEL)
        self.norm2 = nn.LayerNorm(D_MODEL)

    def forward(self, x):
        x = self.norm1(x + self.attn(x, x, x))
        return self.norm2(x + self.ff(x))


class DecoderLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.self_attn = MultiHeadAttention(D_MODEL, N_HEADS)
        self.cross_attn = MultiHeadAttention(D_MODEL, N_HEADS)
        self.ff = feed_forward()
        self.norm1 = nn.LayerNorm(D_MODEL)
        self.norm2 = nn.LayerNorm(D_MODEL)
        self.norm3 = nn.LayerNorm(D_MODEL)

    def forward(self, y, memory, self_mask):
        y = self.norm1(y + self.self_attn(y, y, y, mask=self_mask))
        y = self.norm2(y + self.cross_attn(y, memory, memory))
        return self.norm3(y + self.ff(y))


def sinusoid(length, dim):
    pos = torch.arange(length, dtype=torch.float)[:, None]
    freq = torch.exp(torch.arange(0, dim, 2, dtype=torch.float) * (-math.log(10000.0) / dim))
    table = torch.zeros(length, dim)
    table[:, 0::2] = torch.sin(pos * freq)
    table[:, 1::2] = torch.cos(pos * freq)
    return table


class Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(SRC_VOCAB, D_MODEL)
        self.layers = nn.ModuleList(EncoderLayer() for _ in range(N_LAYERS))

    def forward(self, src):
        x = self.embed(src) * math.sqrt(D_MODEL) + sinusoid(src.shape[1], D_MODEL)
        for layer in self.layers:
            x = layer(x)
        return x


class Decoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(TGT_VOCAB, D_MODEL)
        self.layers = nn.ModuleList(DecoderLayer() for _ in range(N_LAYERS))

    def forward(self, tgt_in, memory):
        T = tgt_in.shape[1]
        y = self.embed(tgt_in) * math.sqrt(D_MODEL) + sinusoid(T, D_MODEL)
        self_mask = LookAheadMask(T).mask if FIXED else None
        for layer in self.layers:
            y = layer(y, memory, self_mask)
        return y


class Seq2Seq(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = Encoder()
        self.decoder = Decoder()
        self.out = nn.Linear(D_MODEL, TGT_VOCAB)

    def forward(self, src, tgt):
        # teacher forcing: the decoder reads BOS + target[:-1] and predicts target
        tgt_in = torch.cat([torch.full_like(tgt[:, :1], BOS), tgt[:, :-1]], dim=1)
        memory = self.encoder(src)
        hidden = self.decoder(tgt_in, memory)
        logits = self.out(hidden)
        loss = F.cross_entropy(logits.reshape(-1, TGT_VOCAB), tgt.reshape(-1))
        return hidden, loss


def main():
    model = Seq2Seq().eval()
    src = torch.randint(2, SRC_VOCAB, (2, 6))
    tgt = torch.randint(2, TGT_VOCAB, (2, 5))
    with torch.no_grad():
        hidden, loss = model(src, tgt)
    print(f"mode: {'fixed' if FIXED else 'buggy'}")
    print("decoder output [0, 0, :4]:", [round(v, 4) for v in hidden[0, 0, :4].tolist()])
    print(f"mean loss: {loss.item():.4f}")


if __name__ == "__main__":
    main()
