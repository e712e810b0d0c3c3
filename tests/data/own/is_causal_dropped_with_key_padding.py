"""A hand-written decoder block whose attention takes `is_causal` per call, and drops it when a padding mask is given.

Written for maskcli's tests (trace/forwardflag.py, checks/own.py), as many small GPT ports write SDPA's two masks:
`F.scaled_dot_product_attention` refuses `attn_mask` together with `is_causal=True`, so the layer passes
`is_causal=is_causal and key_padding_mask is None`: a padded batch runs with its padding mask only, and every real
token sees the real tokens after it. The block calls its attention with `is_causal=True`, its own statement.
Fixed: the padding mask is AND-ed with a causal triangle and passed as one mask.
"""
import sys

import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv


class SelfAttention(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x, key_padding_mask=None, is_causal=False):
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        mask = None
        if key_padding_mask is not None:
            mask = ~key_padding_mask[:, None, None, :]  # True = attend
            if FIXED and is_causal:
                mask = mask & torch.ones(n, n, dtype=torch.bool).tril()
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                           is_causal=is_causal and key_padding_mask is None)
        return self.out(y.transpose(1, 2).reshape(b, n, d))


class Block(nn.Module):
    def __init__(self, dim=16, heads=2):
        super().__init__()
        self.ln = nn.LayerNorm(dim)
        self.attn = SelfAttention(dim, heads)

    def forward(self, x, key_padding_mask=None):
        return x + self.attn(self.ln(x), key_padding_mask=key_padding_mask, is_causal=True)


def main():
    torch.manual_seed(0)
    block = Block().eval()
    lengths = torch.tensor([7, 5])
    key_padding_mask = torch.arange(7)[None, :] >= lengths[:, None]  # True = padding (torch's way), right-padded
    with torch.no_grad():
        y = block(torch.randn(2, 7, 16), key_padding_mask=key_padding_mask)
    print("y[0, 0, :3]:", [round(v, 4) for v in y[0, 0, :3].tolist()])


if __name__ == "__main__":
    main()
