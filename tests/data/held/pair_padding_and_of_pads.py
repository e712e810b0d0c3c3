"""Column attention over a protein pair map, its residues' padding True = padding: a pair (i, j) is padding where
either residue is (`pad_i | pad_j`); the buggy block builds it with `&`, so a real residue's column sees the padded
residues' pairs. The pair padding is folded into a (B * L, L) key padding mask for SDPA. --fixed uses `|`.
"""
import sys

import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv


class ColumnAttention(nn.Module):
    def __init__(self, width=16, heads=2):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)

    def attend(self, x, key_padding_mask):
        rows, length, width = x.shape
        q, k, v = self.qkv(x).view(rows, length, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        keep = ~key_padding_mask[:, None, None, :]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=keep).transpose(1, 2).reshape(rows, length, width)

    def forward(self, pair, residue_pad_mask):
        b, n, _, d = pair.shape
        if FIXED:
            pair_pad = residue_pad_mask[:, :, None] | residue_pad_mask[:, None, :]
        else:
            pair_pad = residue_pad_mask[:, :, None] & residue_pad_mask[:, None, :]
        columns = pair.permute(0, 2, 1, 3).reshape(b * n, n, d)  # (b j) i d
        out = self.attend(columns, pair_pad.permute(0, 2, 1).reshape(b * n, n))
        return out.view(b, n, n, d).permute(0, 2, 1, 3)


def main():
    torch.manual_seed(0)
    lengths = torch.tensor([5, 3])
    residue_pad_mask = torch.arange(5)[None, :] >= lengths[:, None]
    pair = torch.randn(2, 5, 5, 16)
    with torch.no_grad():
        out = ColumnAttention()(pair, residue_pad_mask)
    print("pair (0, 0) of protein 1:", [round(v, 4) for v in out[1, 0, 0, :3].tolist()])


if __name__ == "__main__":
    main()
