"""pytorch/executorch#22285: the native static-attention mask kept every valid cache slot visible to each decoding
row, so a sliding-window layer attended past its window once decoding went beyond it (the prompt's mask had the
window). The fix derives each row's visible slots from its window. Written as a cache that keeps every key and a
decode step whose mask was the valid slots only, against the fixed one that keeps the window."""

import sys

import torch
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
WINDOW = 3
torch.manual_seed(0)
dim = 8
x = torch.randn(1, 1, 6, dim)


def attend(q, k, v, mask):  # the layer's attention, at the prompt and at each decoding step
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)



positions = torch.arange(6)
mask = (positions[None, :] <= positions[:, None]) & (positions[:, None] - positions[None, :] < WINDOW)
keys = values = x
out = attend(x, keys, values, mask)
for step in range(2):
    new = torch.randn(1, 1, 1, dim)
    keys = values = torch.cat([keys, new], dim=2)
    pos = keys.shape[2] - 1
    valid = torch.ones(1, keys.shape[2], dtype=torch.bool)  # every written slot
    if FIXED:
        valid &= torch.arange(keys.shape[2])[None, :] > pos - WINDOW
    out = attend(new, keys, values, valid)
