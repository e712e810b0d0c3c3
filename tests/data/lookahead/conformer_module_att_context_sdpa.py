"""A Conformer-style self-attention module that holds its own `att_context_size = [4, 1]` (4 frames back, 1 ahead) and
builds the band as a bool keep mask for SDPA over a padded batch. As written the mask keeps what it states (quiet);
with --wider it lets each frame see 2 frames ahead, past the look-ahead the module states (sees-later stays)."""
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

WIDER = "--wider" in sys.argv


class LimitedContextAttention(nn.Module):
    def __init__(self, dim=16, heads=2, att_context_size=(4, 1)):
        super().__init__()
        self.heads = heads
        self.att_context_size = list(att_context_size)
        self.qkv = nn.Linear(dim, 3 * dim)

    def forward(self, x, lengths):
        b, t, d = x.shape
        q, k, v = (z.view(b, t, self.heads, -1).transpose(1, 2) for z in self.qkv(x).chunk(3, dim=-1))
        left, right = self.att_context_size
        ahead = right + 1 if WIDER else right
        at = torch.arange(t)
        band = (at[None, :] >= at[:, None] - left) & (at[None, :] <= at[:, None] + ahead)
        real = at[None, :] < lengths[:, None]
        keep = band[None, None] & real[:, None, None, :] & real[:, None, :, None]
        keep = keep | ~real[:, None, :, None] & (at[None, None, None, :] == 0)  # (padded frames see frame 0: no NaN)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
        return out.transpose(1, 2).reshape(b, t, d)


def main():
    torch.manual_seed(0)
    attn = LimitedContextAttention().eval()
    x = torch.randn(2, 12, 16)
    with torch.no_grad():
        print(attn(x, torch.tensor([12, 7])).shape)


if __name__ == "__main__":
    main()
