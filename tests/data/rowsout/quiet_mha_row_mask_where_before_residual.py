# Correct, of the shape masked-rows-reach-residual reads: a resampled-media cross-attention with nn.MultiheadAttention,
# right-padded text, the text rows with no media given a zero float bias (uniform weights) and named by `text_row_mask`
# ((B, L), 1 = the row has media). The block zeroes those rows' attention output with torch.where before the residual
# add, so nothing of the media reaches them.
import sys

import torch
from torch import nn

torch.manual_seed(0)


class MediaBlock(nn.Module):
    def __init__(self, dim=32, heads=4):
        super().__init__()
        self.heads = heads
        self.norm = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.gate = nn.Parameter(torch.tensor(0.9))

    def forward(self, x, media, media_bias, text_row_mask):
        out, _ = self.attn(self.norm(x), media, media, attn_mask=media_bias, need_weights=False)
        out = torch.where(text_row_mask[..., None].bool(), out, 0.0)
        return x + self.gate.tanh() * out


block = MediaBlock().eval()
b, n, m, heads = 2, 7, 5, 4
media_from = torch.tensor([3, 1])  # the first text position that follows the media, per row
text_row_mask = (torch.arange(n)[None, :] >= media_from[:, None]).long()
bias = torch.zeros(b, n, m).masked_fill(~text_row_mask.bool()[..., None], -1e9)
bias = bias * text_row_mask[..., None]  # (rows with no media unmasked: uniform, no NaN)
bias = bias.repeat_interleave(heads, dim=0)
with torch.no_grad():
    out = block(torch.randn(b, n, 32), torch.randn(b, m, 32), bias, text_row_mask)
print("fixed" if "--fixed" in sys.argv else "buggy", tuple(out.shape))
