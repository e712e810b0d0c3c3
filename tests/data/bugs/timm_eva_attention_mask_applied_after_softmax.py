"""timm EvaAttention (non-fused path) applies the key mask after the softmax.

Citation: huggingface/pytorch-image-models PR #2236 "eva.py: fixed bug in applying
attention mask" (merged 2024-07-19; description: "The mask should be applied before the
softmax."; rwightman: "weird, wonder how that happened... tx").

Bug: in `EvaAttention.forward`, when `fused_attn` is off (timm's `use_fused_attn()`
returns False, e.g. TIMM_FUSED_ATTN=0 or torch.jit scripting), the scores were
soft-maxed first and `attn_mask` was then written into the probabilities with
`masked_fill(~attn_mask[:, None, None, :], -inf)`: the masked keys' weight is never
removed from the normalisation and `attn @ v` is poisoned with -inf.
Fix: `masked_fill` on the scores, then `softmax`.

Reproduction: the EvaAttention class as timm 1.0.7 wrote it (qkv fused, rope optional,
`attn_mask` a (B, N) bool keep-mask over the tokens, e.g. a patch-drop / padded token
set), run on a batch whose second image keeps only 6 of 9 tokens (cls + 8 patches).
The pre-fix order (`attn.softmax(dim=-1)` then `masked_fill`) was read in a stored copy
derived from timm's eva.py, the fixed order in stored copies of later versions; the rest
of the module follows the upstream layout (qkv fused, q/v bias, k_bias buffer).
"""
import sys
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


class EvaAttention(nn.Module):
    fused_attn: torch.jit.Final[bool]

    def __init__(
            self,
            dim: int,
            num_heads: int = 8,
            qkv_bias: bool = True,
            qkv_fused: bool = True,
            num_prefix_tokens: int = 1,
            attn_drop: float = 0.,
            proj_drop: float = 0.,
            attn_head_dim: Optional[int] = None,
            norm_layer=None,
    ):
        super().__init__()
        self.num_heads = num_heads
        head_dim = dim // num_heads
        if attn_head_dim is not None:
            head_dim = attn_head_dim
        all_head_dim = head_dim * self.num_heads
        self.scale = head_dim ** -0.5
        self.num_prefix_tokens = num_prefix_tokens
        # timm.layers.use_fused_attn() is False under TIMM_FUSED_ATTN=0 / scripting
        self.fused_attn = False

        if qkv_fused:
            self.qkv = nn.Linear(dim, all_head_dim * 3, bias=False)
            self.q_proj = self.k_proj = self.v_proj = None
            if qkv_bias:
                self.q_bias = nn.Parameter(torch.zeros(all_head_dim))
                self.register_buffer('k_bias', torch.zeros(all_head_dim), persistent=False)
                self.v_bias = nn.Parameter(torch.zeros(all_head_dim))
            else:
                self.q_bias = self.k_bias = self.v_bias = None
        self.attn_drop = nn.Dropout(attn_drop)
        self.norm = norm_layer(all_head_dim) if norm_layer is not None else nn.Identity()
        self.proj = nn.Linear(all_head_dim, dim)
        self.proj_drop = nn.Dropout(proj_drop)

    def forward(
            self,
            x,
            rope: Optional[torch.Tensor] = None,
            attn_mask: Optional[torch.Tensor] = None,
    ):
        B, N, C = x.shape

        qkv_bias = torch.cat((self.q_bias, self.k_bias, self.v_bias)) if self.q_bias is not None else None
        qkv = F.linear(x, weight=self.qkv.weight, bias=qkv_bias)
        qkv = qkv.reshape(B, N, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)  # B, num_heads, N, head_dim

        if self.fused_attn:
            x = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)
        else:
            q = q * self.scale
            attn = (q @ k.transpose(-2, -1))
            if FIXED:
                if attn_mask is not None:
                    attn_mask = attn_mask.to(torch.bool)
                    attn = attn.masked_fill(~attn_mask[:, None, None, :], float("-inf"))
                attn = attn.softmax(dim=-1)
            else:
                attn = attn.softmax(dim=-1)
                if attn_mask is not None:
                    attn_mask = attn_mask.to(torch.bool)
                    attn = attn.masked_fill(~attn_mask[:, None, None, :], float("-inf"))
            attn = self.attn_drop(attn)
            x = attn @ v

        x = x.transpose(1, 2).reshape(B, N, C)
        x = self.norm(x)
        x = self.proj(x)
        x = self.proj_drop(x)
        return x


def main():
    torch.manual_seed(0)
    attn = EvaAttention(dim=32, num_heads=4).eval()
    x = torch.randn(2, 9, 32)  # cls + 3x3 patches
    attn_mask = torch.ones(2, 9, dtype=torch.bool)
    attn_mask[1, 6:] = False  # the second image's last three tokens are dropped
    with torch.no_grad():
        out = attn(x, attn_mask=attn_mask)
    print("fixed" if FIXED else "buggy", "finite:", bool(torch.isfinite(out).all()),
          "row1 tok0:", [round(v, 4) for v in out[1, 0, :4].tolist()])


if __name__ == "__main__":
    main()
