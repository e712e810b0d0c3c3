# A BERT-style encoder over a right-padded batch that masks its pad keys with `scores.masked_fill(pad, 0.0)` before
# the softmax (its author feared NaN from -inf): a score of 0 is an ordinary score, so every real token still reads
# the pad tokens. Fixed: masked_fill(pad, torch.finfo(scores.dtype).min).
import math
import sys

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)
PAD = 0


class EncoderSelfAttention(nn.Module):
    def __init__(self, width=32, heads=4):
        super().__init__()
        self.heads, self.head_dim = heads, width // heads
        self.query, self.key, self.value = (nn.Linear(width, width) for _ in range(3))
        self.out = nn.Linear(width, width)

    def split(self, x):
        B, L, _ = x.shape
        return x.view(B, L, self.heads, self.head_dim).permute(0, 2, 1, 3)

    def forward(self, x, pad):  # pad: (B, L), True at a pad token
        q, k, v = self.split(self.query(x)), self.split(self.key(x)), self.split(self.value(x))
        scores = torch.einsum("bhqd,bhkd->bhqk", q, k) / math.sqrt(self.head_dim)
        fill = torch.finfo(scores.dtype).min if FIXED else 0.0
        scores = scores.masked_fill(pad[:, None, None, :], fill)
        probs = scores.softmax(dim=-1)
        ctx = torch.einsum("bhqk,bhkd->bhqd", probs, v).permute(0, 2, 1, 3).flatten(2)
        return x + self.out(ctx)


class Encoder(nn.Module):
    def __init__(self, vocab=40, width=32, depth=2):
        super().__init__()
        self.embed = nn.Embedding(vocab, width, padding_idx=PAD)
        self.layers = nn.ModuleList(EncoderSelfAttention(width) for _ in range(depth))

    def forward(self, input_ids):
        pad = input_ids == PAD
        h = self.embed(input_ids)
        for layer in self.layers:
            h = layer(h, pad)
        return h


model = Encoder().eval()
input_ids = torch.randint(1, 40, (2, 7))
input_ids[1, 4:] = PAD
with torch.no_grad():
    batched = model(input_ids)[1, :4]
    alone = model(input_ids[1:, :4])[0]
print(f"fixed={FIXED} row 1 batched vs alone: {(batched - alone).abs().max().item():.3e}")
