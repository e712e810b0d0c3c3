"""Patch-n'-pack written another way: a collate packs each sample's images into one sequence, pads the batch on the
right, and builds the SDPA keep mask (True = may attend) from the images' ids and the samples' `seq_lens`. The key mask's
comparison is reversed (`arange >= seq_lens`, True on the padding), so real patches see nothing and the padding is
attended, and the longest sample sees no key at all (lucidrains/vit-pytorch#306's inverted key_pad_mask, here a
collate's F.pad, image ids padded with -1 and the mask handed to SDPA over 4-D (B, 1, L, L)). --fixed keeps the real
patches: `arange < seq_lens`.
"""
import sys

import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv


def collate(samples, dim):
    """Each sample a list of (patches, dim) images: (tokens, image ids, seq_lens), padded on the right to the longest."""
    seq_lens = torch.tensor([sum(image.shape[0] for image in images) for images in samples])
    longest = int(seq_lens.max())
    tokens, ids = [], []
    for images in samples:
        packed = torch.cat(images)
        own = torch.cat([torch.full((image.shape[0],), i) for i, image in enumerate(images)])
        pad = longest - packed.shape[0]
        tokens.append(F.pad(packed, (0, 0, 0, pad)))
        ids.append(F.pad(own, (0, pad), value=-1))
    return torch.stack(tokens), torch.stack(ids), seq_lens


class Block(nn.Module):
    def __init__(self, dim=16, heads=2):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x, keep):
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
        return x + self.out(y.transpose(1, 2).reshape(b, n, d))


class PackedViT(nn.Module):
    def __init__(self, dim=16, depth=2):
        super().__init__()
        self.blocks = nn.ModuleList([Block(dim) for _ in range(depth)])

    def forward(self, tokens, image_ids, seq_lens):
        length = tokens.shape[1]
        positions = torch.arange(length)[None, :]
        key_real = positions < seq_lens[:, None] if FIXED else positions >= seq_lens[:, None]
        same_image = image_ids[:, :, None] == image_ids[:, None, :]
        keep = (same_image & key_real[:, None, :])[:, None]
        x = tokens
        for block in self.blocks:
            x = block(x, keep)
        return x


def main():
    torch.manual_seed(0)
    dim = 16
    samples = [[torch.randn(6, dim), torch.randn(4, dim)], [torch.randn(5, dim)], [torch.randn(3, dim), torch.randn(3, dim)]]
    tokens, image_ids, seq_lens = collate(samples, dim)
    model = PackedViT(dim).eval()
    with torch.no_grad():
        out = model(tokens, image_ids, seq_lens)
    real = torch.arange(tokens.shape[1])[None, :] < seq_lens[:, None]
    print("NaN at real patches:", int(torch.isnan(out[real]).any(-1).sum()))


if __name__ == "__main__":
    main()
