"""video-diffusion-pytorch: the focus-present temporal mask was applied with its polarity inverted.

Citation: lucidrains/video-diffusion-pytorch#6 ("attn mask suppose be `~mask`"), fixed by
commit fbb0ef5 ("fix focus-present masking", v0.3.14).

Bug: the Unet3D's temporal attention takes `focus_present_mask` (one bool per batch sample:
True = this video sample trains as independent images, each frame attending only to itself;
False = frames attend across all of time).  `Attention.forward` built `mask` as "cells that
may be attended" (torch.eye for focusing samples, all ones otherwise) and then did
`sim.masked_fill(mask, -max)`, i.e. it blanked exactly the cells meant to stay: a focusing
sample's frames attended to every frame except themselves, and the other samples' rows were
filled with -max everywhere (uniform attention over the frames, scores ignored).
Fix: `sim.masked_fill(~mask, -max)`.

This program keeps the Attention module as written at v0.3.12 (heads split out, scale,
softmax over einsum scores) with the einops calls spelled as torch reshapes (einops is not
installed here), and runs the temporal attention of one Unet3D block on a batch of two
videos of 5 frames at 2x2 resolution, with prob_focus_present giving a mixed mask
[True, False] so that the masked path (not the all-focus shortcut) is taken.
"""
import sys

import torch
from torch import einsum, nn

FIXED = "--fixed" in sys.argv


def exists(x):
    return x is not None


class Attention(nn.Module):
    def __init__(self, dim, heads=4, dim_head=32, rotary_emb=None):
        super().__init__()
        self.scale = dim_head ** -0.5
        self.heads = heads
        hidden_dim = dim_head * heads

        self.rotary_emb = rotary_emb
        self.to_qkv = nn.Linear(dim, hidden_dim * 3, bias=False)
        self.to_out = nn.Linear(hidden_dim, dim, bias=False)

    def forward(self, x, pos_bias=None, focus_present_mask=None):
        n, device = x.shape[-2], x.device

        qkv = self.to_qkv(x).chunk(3, dim=-1)

        if exists(focus_present_mask) and focus_present_mask.all():
            # if all batch samples are focusing on present
            # it would be equivalent to passing that token's values through to the output
            values = qkv[-1]
            return self.to_out(values)

        # split out heads: '... n (h d) -> ... h n d'
        q, k, v = (t.reshape(*t.shape[:-1], self.heads, -1).transpose(-3, -2) for t in qkv)

        q = q * self.scale

        sim = einsum('... h i d, ... h j d -> ... h i j', q, k)

        if exists(pos_bias):
            sim = sim + pos_bias

        if exists(focus_present_mask) and not (~focus_present_mask).all():
            attend_all_mask = torch.ones((n, n), device=device, dtype=torch.bool)
            attend_self_mask = torch.eye(n, device=device, dtype=torch.bool)

            mask = torch.where(
                focus_present_mask.view(-1, 1, 1, 1, 1),
                attend_self_mask.view(1, 1, 1, n, n),
                attend_all_mask.view(1, 1, 1, n, n),
            )

            if FIXED:
                sim = sim.masked_fill(~mask, -torch.finfo(sim.dtype).max)
            else:
                sim = sim.masked_fill(mask, -torch.finfo(sim.dtype).max)

        # numerical stability
        sim = sim - sim.amax(dim=-1, keepdim=True).detach()
        attn = sim.softmax(dim=-1)

        out = einsum('... h i j, ... h j d -> ... h i d', attn, v)
        # '... h n d -> ... n (h d)'
        out = out.transpose(-3, -2).reshape(*out.shape[:-3], n, -1)
        return self.to_out(out)


class TemporalAttention(nn.Module):
    """EinopsToAndFrom('b c f h w', 'b (h w) f c', Attention(...)) of the Unet3D blocks."""

    def __init__(self, dim, heads, dim_head):
        super().__init__()
        self.fn = Attention(dim, heads=heads, dim_head=dim_head)

    def forward(self, x, **kwargs):
        b, c, f, h, w = x.shape
        x = x.permute(0, 3, 4, 2, 1).reshape(b, h * w, f, c)
        x = self.fn(x, **kwargs)
        return x.reshape(b, h, w, f, c).permute(0, 4, 3, 1, 2)


def main():
    torch.manual_seed(0)
    batch, channels, frames, height, width = 2, 16, 5, 2, 2
    temporal_attn = TemporalAttention(channels, heads=2, dim_head=8)
    video = torch.randn(batch, channels, frames, height, width)
    # Unet3D.forward draws this with prob_mask_like((batch,), prob_focus_present, device);
    # a fixed draw of one focusing and one non-focusing sample keeps the run deterministic.
    focus_present_mask = torch.tensor([True, False])
    with torch.no_grad():
        out = temporal_attn(video, pos_bias=None, focus_present_mask=focus_present_mask)
    print("fixed" if FIXED else "buggy", tuple(out.shape), f"{out.abs().sum().item():.4f}")


if __name__ == "__main__":
    main()
