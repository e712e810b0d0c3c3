"""A hand-written VLM over a left-padded batch whose image tokens see each other both ways: the bidirectional block
is placed from the image mask of the first row only, so the second row's image is causal (--fixed: each row's own)."""
import sys
import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
IMG = 31


class VLM(nn.Module):
    def __init__(self, d=8):
        super().__init__()
        self.emb = nn.Embedding(40, d)
        self.qkv = nn.Linear(d, 3 * d)

    def forward(self, input_ids, attention_mask, image_mask):
        n = input_ids.shape[1]
        i = torch.arange(n)
        img = image_mask if FIXED else image_mask[:1].expand_as(image_mask)
        run = torch.cumsum(img & ~torch.nn.functional.pad(img, (1, 0))[:, :-1], 1)  # which image a token is in
        same = img[:, :, None] & img[:, None, :] & (run[:, :, None] == run[:, None, :])
        mask = ((i[None, :] <= i[:, None]) | same) & attention_mask.bool()[:, None, :]
        mask = mask | ~mask.any(-1, keepdim=True)
        q, k, v = self.qkv(self.emb(input_ids))[:, None].chunk(3, -1)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None])


torch.manual_seed(0)
ids = torch.tensor([[1, IMG, IMG, IMG, 5, 6, 7, 8], [0, 0, 1, 2, IMG, IMG, IMG, 9]])
VLM()(ids, (ids != 0).long(), ids == IMG)
