"""A bidirectional text encoder whose (B, L, L) `src_pad_mask` (True = padding) is laid over the query rows instead of
the key columns: the padding queries see nothing, and every real token of a right-padded row attends the padding
(--fixed: laid over the key columns)."""
import sys

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv
PAD = 0


class Encoder(nn.Module):
    def __init__(self, dim=16, heads=2):
        super().__init__()
        self.heads = heads
        self.embed = nn.Embedding(30, dim)
        self.qkv = nn.Linear(dim, 3 * dim)

    def forward(self, src):
        b, n = src.shape
        pad = src == PAD
        src_pad_mask = pad[:, None, :].expand(b, n, n) if FIXED else pad[:, :, None].expand(b, n, n)
        x = self.embed(src)
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
        scores = scores.masked_fill(src_pad_mask[:, None], -1e4)
        return x + (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, n, -1)


if __name__ == "__main__":
    torch.manual_seed(0)
    src = torch.tensor([[4, 5, 6, 7, 8, 9], [10, 11, 12, 0, 0, 0], [13, 14, 15, 16, 0, 0]])
    with torch.no_grad():
        out = Encoder().eval()(src)
    print("cls", out[:, 0, 0].tolist())
