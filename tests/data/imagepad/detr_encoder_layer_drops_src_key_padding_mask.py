"""A DETR-style encoder over a batch of images of different sizes, whose encoder layer drops the pixels' padding mask.

Two images (5 x 7 and 8 x 4 patches after a stride-16 patchify) are padded on the bottom and the right to the batch's
largest height and width (DETR's `nested_tensor_from_tensor_list`: mask True on the padded pixels), flattened to
(B, H * W) with the features. The encoder layer takes `src_key_padding_mask` but calls its nn.MultiheadAttention
without it, so every real pixel attends the padding. `--fixed` hands `key_padding_mask=src_key_padding_mask`.
"""

import sys

import torch
from torch import nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)
D = 32


def nested_tensor_from_tensor_list(tensors):
    """DETR's util: pad each (C, H, W) image to the batch's max H and W; mask True where padded."""
    max_size = [max(s) for s in zip(*[t.shape for t in tensors])]
    batch = torch.zeros(len(tensors), *max_size)
    mask = torch.ones(len(tensors), max_size[1], max_size[2], dtype=torch.bool)
    for img, pad_img, m in zip(tensors, batch, mask):
        pad_img[: img.shape[0], : img.shape[1], : img.shape[2]].copy_(img)
        m[: img.shape[1], : img.shape[2]] = False
    return batch, mask


class EncoderLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.self_attn = nn.MultiheadAttention(D, 4, batch_first=True)
        self.norm = nn.LayerNorm(D)

    def forward(self, src, src_key_padding_mask=None, pos=None):
        q = k = src + pos
        if FIXED:
            out = self.self_attn(q, k, src, key_padding_mask=src_key_padding_mask)[0]
        else:
            out = self.self_attn(q, k, src)[0]
        return self.norm(src + out)


class Detr(nn.Module):
    def __init__(self):
        super().__init__()
        self.backbone = nn.Conv2d(3, D, 16, stride=16)
        self.layers = nn.ModuleList([EncoderLayer() for _ in range(2)])
        self.row_embed = nn.Parameter(torch.randn(16, D // 2))
        self.col_embed = nn.Parameter(torch.randn(16, D // 2))

    def forward(self, images, mask):
        features = self.backbone(images)  # (B, D, H, W)
        h, w = features.shape[-2:]
        mask = nn.functional.interpolate(mask[None].float(), size=(h, w))[0].bool()
        pos = torch.cat([self.col_embed[:w][None].repeat(h, 1, 1), self.row_embed[:h][:, None].repeat(1, w, 1)], -1)
        src = features.flatten(2).transpose(1, 2)
        pos = pos.flatten(0, 1)[None].expand(src.shape[0], -1, -1)
        for layer in self.layers:
            src = layer(src, src_key_padding_mask=mask.flatten(1), pos=pos)
        return src


model = Detr().eval()
images, mask = nested_tensor_from_tensor_list([torch.randn(3, 80, 112), torch.randn(3, 128, 64)])
with torch.no_grad():
    memory = model(images, mask)
    print("image 0, first patch:", [round(float(x), 4) for x in memory[0, 0, :4]])
