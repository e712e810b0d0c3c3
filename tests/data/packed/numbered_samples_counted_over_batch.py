"""Packed samples numbered per row in attention_mask, unpadded for a varlen loop by counting each number over the batch.

Bug: each row numbers its packed samples from 1 (0 = padding at the row's end); the model unpads the batch and
attends it one segment at a time, taking the segment lengths from `torch.bincount` of the numbers over the whole
batch. Row 1's sample 1 is counted with row 0's, so the first segment runs on past row 0's first sample into its
second, and the segments after it are misplaced too. Fix: lengths from each row's runs (`unique_consecutive`).
"""
import sys

import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv


def segment_lengths(attention_mask):
    if FIXED:
        return torch.cat([torch.unique_consecutive(row[row > 0], return_counts=True)[1] for row in attention_mask])
    return torch.bincount(attention_mask.flatten())[1:]


class VarlenBlock(nn.Module):
    def __init__(self, width=16, heads=2):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)

    def forward(self, tokens, lengths):
        # tokens: (T, width), the batch's real tokens one after another
        q, k, v = self.qkv(tokens).view(tokens.shape[0], 3, self.heads, -1).permute(1, 2, 0, 3)
        out, start = [], 0
        for n in lengths.tolist():
            out.append(F.scaled_dot_product_attention(q[None, :, start:start + n], k[None, :, start:start + n],
                                                      v[None, :, start:start + n], is_causal=True)[0])
            start += n
        return torch.cat(out, dim=1).transpose(0, 1).reshape(tokens.shape[0], -1)


class PackedPolicy(nn.Module):
    def __init__(self, vocab=30, width=16):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.block = VarlenBlock(width)

    def forward(self, input_ids, attention_mask):
        real = attention_mask.flatten() > 0
        return self.block(self.embed(input_ids).flatten(0, 1)[real], segment_lengths(attention_mask))


torch.manual_seed(0)
attention_mask = torch.tensor([[1, 1, 1, 2, 2, 0], [1, 1, 2, 2, 2, 2]])
input_ids = torch.randint(1, 30, attention_mask.shape)
with torch.no_grad():
    out = PackedPolicy()(input_ids, attention_mask)
print("done", tuple(out.shape))
