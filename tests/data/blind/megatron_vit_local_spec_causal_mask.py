"""Megatron-LM local ViT layer spec used a causal mask for image patches.

Citation: NVIDIA/Megatron-LM PR #4395 ("fix: use no_mask in local ViT layer spec", merged;
fixes issue #1791).  The PR description was read (not the full diff): it changes
`AttnMaskType.causal` -> `AttnMaskType.no_mask` in `get_vit_layer_with_local_spec()`
(megatron/core/models/vision/vit_layer_specs.py), matching the TE spec already fixed by
commit 20abc8599 ("fix vit mask").  The softmax path below is a torch port of Megatron's
local `DotProductAttention` + `FusedScaleMaskSoftmax.forward_torch_softmax`, which builds the
default causal mask itself when the attention type is causal and no mask is passed.

Bug: the vision encoder calls its layers with `attention_mask=None` (bidirectional intent:
ViTs attend over all patches), but the local spec's `params={"attn_mask_type":
AttnMaskType.causal}` made the softmax add an upper-triangular mask: each patch saw only the
patches before it in raster order (with `--transformer-impl local`).
Fix: `AttnMaskType.no_mask` in the local ViT spec.

Reproduction: the spec -> `SelfAttention` -> `DotProductAttention` chain on a CLS + 2x2-patch
image batch, attention_mask=None as the CLIP ViT model passes it.
"""
import enum
import math
import sys
from dataclasses import dataclass, field

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv


class AttnMaskType(enum.Enum):
    padding = 1
    causal = 2
    no_mask = 3


@dataclass
class ModuleSpec:
    module: type
    params: dict = field(default_factory=dict)
    submodules: object = None


def get_default_causal_mask(sq):
    return torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)


class FusedScaleMaskSoftmax(nn.Module):
    def __init__(self, attn_mask_type, scale=None):
        super().__init__()
        self.attn_mask_type = attn_mask_type
        self.scale = scale

    def forward(self, input, mask):
        return self.forward_torch_softmax(input, mask)

    def forward_torch_softmax(self, input, mask):
        if self.scale is not None:
            input = input * self.scale
        sq, sk = input.size(2), input.size(3)
        if self.attn_mask_type == AttnMaskType.causal and mask is None and sq > 1:
            # Only the causal mask is generated here; a padding mask would come from the caller.
            mask = get_default_causal_mask(sq)
        if mask is not None:
            input = input.masked_fill(mask, -10000.0)
        return torch.nn.Softmax(dim=-1)(input)


class DotProductAttention(nn.Module):
    def __init__(self, attn_mask_type, head_dim):
        super().__init__()
        self.attn_mask_type = attn_mask_type
        self.scale_mask_softmax = FusedScaleMaskSoftmax(attn_mask_type, scale=1.0 / math.sqrt(head_dim))

    def forward(self, query, key, value, attention_mask, attn_mask_type=None):
        # [sq, b, np, hn] -> [b, np, sq, sk]
        q = query.permute(1, 2, 0, 3)
        k = key.permute(1, 2, 0, 3)
        v = value.permute(1, 2, 0, 3)
        attention_scores = q @ k.transpose(-2, -1)
        attention_probs = self.scale_mask_softmax(attention_scores, attention_mask)
        context = attention_probs @ v
        return context.permute(2, 0, 1, 3).flatten(2)


class SelfAttention(nn.Module):
    def __init__(self, hidden_size, num_heads, attn_mask_type):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = hidden_size // num_heads
        self.linear_qkv = nn.Linear(hidden_size, 3 * hidden_size)
        self.core_attention = DotProductAttention(attn_mask_type, self.head_dim)
        self.linear_proj = nn.Linear(hidden_size, hidden_size)

    def forward(self, hidden_states, attention_mask):
        sq, b, _ = hidden_states.shape
        qkv = self.linear_qkv(hidden_states).view(sq, b, self.num_heads, 3 * self.head_dim)
        query, key, value = qkv.split(self.head_dim, dim=-1)
        return self.linear_proj(self.core_attention(query, key, value, attention_mask))


def get_vit_layer_with_local_spec():
    attn_mask_type = AttnMaskType.no_mask if FIXED else AttnMaskType.causal
    return ModuleSpec(module=SelfAttention, params={"attn_mask_type": attn_mask_type})


def main():
    torch.manual_seed(0)
    hidden_size, num_heads = 16, 2
    spec = get_vit_layer_with_local_spec()
    layer = spec.module(hidden_size, num_heads, **spec.params)
    num_patches = 4  # 2x2 grid
    x = torch.randn(1 + num_patches, 2, hidden_size)  # [s, b, h]: CLS + patches
    with torch.no_grad():
        out = layer(x, attention_mask=None)
    print(spec.params["attn_mask_type"].name, "cls out[:3] =", [round(v, 4) for v in out[0, 0, :3].tolist()])


if __name__ == "__main__":
    main()
