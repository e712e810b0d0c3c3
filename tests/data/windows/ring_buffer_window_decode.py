"""A sliding layer whose decode cache is a ring buffer (slot = position % W): the mask must be on the slots.

Bug: the decode mask treats the slots as positions (slot j visible where p - W < j <= p), so once the buffer wraps
it hides slots that hold the newest keys. Fix: a slot is visible once written (every slot holds one of the last W).
The window is stated in a dict the model keeps (self.cfg).
"""
import sys

import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv
W, D = 4, 8


class Ring(nn.Module):
    def __init__(self):
        super().__init__()
        self.cfg = {"sliding_window": W, "hidden": D}
        self.qkv = nn.Linear(D, 3 * D)
        self.keys = torch.zeros(1, 1, W, D)
        self.values = torch.zeros(1, 1, W, D)

    def forward(self, x, cache_position):
        q, k, v = self.qkv(x).unsqueeze(1).chunk(3, dim=-1)
        pos = int(cache_position[0])
        if x.shape[1] > 1:  # prefill: the prompt's own keys, a causal window over positions
            for i in range(x.shape[1]):
                self.keys[:, :, i % W], self.values[:, :, i % W] = k[:, :, i], v[:, :, i]
            p = torch.arange(x.shape[1])
            mask = (p[None, :] <= p[:, None]) & (p[None, :] > p[:, None] - W)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        self.keys[:, :, pos % W], self.values[:, :, pos % W] = k[:, :, 0], v[:, :, 0]
        slot = torch.arange(W)
        if FIXED:
            mask = slot <= pos  # written slots: all of them once the buffer wrapped
        else:
            mask = (slot <= pos) & (slot > pos - W)  # slots read as positions
        return F.scaled_dot_product_attention(q, self.keys, self.values, attn_mask=mask[None, :])


torch.manual_seed(0)
model = Ring()
with torch.no_grad():
    out = model(torch.randn(1, 3, D), torch.arange(3))
    for pos in range(3, 7):
        out = model(torch.randn(1, 1, D), torch.tensor([pos]))
print("done", tuple(out.shape))
