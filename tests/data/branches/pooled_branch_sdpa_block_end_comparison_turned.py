"""A compressed branch written another way (mean-pooled key/value blocks, F.avg_pool1d, a bool keep mask built with
broadcasting and handed to SDPA, a batch of two, blocks of 2 tokens with stride 2), summed with a causal sliding
branch over the same queries. The bug: `block_end > pos` (the blocks that end after each query); the fix:
`block_end <= pos` (the blocks that have ended), rows with no ended block zeroed after the kernel."""
import sys

import torch
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)

B, H, T, D, BLOCK, WINDOW = 2, 2, 12, 8, 2, 3


class PooledSparseAttention(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = torch.nn.Linear(H * D, 3 * H * D, bias=False)

    def forward(self, x):
        q, k, v = self.qkv(x).view(B, T, 3, H, D).permute(2, 0, 3, 1, 4)
        pool = lambda t: F.avg_pool1d(t.reshape(B * H, T, D).transpose(1, 2), BLOCK, BLOCK).transpose(1, 2).reshape(B, H, -1, D)
        ck, cv = pool(k), pool(v)
        pos = torch.arange(T)
        block_end = torch.arange(ck.shape[2]) * BLOCK + BLOCK - 1
        if FIXED:
            keep = block_end[None, :] <= pos[:, None]
        else:
            keep = block_end[None, :] > pos[:, None]
        o_cmp = F.scaled_dot_product_attention(q, ck, cv, attn_mask=keep)
        o_cmp = torch.where(keep.any(-1)[:, None], o_cmp, 0.0)
        local = (pos[None, :] <= pos[:, None]) & (pos[:, None] - pos[None, :] < WINDOW)
        o_loc = F.scaled_dot_product_attention(q, k, v, attn_mask=local)
        return (o_cmp + o_loc).transpose(1, 2).reshape(B, T, H * D)


def main():
    layer = PooledSparseAttention().eval()
    x = torch.randn(B, T, H * D)
    x2 = x.clone()
    x2[:, -2:] = torch.randn(B, 2, H * D)
    with torch.no_grad():
        leak = (layer(x)[:, :-2] - layer(x2)[:, :-2]).abs().max().item()
    print(f"{'fixed' if FIXED else 'buggy'}: change of earlier outputs after editing the last 2 tokens = {leak:.4e}")


if __name__ == "__main__":
    main()
