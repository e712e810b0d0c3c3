"""Text tokens cross-attending to image latents, where one sample of the batch has no image: a finite fill spreads
its tokens over the padded latents.

Bug: a Flamingo-style gated cross-attention block over (B, M) media latents, `media_mask` True where a latent is real;
sample 1 carries no image (its mask all False, its latents zeros from the collator). The scores are filled with
torch.finfo.min where the mask is False and soft-maxed through bmm, so sample 1's text tokens take uniform weights
over its padded latents, and their output is the mean of the padding's values (the projection's bias). Fix: the block's output is multiplied
by `has_media` (0 for a sample with no image), as the gated block means. Batch of 3 (one sample without an image),
bmm over (B * heads) matrices.
"""
import sys

import torch
from torch import nn

FIXED = "--fixed" in sys.argv


class MediaCrossAttention(nn.Module):
    def __init__(self, dim=16, heads=2):
        super().__init__()
        self.heads, self.head = heads, dim // heads
        self.q = nn.Linear(dim, dim, bias=False)
        self.kv = nn.Linear(dim, 2 * dim)  # (with a bias: a zero latent's value is not 0)
        self.out = nn.Linear(dim, dim, bias=False)

    def forward(self, text, media, media_mask):
        b, t, d = text.shape
        m = media.shape[1]
        q = self.q(text).view(b, t, self.heads, self.head).transpose(1, 2).reshape(b * self.heads, t, self.head)
        k, v = (z.view(b, m, self.heads, self.head).transpose(1, 2).reshape(b * self.heads, m, self.head)
                for z in self.kv(media).chunk(2, -1))
        scores = torch.bmm(q, k.transpose(1, 2)) * self.head ** -0.5
        hidden = ~media_mask.repeat_interleave(self.heads, 0)[:, None, :]  # (B * heads, 1, M)
        scores = scores.masked_fill(hidden, torch.finfo(scores.dtype).min)
        out = torch.bmm(scores.softmax(-1), v)  # (B * heads, T, head)
        if FIXED:
            has_media = media_mask.any(-1).repeat_interleave(self.heads, 0)
            out = out * has_media[:, None, None].to(out.dtype)
        return text + self.out(out.view(b, self.heads, t, self.head).transpose(1, 2).reshape(b, t, d))


def main():
    torch.manual_seed(0)
    block = MediaCrossAttention().eval()
    text = torch.randn(3, 5, 16)
    media = torch.randn(3, 4, 16)
    media_mask = torch.tensor([[True, True, True, True], [False, False, False, False], [True, True, False, False]])
    media[1] = 0  # the collator's zeros for a sample with no image
    with torch.no_grad():
        out = block(text, media, media_mask)
    print("sample 1 moved by", round(float((out[1] - text[1]).abs().max()), 4))


if __name__ == "__main__":
    main()
