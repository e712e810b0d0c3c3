"""A hand-written seq2seq, written as the Annotated Transformer writes one, whose greedy decoding leaves the source
mask out of the decoder: every decoded token's source attention sees the source's padding.

The encoder is run with `src_mask = (src != pad).unsqueeze(-2)`, so its self-attention hides the left-padded source
tokens from every query (padding queries too). `greedy_decode` then calls `model.decode(memory, None, ys, tgt_mask)`:
the decoder's source attention (`src_attn`, over the memory) is handed no mask and its softmax weighs the padded memory
slots as well. The fix hands `src_mask` on. The pad id is written nowhere a rule reads it (a module-level constant), so
the padding is the encoder's own mask's statement. `--fixed` runs the fix.
"""

import copy
import math
import sys

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv
PAD = 1


def clones(module, n):
    return nn.ModuleList([copy.deepcopy(module) for _ in range(n)])


def attention(query, key, value, mask=None):
    scores = torch.matmul(query, key.transpose(-2, -1)) / math.sqrt(query.size(-1))
    if mask is not None:
        scores = scores.masked_fill(mask == 0, -1e9)
    p_attn = scores.softmax(dim=-1)
    return torch.matmul(p_attn, value)


class MultiHeadedAttention(nn.Module):
    def __init__(self, h, d_model):
        super().__init__()
        self.d_k, self.h = d_model // h, h
        self.linears = clones(nn.Linear(d_model, d_model), 4)

    def forward(self, query, key, value, mask=None):
        if mask is not None:
            mask = mask.unsqueeze(1)  # the same mask on every head
        nbatches = query.size(0)
        query, key, value = [lin(x).view(nbatches, -1, self.h, self.d_k).transpose(1, 2)
                             for lin, x in zip(self.linears, (query, key, value))]
        x = attention(query, key, value, mask=mask)
        return self.linears[-1](x.transpose(1, 2).contiguous().view(nbatches, -1, self.h * self.d_k))


class EncoderLayer(nn.Module):
    def __init__(self, d_model):
        super().__init__()
        self.self_attn = MultiHeadedAttention(2, d_model)
        self.ff = nn.Linear(d_model, d_model)

    def forward(self, x, mask):
        x = x + self.self_attn(x, x, x, mask)
        return x + self.ff(x)


class DecoderLayer(nn.Module):
    def __init__(self, d_model):
        super().__init__()
        self.self_attn = MultiHeadedAttention(2, d_model)
        self.src_attn = MultiHeadedAttention(2, d_model)
        self.ff = nn.Linear(d_model, d_model)

    def forward(self, x, memory, src_mask, tgt_mask):
        x = x + self.self_attn(x, x, x, tgt_mask)
        x = x + self.src_attn(x, memory, memory, src_mask)
        return x + self.ff(x)


class Encoder(nn.Module):
    def __init__(self, d_model, n):
        super().__init__()
        self.layers = clones(EncoderLayer(d_model), n)

    def forward(self, x, mask):
        for layer in self.layers:
            x = layer(x, mask)
        return x


class Decoder(nn.Module):
    def __init__(self, d_model, n):
        super().__init__()
        self.layers = clones(DecoderLayer(d_model), n)

    def forward(self, x, memory, src_mask, tgt_mask):
        for layer in self.layers:
            x = layer(x, memory, src_mask, tgt_mask)
        return x


class EncoderDecoder(nn.Module):
    def __init__(self, vocab, d_model=16, n=2):
        super().__init__()
        self.encoder, self.decoder = Encoder(d_model, n), Decoder(d_model, n)
        self.src_embed, self.tgt_embed = nn.Embedding(vocab, d_model), nn.Embedding(vocab, d_model)
        self.generator = nn.Linear(d_model, vocab)

    def encode(self, src, src_mask):
        return self.encoder(self.src_embed(src), src_mask)

    def decode(self, memory, src_mask, tgt, tgt_mask):
        return self.decoder(self.tgt_embed(tgt), memory, src_mask, tgt_mask)


def subsequent_mask(size):
    return torch.triu(torch.ones(1, size, size), diagonal=1) == 0


def greedy_decode(model, src, src_mask, max_len, start_symbol):
    memory = model.encode(src, src_mask)
    ys = torch.full((src.size(0), 1), start_symbol, dtype=src.dtype)
    for _ in range(max_len - 1):
        out = model.decode(memory, src_mask if FIXED else None, ys, subsequent_mask(ys.size(1)))
        next_word = model.generator(out[:, -1]).argmax(dim=-1)
        ys = torch.cat([ys, next_word[:, None]], dim=1)
    return ys


def main():
    torch.manual_seed(0)
    model = EncoderDecoder(vocab=20).eval()
    src = torch.tensor([[PAD, PAD, 5, 6, 7, 8], [4, 9, 3, 2, 7, 5], [PAD, PAD, PAD, 3, 4, 6]])  # left-padded
    src_mask = (src != PAD).unsqueeze(-2)
    with torch.no_grad():
        print(greedy_decode(model, src, src_mask, max_len=4, start_symbol=0).tolist())


if __name__ == "__main__":
    main()
