# tilde-research/nsa-release#3 (nsa-impl nsa/nsa.py L40-41): the compressed-branch mask_mod handed to FlexAttention
# returns True for *future* compressed blocks (the blocks to hide), but FlexAttention keeps positions where it is True.
# Reconstructed from the issue text (no snapshot available); tiny sizes.
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

FIXED = "--fixed" in sys.argv


class NativeSparseAttention(nn.Module):
    """Compressed + sliding-window branches of NSA, mixed by a learned gate."""

    def __init__(self, dim=32, n_heads=2, block_size=4, stride=4, window_size=4):
        super().__init__()
        self.n_heads, self.head_dim = n_heads, dim // n_heads
        self.block_size, self.stride, self.window_size = block_size, stride, window_size
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.compress_k = nn.Linear(block_size * self.head_dim, self.head_dim)
        self.compress_v = nn.Linear(block_size * self.head_dim, self.head_dim)
        self.gate = nn.Linear(dim, 2 * n_heads)
        self.out = nn.Linear(dim, dim, bias=False)

    def compress(self, x, proj):
        # x: (B, H, T, D) -> (B, H, n_blocks, D), block j covers tokens [j*stride, j*stride + block_size)
        blocks = x.unfold(2, self.block_size, self.stride)  # (B, H, n, D, l)
        return proj(blocks.transpose(-1, -2).flatten(-2))

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.n_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        ck, cv = self.compress(k, self.compress_k), self.compress(v, self.compress_v)
        stride, block_size = self.stride, self.block_size

        if FIXED:
            def compress_mask(b, h, q_idx, kv_idx):
                return q_idx >= kv_idx * stride + block_size - 1
        else:
            def compress_mask(b, h, q_idx, kv_idx):
                # hide compressed blocks that end after the query
                return q_idx < kv_idx * stride + block_size - 1

        cmp_mask = create_block_mask(compress_mask, None, None, T, ck.shape[2], device="cpu")
        o_cmp = flex_attention(q, ck, cv, block_mask=cmp_mask)

        i = torch.arange(T)
        swa_mask = (i[:, None] >= i[None, :]) & (i[:, None] - i[None, :] < self.window_size)
        o_swa = F.scaled_dot_product_attention(q, k, v, attn_mask=swa_mask)

        g = torch.sigmoid(self.gate(x)).view(B, T, 2, self.n_heads).permute(2, 0, 3, 1)[..., None]
        o = g[0] * o_cmp + g[1] * o_swa
        return self.out(o.transpose(1, 2).reshape(B, T, C))


def main():
    torch.manual_seed(0)
    T = 16
    attn = NativeSparseAttention().eval()
    x = torch.randn(1, T, 32)
    with torch.no_grad():
        # causality probe: row 1 differs from row 0 only in its last 4 tokens
        x2 = x.clone()
        x2[:, -4:] = torch.randn(1, 4, 32)
        y, y2 = attn(torch.cat([x, x2])).split(1)
    leak = (y[:, : T - 4] - y2[:, : T - 4]).abs().max().item()
    print(f"mode={'fixed' if FIXED else 'buggy'} change of outputs at t<{T - 4} after editing future tokens: {leak:.4e}")


if __name__ == "__main__":
    main()
