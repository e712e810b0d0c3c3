# Correct: Group DETR's groups kept apart by a block-diagonal attention mask over one sequence of G * n queries
# (True = masked, as nn.MultiheadAttention takes a bool attn_mask), in training, batch 1; then inference, where one
# group of n queries is decoded (n a multiple of G: a full self-attention over them is right).
import sys

import torch
import torch.nn as nn


class GroupSelfAttention(nn.Module):
    def __init__(self, dim, heads, group_nums):
        super().__init__()
        self.attn = nn.MultiheadAttention(dim, heads)
        self.group_nums = group_nums

    def forward(self, tgt):
        n = tgt.shape[0] // self.group_nums if self.training else tgt.shape[0]
        groups = self.group_nums if self.training else 1
        group = torch.arange(n * groups) // n
        mask = group[:, None] != group[None, :]
        return self.attn(tgt, tgt, tgt, attn_mask=mask, need_weights=False)[0]


def main():
    torch.manual_seed(0)
    dim, heads, n, group_nums = 16, 2, 6, 3
    layer = GroupSelfAttention(dim, heads, group_nums)
    queries = torch.randn(n * group_nums, 1, dim)  # sequence first, one image
    with torch.no_grad():
        layer.train()
        out = layer(queries)
        layer.eval()
        first = layer(queries[:n])
    print(f"{'--fixed' in sys.argv} group 0 decoded alone agrees: {(out[:n] - first).abs().max().item():.2e}")


if __name__ == "__main__":
    main()
