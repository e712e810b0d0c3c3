"""flamingo-pytorch: text before the first image keeps a uniform attention over every image.

Citation: lucidrains/flamingo-pytorch commit 10913ab ("fix masking issue, thanks to @dhansmair",
v0.1.2). The discussion behind it is not in the commit; this program reproduces the diff.

Bug: MaskedCrossAttention (only_attend_immediate_media=True) masks text_time != media_time
before the softmax. Text tokens that come before any <image> have text_time == 0, match no media,
so their whole row is filled and the softmax makes it uniform over *all* media tokens, including
images that come later in the sequence. The code meant to zero those rows afterwards
(``attn.masked_fill(text_without_media_mask, 0.)``) was not in place, so its result was dropped.
Fix: ``attn = attn.masked_fill(text_without_media_mask, 0.)``.

Reproduction: one GatedCrossAttentionBlock (gate opened, as after training) over a batch whose
captions start with text before their first image, two images of 4 perceiver latents each.
einops' rearrange/repeat are written out with view/permute.
"""
import sys

import torch
from torch import nn, einsum

FIXED = "--fixed" in sys.argv


def exists(val):
    return val is not None


def FeedForward(dim, mult=4):
    inner_dim = int(dim * mult)
    return nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, inner_dim, bias=False), nn.GELU(),
                         nn.Linear(inner_dim, dim, bias=False))


class MaskedCrossAttention(nn.Module):
    def __init__(self, *, dim, dim_head=64, heads=8, only_attend_immediate_media=True):
        super().__init__()
        self.scale = dim_head ** -0.5
        self.heads = heads
        inner_dim = dim_head * heads
        self.norm = nn.LayerNorm(dim)
        self.to_q = nn.Linear(dim, inner_dim, bias=False)
        self.to_kv = nn.Linear(dim, inner_dim * 2, bias=False)
        self.to_out = nn.Linear(inner_dim, dim, bias=False)
        # whether for text to only attend to immediate preceding image, or all images
        self.only_attend_immediate_media = only_attend_immediate_media

    def forward(self, x, media, media_locations=None):
        b, t, m = media.shape[:3]
        h = self.heads
        x = self.norm(x)
        q = self.to_q(x)
        media = media.reshape(b, t * m, -1)  # 'b t n d -> b (t n) d'
        k, v = self.to_kv(media).chunk(2, dim=-1)
        q, k, v = (z.view(b, z.shape[1], h, -1).transpose(1, 2) for z in (q, k, v))  # 'b n (h d) -> b h n d'
        q = q * self.scale
        sim = einsum('... i d, ... j d -> ... i j', q, k)

        if exists(media_locations):
            text_time = media_locations.cumsum(dim=-1)  # at each boolean of True, increment the time counter
            media_time = torch.arange(t, device=x.device) + 1
            mask_op = torch.eq if self.only_attend_immediate_media else torch.ge
            text_to_media_mask = mask_op(text_time[:, None, :, None],
                                         media_time.repeat_interleave(m)[None, None, None, :])
            sim = sim.masked_fill(~text_to_media_mask, -torch.finfo(sim.dtype).max)

        sim = sim - sim.amax(dim=-1, keepdim=True).detach()
        attn = sim.softmax(dim=-1)

        if exists(media_locations) and self.only_attend_immediate_media:
            # any text without a preceding media needs to have attention zeroed out
            text_without_media_mask = text_time == 0
            text_without_media_mask = text_without_media_mask[:, None, :, None]
            if FIXED:
                attn = attn.masked_fill(text_without_media_mask, 0.)
            else:
                attn.masked_fill(text_without_media_mask, 0.)

        out = einsum('... i j, ... j d -> ... i d', attn, v)
        out = out.transpose(1, 2).reshape(b, x.shape[1], -1)  # 'b h n d -> b n (h d)'
        return self.to_out(out)


class GatedCrossAttentionBlock(nn.Module):
    def __init__(self, *, dim, dim_head=64, heads=8, ff_mult=4, only_attend_immediate_media=True):
        super().__init__()
        self.attn = MaskedCrossAttention(dim=dim, dim_head=dim_head, heads=heads,
                                         only_attend_immediate_media=only_attend_immediate_media)
        self.attn_gate = nn.Parameter(torch.tensor([0.]))
        self.ff = FeedForward(dim, mult=ff_mult)
        self.ff_gate = nn.Parameter(torch.tensor([0.]))

    def forward(self, x, media, media_locations=None):
        x = self.attn(x, media, media_locations=media_locations) * self.attn_gate.tanh() + x
        x = self.ff(x) * self.ff_gate.tanh() + x
        return x


if __name__ == "__main__":
    torch.manual_seed(0)
    block = GatedCrossAttentionBlock(dim=32, dim_head=8, heads=4)
    with torch.no_grad():  # gates as a trained model has them (zero at init)
        block.attn_gate.fill_(0.8)
        block.ff_gate.fill_(0.3)
    block.eval()
    IMAGE = 5
    text = torch.tensor([[9, 9, 9, IMAGE, 11, 12, 13, IMAGE, 14, 15],
                         [9, IMAGE, 11, 12, 13, 14, IMAGE, 15, 16, 17]])
    media_locations = text == IMAGE
    x = torch.randn(2, 10, 32)
    media = torch.randn(2, 2, 4, 32)  # (batch, images, perceiver latents, dim)
    with torch.no_grad():
        out = block(x, media, media_locations=media_locations)
    print("text token 0 out", [round(v, 4) for v in out[0, 0, :3].tolist()])
