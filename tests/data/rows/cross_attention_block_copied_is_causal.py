"""A text-to-motion model's conditioning block: `TextCrossAttention.forward(x, cond)` attends the motion frames to
the same number of text-encoder states, but the SDPA line was copied from the block's self-attention with
`is_causal=True`, so frame i reads only text states 0..i. `--fixed` drops the flag. Written as a second form of
transformers#48172 (Mllama's text cross-attention run causal under SDPA), differently: a hand-written block whose
class name alone says cross-attention (its memory argument is `cond`), as many memory states as queries."""
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


class SelfAttentionBlock(nn.Module):
    def __init__(self, dim=16, heads=2):
        super().__init__()
        self.heads, self.qkv, self.out = heads, nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x):
        b, n, d = x.shape
        q, k, v = (t.view(b, n, self.heads, -1).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))
        return self.out(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, n, d))


class TextCrossAttention(nn.Module):
    def __init__(self, dim=16, heads=2):
        super().__init__()
        self.heads, self.q, self.kv, self.out = heads, nn.Linear(dim, dim), nn.Linear(dim, 2 * dim), nn.Linear(dim, dim)

    def forward(self, x, cond):
        b, n, d = x.shape
        q = self.q(x).view(b, n, self.heads, -1).transpose(1, 2)
        k, v = (t.view(b, -1, self.heads, d // self.heads).transpose(1, 2) for t in self.kv(cond).chunk(2, -1))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=not FIXED)
        return self.out(out.transpose(1, 2).reshape(b, n, d))


class MotionDecoder(nn.Module):
    def __init__(self, dim=16):
        super().__init__()
        self.self_attn, self.cross_block = SelfAttentionBlock(dim), TextCrossAttention(dim)

    def forward(self, motion, text_states):
        h = motion + self.self_attn(motion)
        return h + self.cross_block(h, text_states)


torch.manual_seed(0)
model = MotionDecoder().eval()
with torch.no_grad():
    out = model(torch.randn(2, 7, 16), torch.randn(2, 7, 16))
print("fixed" if FIXED else "buggy", tuple(out.shape))
