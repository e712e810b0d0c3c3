"""A Flamingo-style VLM whose text-to-media mask counts each image from the token before its media token.

Written with SDPA and a boolean keep mask, `input_ids` as the text argument, every previous image visible
(`text_time >= media_time`, not only the immediate one) and `only_attend_previous=True` stated on each layer. A batch
of 2 rows, each with 2 images of 2 latents. Buggy: the media counter is the cumulative sum of the *next* token's
media flag (`media_locations[:, 1:]` padded at the end), so the token before each `<image>` already sees that image;
fixed (--fixed): the cumulative sum of the token's own flag.
"""
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
MEDIA = 5


class XAttnLayer(nn.Module):
    def __init__(self, dim=16, only_attend_previous=True):
        super().__init__()
        self.only_attend_previous = only_attend_previous
        self.q = nn.Linear(dim, dim)
        self.kv = nn.Linear(dim, 2 * dim)

    def forward(self, x, media, media_locations):
        b, t, n, d = media.shape
        k, v = self.kv(media.reshape(b, t * n, d)).chunk(2, dim=-1)
        flags = media_locations if FIXED else F.pad(media_locations[:, 1:], (0, 1))
        text_time = flags.long().cumsum(-1)  # (b, L): images placed at or before each token
        media_time = torch.arange(1, t + 1).repeat_interleave(n)  # (t * n,)
        keep = text_time[:, :, None] >= media_time[None, None, :]
        out = F.scaled_dot_product_attention(self.q(x)[:, None], k[:, None], v[:, None], attn_mask=keep[:, None])
        return x + out[:, 0].nan_to_num(0.0)


class VLM(nn.Module):
    def __init__(self, vocab=20, dim=16):
        super().__init__()
        self.media_token_id = MEDIA
        self.emb = nn.Embedding(vocab, dim)
        self.xattn = nn.ModuleList([XAttnLayer(dim) for _ in range(2)])

    def forward(self, input_ids, media):
        h = self.emb(input_ids)
        where = input_ids == self.media_token_id
        for layer in self.xattn:
            h = layer(h, media, where)
        return h


def main():
    torch.manual_seed(0)
    model = VLM().eval()
    input_ids = torch.tensor([[MEDIA, 1, 2, MEDIA, 3, 4], [1, MEDIA, 2, 3, MEDIA, 4]])
    media = torch.randn(2, 2, 2, 16)
    with torch.no_grad():
        out = model(input_ids, media)
    print(f"{'fixed' if FIXED else 'buggy'} out {out.sum().item():.4f}")


if __name__ == "__main__":
    main()
