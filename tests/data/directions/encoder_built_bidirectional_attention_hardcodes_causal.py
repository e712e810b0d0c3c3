# Written another way (after lucidrains/routing-transformer 57b1573): an x-transformers-style encoder built
# `Encoder(..., bidirectional=True)` whose Attention blocks are built with `is_causal=True` hard-coded instead of
# `is_causal=not bidirectional`; each block builds a tril mask and-ed with the right-padded batch's key padding and
# hands it to SDPA, so the encoder's tokens never see the later tokens of their sentence. The fix hands the word down.
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class Attention(nn.Module):
    def __init__(self, dim, heads, is_causal):
        super().__init__()
        self.heads, self.is_causal = heads, is_causal
        self.to_qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.to_out = nn.Linear(dim, dim)

    def forward(self, x, key_padding_mask):
        b, n, d = x.shape
        q, k, v = self.to_qkv(x).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        allowed = ~key_padding_mask[:, None, None, :]  # (B, 1, 1, N): True = a real key
        if self.is_causal:
            allowed = allowed & torch.ones(n, n, dtype=torch.bool).tril()
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
        return self.to_out(out.transpose(1, 2).reshape(b, n, d))


class Encoder(nn.Module):
    def __init__(self, dim, depth, heads=2, bidirectional=False):
        super().__init__()
        causal = True if not FIXED else not bidirectional
        self.blocks = nn.ModuleList(Attention(dim, heads, is_causal=causal) for _ in range(depth))
        self.norm = nn.LayerNorm(dim)

    def forward(self, x, key_padding_mask):
        for block in self.blocks:
            x = x + block(self.norm(x), key_padding_mask)
        return x


encoder = Encoder(16, depth=2, bidirectional=True).eval()
lengths = torch.tensor([7, 4])
x = torch.randn(2, 7, 16)
key_padding_mask = torch.arange(7)[None, :] >= lengths[:, None]  # True = padding (right-padded)
with torch.no_grad():
    out = encoder(x, key_padding_mask)
print("first token's output depends on the last real token:",
      bool((encoder(x.index_fill(1, torch.tensor([3]), 0.0), key_padding_mask)[0, 0] - out[0, 0]).abs().max() > 0))
