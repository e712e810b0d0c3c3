"""Captions attending to detected image regions through nn.MultiheadAttention (batch_first): the regions' padding goes
in as key_padding_mask, and a per-sample grounding mask (True = masked: a caption's words read only the real regions,
its first token every slot) is made per head with `.repeat(heads, 1, 1)`, so a head of the second image gets the
first image's mask and its words lose the second image's last regions. --fixed uses repeat_interleave.
"""
import sys

import torch
from torch import nn

FIXED = "--fixed" in sys.argv


class RegionAttention(nn.Module):
    def __init__(self, width=16, heads=2):
        super().__init__()
        self.heads = heads
        self.attn = nn.MultiheadAttention(width, heads, batch_first=True)

    def forward(self, captions, regions, region_pad):
        b, t, _ = captions.shape
        per_sample = region_pad[:, None, :].expand(b, t, regions.shape[1]).clone()
        per_sample[:, 0] = False  # the first caption token reads every region slot
        if FIXED:
            per_head = per_sample.repeat_interleave(self.heads, dim=0)
        else:
            per_head = per_sample.repeat(self.heads, 1, 1)
        out, _ = self.attn(captions, regions, regions, key_padding_mask=region_pad, attn_mask=per_head)
        return out


def main():
    torch.manual_seed(0)
    region_pad = torch.tensor([[False, False, False, True, True], [False] * 5])
    with torch.no_grad():
        out = RegionAttention().eval()(torch.randn(2, 3, 16), torch.randn(2, 5, 16), region_pad)
    print("out", tuple(out.shape))


if __name__ == "__main__":
    main()
