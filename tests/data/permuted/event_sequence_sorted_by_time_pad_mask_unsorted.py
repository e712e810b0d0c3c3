# The hepattn bug (samvanstroud/hepattn c85cf35) written another way: an event-sequence encoder (a temporal point
# process's history, left padded, its `padding_mask` True on the pads) sorts each row's events by their time stamps
# with torch.sort and Tensor.gather before torch's nn.MultiheadAttention, and hands the key padding mask on unsorted.
# The fix gathers the mask with the same order.
import sys

import torch
from torch import nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class EventEncoder(nn.Module):
    def __init__(self, dim=16, heads=2):
        super().__init__()
        self.inp = nn.Linear(3, dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.norm = nn.LayerNorm(dim)

    def forward(self, events, times, padding_mask):
        order = torch.sort(times, dim=1).indices  # (B, L): each row's events by time
        h = self.inp(events).gather(1, order[..., None].expand(-1, -1, self.inp.out_features))
        if FIXED:
            padding_mask = padding_mask.gather(1, order)
        out, _ = self.attn(h, h, h, key_padding_mask=padding_mask, need_weights=False)
        h = self.norm(h + out)
        back = torch.empty_like(order).scatter_(1, order, torch.arange(order.shape[1]).expand_as(order))
        return h.gather(1, back[..., None].expand_as(h))  # (the events in the order they came)


model = EventEncoder().eval()
counts = [10, 6, 8]
L = max(counts)
events = torch.randn(3, L, 3)
times = torch.rand(3, L) * 100  # (pads carry arbitrary times too)
padding_mask = torch.zeros(3, L, dtype=torch.bool)
for b, n in enumerate(counts):
    padding_mask[b, : L - n] = True  # left padded
with torch.no_grad():
    out = model(events, times, padding_mask)
    alone = model(events[1:2, L - 6:], times[1:2, L - 6:], padding_mask[1:2, L - 6:])
print(f"fixed={FIXED}  max |padded row - alone|: {float((out[1, L - 6:] - alone[0]).abs().max()):.6f}")
