"""A speech LM packing two samples, each audio placeholder id expanded into 4 frame embeddings, its documents' cu_seqlens
left over the ids.

Bug: the collator's `cu_seqlens` count the token ids (one per audio placeholder); the model splices 4 encoder frames
in for each placeholder and hands the same `cu_seqlens` by keyword to every layer, whose block-diagonal causal mask
(one SDPA call over the whole packed row) then cuts the first sample short, runs the second from inside the first,
and leaves the last tokens in a block of their own. Fix: the model maps each boundary through the expansion (a
cumulative sum of each id's width) before the layers.
"""
import sys

import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv
AUDIO = 99  # the placeholder id
FRAMES = 4  # encoder frames per placeholder


class Block(nn.Module):
    def __init__(self, width=16, heads=2):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)

    def forward(self, h, cu_seqlens=None):
        b, t, w = h.shape
        q, k, v = self.qkv(h).view(b, t, 3, self.heads, w // self.heads).permute(2, 0, 3, 1, 4)
        sample = torch.full((t,), -1)
        for i in range(len(cu_seqlens) - 1):
            sample[cu_seqlens[i]:cu_seqlens[i + 1]] = i
        allowed = torch.ones(t, t, dtype=torch.bool).tril() & (sample[:, None] == sample[None, :])
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
        return h + out.transpose(1, 2).reshape(b, t, w)


class SpeechLM(nn.Module):
    def __init__(self, width=16):
        super().__init__()
        self.embed = nn.Embedding(100, width)
        self.frames = nn.Linear(8, width)
        self.blocks = nn.ModuleList([Block(width), Block(width)])

    def forward(self, input_ids, audio, cu_seqlens):
        pieces, used = [], 0
        for token in input_ids[0].tolist():
            if token == AUDIO:
                pieces.append(self.frames(audio[used]))
                used += 1
            else:
                pieces.append(self.embed(torch.tensor([token])))
        h = torch.cat(pieces)[None]
        if FIXED:
            widths = torch.where(input_ids[0] == AUDIO, FRAMES, 1)
            starts = torch.cat([torch.zeros(1, dtype=torch.long), widths.cumsum(0)])
            cu_seqlens = starts[cu_seqlens]
        for block in self.blocks:
            h = block(h, cu_seqlens=cu_seqlens)
        return h


torch.manual_seed(0)
ids = torch.tensor([[3, AUDIO, 4, 5, 6, AUDIO, 7]])  # sample one: 3 ids, sample two: 4 ids
cu = torch.tensor([0, 3, 7], dtype=torch.int32)
with torch.no_grad():
    out = SpeechLM()(ids, torch.randn(2, FRAMES, 8), cu)
print("tokens", out.shape[1], "out", round(float(out[0, -1, 0]), 4))
