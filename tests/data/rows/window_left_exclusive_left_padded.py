"""A left-padded batch through a module that keeps FlashInfer's window_left = 3 (a query at p sees keys p - 3 .. p) and
builds its own mask for an eager softmax: it writes the left bound exclusive (`j > i - window_left`), so every query
sees 3 keys, not 4 (--fixed: `j >= i - window_left`)."""
import sys

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv


class LocalAttention(nn.Module):
    def __init__(self, dim=16, heads=2):
        super().__init__()
        self.heads = heads
        self.window_left = 3
        self.qkv = nn.Linear(dim, 3 * dim)

    def forward(self, x, attention_mask):
        b, t, d = x.shape
        q, k, v = (y.view(b, t, self.heads, -1).transpose(1, 2) for y in self.qkv(x).chunk(3, -1))
        i = torch.arange(t)[:, None]
        j = torch.arange(t)[None, :]
        inside = j >= i - self.window_left if FIXED else j > i - self.window_left
        keep = (j <= i) & inside & attention_mask.bool()[:, None, None, :]
        scores = (q @ k.transpose(-1, -2)) / q.shape[-1] ** 0.5
        scores = scores.masked_fill(~keep, float("-inf")).nan_to_num(nan=0.0)
        weights = torch.softmax(scores, -1).nan_to_num(0.0)
        return (weights @ v).transpose(1, 2).reshape(b, t, d)


def main():
    torch.manual_seed(0)
    embed, layer = nn.Embedding(30, 16), LocalAttention().eval()
    ids = torch.tensor([[0, 0, 0, 4, 5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20]])
    attention_mask = (ids != 0).long()
    with torch.no_grad():
        out = layer(embed(ids), attention_mask)
    print(tuple(out.shape), "%.4f" % out.sum().item())


if __name__ == "__main__":
    main()
