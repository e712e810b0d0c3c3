"""Packed samples numbered in attention_mask (0 = padding at each row's end), handed to nn.MultiheadAttention as padding.

Bug: a reward model takes the packing collator's attention_mask, which numbers each packed sample (1, 1, 2, 2, 2,
0), and hands nn.MultiheadAttention only a causal attn_mask and `key_padding_mask = attention_mask == 0`: the numbers
become "every token real", so each sample sees the ones packed before it in its row. The batch has no position_ids.
Fix: attn_mask is per batch row and head (B * heads, L, L), blocking every key of another sample number as well.
"""
import sys

import torch
from torch import nn

FIXED = "--fixed" in sys.argv


class PackedRewardModel(nn.Module):
    def __init__(self, vocab=30, width=16, heads=4):
        super().__init__()
        self.heads = heads
        self.embed = nn.Embedding(vocab, width)
        self.attn = nn.MultiheadAttention(width, heads, batch_first=True)
        self.head = nn.Linear(width, 1)

    def forward(self, input_ids, attention_mask):
        b, n = input_ids.shape
        blocked = torch.ones(n, n, dtype=torch.bool).triu(1)
        if FIXED:
            other = attention_mask[:, :, None] != attention_mask[:, None, :]
            blocked = (blocked[None] | other).repeat_interleave(self.heads, dim=0)
            blocked = blocked & ~torch.eye(n, dtype=torch.bool)  # (a padding query keeps its own key: no empty row)
        h = self.embed(input_ids)
        out, _ = self.attn(h, h, h, attn_mask=blocked, key_padding_mask=None if FIXED else attention_mask == 0,
                           need_weights=False)
        return self.head(out).squeeze(-1)


torch.manual_seed(0)
attention_mask = torch.tensor([[1, 1, 1, 2, 2, 2, 2, 0], [1, 1, 2, 2, 3, 3, 3, 3]])
input_ids = torch.randint(1, 30, attention_mask.shape).masked_fill(attention_mask == 0, 0)
with torch.no_grad():
    rewards = PackedRewardModel()(input_ids, attention_mask)
print("rewards", [round(v, 4) for v in rewards[:, -1].tolist()])
