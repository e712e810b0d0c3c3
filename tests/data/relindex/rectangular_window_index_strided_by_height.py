"""A window attention over rectangular 2 x 4 windows, written as timm writes its helper: `get_relative_position_index`
shifts each offset to start from 0 and strides the row offset by `2 * win_h - 1`, the table's other side, where the
table has (2 * win_h - 1) * (2 * win_w - 1) rows laid out row by row (stride 2 * win_w - 1): on a square window the two
agree, on this one 21 offsets fall on 13 rows. The bias goes to SDPA as a float attn_mask over (B * nW, heads, N, N).
(nnFormer#88's colliding strides, here in 2-D.) --fixed strides by `2 * win_w - 1`.
"""
import sys

import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv


def get_relative_position_index(win_h, win_w):
    coords = torch.stack(torch.meshgrid(torch.arange(win_h), torch.arange(win_w), indexing="ij")).flatten(1)
    relative = (coords[:, :, None] - coords[:, None, :]).permute(1, 2, 0).contiguous()
    relative[:, :, 0] += win_h - 1
    relative[:, :, 1] += win_w - 1
    relative[:, :, 0] *= (2 * win_w - 1) if FIXED else (2 * win_h - 1)
    return relative.sum(-1)


class WindowAttention(nn.Module):
    def __init__(self, dim, window_size=(2, 4), num_heads=2):
        super().__init__()
        self.window_size, self.num_heads = window_size, num_heads
        win_h, win_w = window_size
        self.relative_position_bias_table = nn.Parameter(torch.randn((2 * win_h - 1) * (2 * win_w - 1), num_heads))
        self.register_buffer("relative_position_index", get_relative_position_index(win_h, win_w), persistent=False)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        b, n, c = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, self.num_heads, c // self.num_heads).permute(2, 0, 3, 1, 4)
        bias = self.relative_position_bias_table[self.relative_position_index.view(-1)].view(n, n, -1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias.permute(2, 0, 1).unsqueeze(0))
        return self.proj(out.transpose(1, 2).reshape(b, n, c))


def windows_of(x, window):
    b, h, w, c = x.shape
    x = x.view(b, h // window[0], window[0], w // window[1], window[1], c)
    return x.permute(0, 1, 3, 2, 4, 5).reshape(-1, window[0] * window[1], c)


def main():
    torch.manual_seed(0)
    attn = WindowAttention(16).eval()
    feature_map = torch.randn(2, 4, 8, 16)
    with torch.no_grad():
        out = attn(windows_of(feature_map, attn.window_size))
    used = attn.relative_position_index.unique().numel()
    print("bias rows used", used, "of", attn.relative_position_bias_table.shape[0], tuple(out.shape))


if __name__ == "__main__":
    main()
