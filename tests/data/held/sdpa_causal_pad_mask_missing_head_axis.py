# Written another way (bigcode-project/Megatron-LM commit 324d70d's bug): a left-padded GPT-style batch whose bool keep
# mask, causal & padding, is built (B, L, L) and handed to scaled_dot_product_attention as attn_mask beside
# (B, heads, L, L) scores with B == heads: SDPA broadcasts it from the right, so head h of every row runs with row h's
# mask. The fix gives the mask its head axis, attn_mask[:, None] (B, 1, L, L).
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)
DIM, HEADS, LENGTHS, L = 32, 4, [7, 3, 5, 8], 8


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(DIM, 3 * DIM)
        self.out = nn.Linear(DIM, DIM)

    def forward(self, x, attn_mask):
        b, n, _ = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, HEADS, DIM // HEADS).permute(2, 0, 3, 1, 4)
        if FIXED:
            attn_mask = attn_mask[:, None]
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)
        return x + self.out(y.transpose(1, 2).reshape(b, n, DIM))


def keep_mask(lengths, size):
    """True = may attend: causal over the real tokens of each left-padded row; a pad query sees itself only."""
    real = torch.arange(size)[None, :] >= (size - torch.tensor(lengths))[:, None]  # (B, L), left padding
    causal = torch.ones(size, size, dtype=torch.bool).tril()
    mask = causal[None] & real[:, None, :] & real[:, :, None]
    return mask | torch.eye(size, dtype=torch.bool)[None]


blocks = nn.ModuleList([Block() for _ in range(2)]).eval()
x = torch.randn(len(LENGTHS), L, DIM)
mask = keep_mask(LENGTHS, L)
with torch.no_grad():
    h = x
    for block in blocks:
        h = block(h, mask)
    worst = 0.0
    for i, n in enumerate(LENGTHS):
        one = x[i:i + 1, L - n:]
        for block in blocks:
            one = block(one, keep_mask([n], n))
        worst = max(worst, (h[i, L - n:] - one[0]).abs().max().item())
print(f"max |batched - one at a time| over real tokens = {worst:.6f}")
