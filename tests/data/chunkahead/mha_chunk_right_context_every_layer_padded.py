"""A chunked streaming encoder written with nn.MultiheadAttention: chunks of 3 frames, 1 frame of right context
(`self.chunk_size = 3`, `self.chunk_right = 1`), no left limit, over a right-padded batch; the mask is a (B * heads,
T, T) bool attn_mask (True = not allowed). As written every one of the 4 layers gets the right context, so a chunk's
outputs reach 4 frames past it; --fixed: the first layer sees the right context and the others stop at the chunk end."""
import sys

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv


def chunk_mask(t, size, right, lengths):
    at = torch.arange(t)
    last = (at // size + 1) * size - 1 + right  # each query's last key
    allowed = at[None, :] <= last[:, None]
    real = at[None, :] < lengths[:, None]
    allowed = allowed[None] & real[:, None, :]
    allowed = allowed | (at[None, None, :] == 0)  # (padded queries keep frame 0: no row without keys)
    return ~allowed


class StreamingEncoder(nn.Module):
    def __init__(self, dim=16, heads=2, layers=4, chunk_size=3, chunk_right=1):
        super().__init__()
        self.heads, self.chunk_size, self.chunk_right = heads, chunk_size, chunk_right
        self.layers = nn.ModuleList([nn.MultiheadAttention(dim, heads, batch_first=True) for _ in range(layers)])

    def forward(self, x, lengths):
        t = x.shape[1]
        with_right = chunk_mask(t, self.chunk_size, self.chunk_right, lengths).repeat_interleave(self.heads, dim=0)
        without = chunk_mask(t, self.chunk_size, 0, lengths).repeat_interleave(self.heads, dim=0)
        for i, layer in enumerate(self.layers):
            mask = with_right if i == 0 or not FIXED else without
            x = x + layer(x, x, x, attn_mask=mask, need_weights=False)[0]
        return x


def main():
    torch.manual_seed(0)
    enc = StreamingEncoder().eval()
    x = torch.randn(2, 12, 16)
    with torch.no_grad():
        print(enc(x, torch.tensor([12, 8])).shape)


if __name__ == "__main__":
    main()
