"""A Megatron-style core attention configured `attn_mask_type=AttnMaskType.causal` that hands SDPA no mask.

Bug: the core attention builds its mask only from the `attention_mask` it is given (None for a causal layer, as
Megatron passes it) and calls SDPA with `is_causal=False`, so every query sees later tokens although the module's
own mask type says causal. Fix: a causal mask type runs SDPA with `is_causal=True`.
"""
import enum
import sys

import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv


class AttnMaskType(enum.Enum):
    padding = 1
    causal = 2
    no_mask = 3


class CoreAttention(nn.Module):
    def __init__(self, attn_mask_type: AttnMaskType):
        super().__init__()
        self.attn_mask_type = attn_mask_type

    def forward(self, q, k, v, attention_mask=None):
        causal = FIXED and self.attn_mask_type == AttnMaskType.causal and attention_mask is None
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask, is_causal=causal)


class Layer(nn.Module):
    def __init__(self, width=16, heads=2):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.core_attention = CoreAttention(AttnMaskType.causal)

    def forward(self, x):
        s, b, w = x.shape  # Megatron's [s, b, h] layout
        q, k, v = self.qkv(x).view(s, b, 3, self.heads, w // self.heads).permute(2, 1, 3, 0, 4)
        return self.core_attention(q, k, v).permute(2, 0, 1, 3).reshape(s, b, w)


torch.manual_seed(0)
with torch.no_grad():
    print("out", round(float(Layer()(torch.randn(5, 3, 16))[0, 0, 0]), 4))
