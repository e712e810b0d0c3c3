"""A WeNet-style streaming encoder layer: the encoder builds `chunk_masks` (B, T, T), True = may attend (chunks of 2
and the key padding), but the layer hands SDPA only the padding: each frame sees the frames of later chunks. --fixed
hands SDPA the chunk masks.
"""
import sys

import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv


def subsequent_chunk_mask(size, chunk_size):
    ret = torch.zeros(size, size, dtype=torch.bool)
    for i in range(size):
        ret[i, : min((i // chunk_size + 1) * chunk_size, size)] = True
    return ret


class Layer(nn.Module):
    def __init__(self, width=16, heads=2):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)

    def forward(self, x, masks, chunk_masks):
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        mask = chunk_masks if FIXED else masks.expand(b, t, t)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask.unsqueeze(1))


class Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = Layer()

    def forward(self, x, xs_lens, chunk_size=2):
        t = x.shape[1]
        masks = (torch.arange(t)[None, :] < xs_lens[:, None]).unsqueeze(1)  # (B, 1, T), True = a real frame
        chunk_masks = masks & subsequent_chunk_mask(t, chunk_size).unsqueeze(0)  # (B, T, T), True = may attend
        return self.layer(x, masks, chunk_masks)


def main():
    torch.manual_seed(0)
    x = torch.randn(2, 6, 16)
    with torch.no_grad():
        out = Encoder().eval()(x, torch.tensor([6, 5]))
    print("out", tuple(out.shape))


if __name__ == "__main__":
    main()
