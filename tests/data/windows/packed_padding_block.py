"""Packed documents padded at the end with position 0s: the padding may be one block, a real query must not see it.

Bug: the document lengths handed to the mask builder leave out the second document's boundary, so its queries see
the first document. Fix: every boundary given; the trailing padding is one block of its own (its position_ids all 0),
which is no document and is not judged as one.
"""
import sys

import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv


class Packed(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(8, 24)

    def forward(self, x, position_ids, lengths):
        q, k, v = self.qkv(x).view(1, -1, 3, 2, 4).permute(2, 0, 3, 1, 4)
        doc = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
        mask = (doc[:, None] == doc[None, :]) & torch.ones(len(doc), len(doc), dtype=torch.bool).tril()
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


torch.manual_seed(0)
position_ids = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 0, 0, 0]])
lengths = torch.tensor([4, 3, 3] if FIXED else [7, 3])
with torch.no_grad():
    out = Packed()(torch.randn(1, 10, 8), position_ids, lengths)
print("done", tuple(out.shape))
