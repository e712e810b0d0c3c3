# timm (huggingface/pytorch-image-models PR #2686, commit 61a26c7): the non-fused path of timm.layers.Attention did
# `attn = maybe_add_mask(attn, attn_mask)` with the caller's boolean keep-mask, adding True/False as +1/0 to the logits,
# while the fused SDPA path reads the same bool as keep/drop; padded patches stay attended when fused_attn is off.
import sys
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


def maybe_add_mask(scores: torch.Tensor, attn_mask: Optional[torch.Tensor] = None):
    return scores if attn_mask is None else scores + attn_mask


def resolve_self_attn_mask(seq_len: int, attn: torch.Tensor, attn_mask: Optional[torch.Tensor] = None,
                           is_causal: bool = False) -> Optional[torch.Tensor]:
    # Build additive bias matching SDPA semantics for self-attention
    if is_causal:
        attn_bias = attn.new_full((seq_len, seq_len), float('-inf')).triu_(1)
    elif attn_mask is None:
        attn_bias = None
    elif attn_mask.dtype == torch.bool:
        attn_bias = torch.zeros_like(attn_mask, dtype=attn.dtype)
        attn_bias.masked_fill_(~attn_mask, float('-inf'))
    else:
        attn_bias = attn_mask
    return attn_bias


class Attention(nn.Module):
    def __init__(self, dim, num_heads=8, qkv_bias=False, fused_attn=True):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.attn_dim = num_heads * self.head_dim
        self.scale = self.head_dim ** -0.5
        self.fused_attn = fused_attn  # timm: use_fused_attn(), off with TIMM_FUSED_ATTN=0 / set_fused_attn(False)
        self.qkv = nn.Linear(dim, self.attn_dim * 3, bias=qkv_bias)
        self.q_norm = nn.Identity()
        self.k_norm = nn.Identity()
        self.attn_drop = nn.Dropout(0.)
        self.norm = nn.Identity()
        self.proj = nn.Linear(self.attn_dim, dim)
        self.proj_drop = nn.Dropout(0.)

    def forward(self, x: torch.Tensor, attn_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        B, N, C = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        q, k = self.q_norm(q), self.k_norm(k)

        if self.fused_attn:
            x = F.scaled_dot_product_attention(
                q, k, v,
                attn_mask=attn_mask,
                dropout_p=self.attn_drop.p if self.training else 0.,
            )
        else:
            q = q * self.scale
            attn = q @ k.transpose(-2, -1)
            if FIXED:
                attn_bias = resolve_self_attn_mask(N, attn, attn_mask)
                attn = maybe_add_mask(attn, attn_bias)
            else:
                attn = maybe_add_mask(attn, attn_mask)
            attn = attn.softmax(dim=-1)
            attn = self.attn_drop(attn)
            x = attn @ v

        x = x.transpose(1, 2).reshape(B, N, self.attn_dim)
        x = self.norm(x)
        x = self.proj(x)
        x = self.proj_drop(x)
        return x


class Mlp(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class Block(nn.Module):
    def __init__(self, dim, num_heads, mlp_ratio=4., fused_attn=True):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = Attention(dim, num_heads=num_heads, qkv_bias=True, fused_attn=fused_attn)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = Mlp(dim, int(dim * mlp_ratio))

    def forward(self, x: torch.Tensor, attn_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), attn_mask=attn_mask)
        x = x + self.mlp(self.norm2(x))
        return x


class VisionTransformer(nn.Module):
    """vit_*_reg4 style: class token + 4 register tokens, no_embed_class=True (pos embed on patches only)."""

    def __init__(self, img_size=16, patch_size=4, in_chans=3, embed_dim=32, depth=2, num_heads=4, reg_tokens=4,
                 fused_attn=True):
        super().__init__()
        self.patch_size = patch_size
        self.proj = nn.Conv2d(in_chans, embed_dim, kernel_size=patch_size, stride=patch_size)
        num_patches = (img_size // patch_size) ** 2
        self.cls_token = nn.Parameter(torch.randn(1, 1, embed_dim) * .02)
        self.reg_token = nn.Parameter(torch.randn(1, reg_tokens, embed_dim) * .02)
        self.num_prefix_tokens = 1 + reg_tokens
        self.pos_embed = nn.Parameter(torch.randn(1, num_patches, embed_dim) * .02)
        self.blocks = nn.Sequential(*[Block(embed_dim, num_heads, fused_attn=fused_attn) for _ in range(depth)])
        self.norm = nn.LayerNorm(embed_dim, eps=1e-6)

    def patch_embed(self, x):
        return self.proj(x).flatten(2).transpose(1, 2)

    def _pos_embed(self, x: torch.Tensor) -> torch.Tensor:
        to_cat = [self.cls_token.expand(x.shape[0], -1, -1), self.reg_token.expand(x.shape[0], -1, -1)]
        # no_embed_class: position embedding does not overlap with class / reg tokens, add then concat
        x = x + self.pos_embed
        return torch.cat(to_cat + [x], dim=1)

    def forward_features(self, x: torch.Tensor, attn_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        x = self.patch_embed(x)
        x = self._pos_embed(x)
        if attn_mask is not None:
            # If mask provided, we need to apply blocks one by one
            for blk in self.blocks:
                x = blk(x, attn_mask=attn_mask)
        else:
            x = self.blocks(x)
        x = self.norm(x)
        return x


# two 16x16 images; image 1 is a 16x8 image right-padded with zeros to 16x16 (its right half-columns of patches)
images = torch.randn(2, 3, 16, 16)
images[1, :, :, 8:] = 0.
grid = 4
patch_valid = torch.ones(2, grid, grid, dtype=torch.bool)
patch_valid[1, :, 2:] = False
patch_valid = patch_valid.flatten(1)
# keep-mask over [cls, reg x4, patches] (prefix tokens always valid), broadcast over heads and queries
key_valid = torch.cat([torch.ones(2, 5, dtype=torch.bool), patch_valid], dim=1)
attn_mask = key_valid[:, None, None, :]

unfused = VisionTransformer(fused_attn=False).eval()
fused = VisionTransformer(fused_attn=True).eval()
fused.load_state_dict(unfused.state_dict())

with torch.no_grad():
    out_unfused = unfused.forward_features(images, attn_mask=attn_mask)
    out_fused = fused.forward_features(images, attn_mask=attn_mask)
    images2 = images.clone()
    images2[1, :, :, 8:] = torch.randn(3, 16, 8) * 3  # different content in the padded region
    out_unfused2 = unfused.forward_features(images2, attn_mask=attn_mask)

# compare the prefix (cls + registers) and valid patch tokens of the padded image
valid_rows = key_valid[1]
print("max |unfused - fused SDPA| on valid tokens:",
      (out_unfused[1, valid_rows] - out_fused[1, valid_rows]).abs().max().item())
print("max |change of valid tokens when padded pixels change| (unfused):",
      (out_unfused[1, valid_rows] - out_unfused2[1, valid_rows]).abs().max().item())
