# The slip of pytorch/translate#230 (a decoder whose self-attention never gets the causal mask its program builds)
# written as The Annotated Transformer writes a decoder: a module-level `subsequent_mask(size)` beside the program's own
# Decoder, attention computed by hand (q @ kᵀ, masked_fill(mask == 0, -1e9), softmax), right-padded targets. Before
# the fix the batch's target mask was the padding alone, `(tgt != pad).unsqueeze(-2)`; the fix ands it with
# `subsequent_mask(tgt.size(-1))`, as the Annotated Transformer's Batch.make_std_mask does.
import math
import sys

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(4)
PAD, VOCAB, D_MODEL, HEADS = 0, 20, 16, 2


def subsequent_mask(size):
    "Mask out subsequent positions."
    return torch.triu(torch.ones(1, size, size), diagonal=1) == 0


def attention(query, key, value, mask):
    scores = query @ key.transpose(-2, -1) / math.sqrt(query.size(-1))
    scores = scores.masked_fill(mask == 0, -1e9)
    return scores.softmax(dim=-1) @ value


class MultiHeadedAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.linears = nn.ModuleList(nn.Linear(D_MODEL, D_MODEL) for _ in range(4))

    def forward(self, query, key, value, mask):
        b = query.size(0)
        q, k, v = [lin(x).view(b, -1, HEADS, D_MODEL // HEADS).transpose(1, 2)
                   for lin, x in zip(self.linears, (query, key, value))]
        x = attention(q, k, v, mask.unsqueeze(1))
        return self.linears[3](x.transpose(1, 2).reshape(b, -1, D_MODEL))


class DecoderLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.self_attn, self.src_attn = MultiHeadedAttention(), MultiHeadedAttention()

    def forward(self, x, memory, src_mask, tgt_mask):
        x = x + self.self_attn(x, x, x, tgt_mask)
        return x + self.src_attn(x, memory, memory, src_mask)


class Decoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D_MODEL)
        self.layers = nn.ModuleList(DecoderLayer() for _ in range(2))

    def forward(self, tgt, memory, src_mask, tgt_mask):
        x = self.embed(tgt)
        for layer in self.layers:
            x = layer(x, memory, src_mask, tgt_mask)
        return x


def make_std_mask(tgt, pad):
    tgt_mask = (tgt != pad).unsqueeze(-2)
    if FIXED:
        tgt_mask = tgt_mask & subsequent_mask(tgt.size(-1)).type_as(tgt_mask.data)
    return tgt_mask


decoder = Decoder().eval()
src = torch.tensor([[3, 4, 5, 6, 7], [8, 9, 10, PAD, PAD]])
memory = torch.randn(2, 5, D_MODEL)
src_mask = (src != PAD).unsqueeze(-2)
tgt = torch.tensor([[1, 11, 12, 13, PAD, PAD], [1, 14, 15, 16, 17, 18]])  # right-padded targets, row 0 padded
with torch.no_grad():
    out = decoder(tgt, memory, src_mask, make_std_mask(tgt, PAD))
print(out.shape)
