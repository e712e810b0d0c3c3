"""pytorch/pytorch#27968: nn.MultiheadAttention with a key_padding_mask that hides every key of a batch row (a sequence
of length 0) returns NaN attention weights and outputs for that row (softmax over nothing). The fix is to keep empty
sequences out of the batch (here: drop them before attention)."""

import sys

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv


def seq_len_to_mask(seq_len, max_len):
    return torch.arange(max_len)[None, :] >= torch.tensor(seq_len)[:, None]  # True = padding, MHA's polarity


torch.manual_seed(0)
m = nn.MultiheadAttention(embed_dim=20, num_heads=5).eval()
lengths = [5, 3, 1, 0]
if FIXED:
    lengths = [n for n in lengths if n > 0]
i = torch.randn(len(lengths), 5, 20)
q = k = v = i.transpose(0, 1)
with torch.no_grad():
    ao, aow = m(q, k, v, key_padding_mask=seq_len_to_mask(lengths, max_len=5))
