"""DINOv2 multi-crop forward: global and local crops of different token counts are
packed into ONE row and attended with an xFormers BlockDiagonalMask.

Port of facebookresearch/dinov2 @05c66df0cfa837710197d4769158c87e36afad2c:
dinov2/layers/block.py (NestedTensorBlock.forward_nested, get_attn_bias_and_cat with
attn_bias_cache, BlockDiagonalMask.from_seqlens, attn_bias.split),
dinov2/layers/attention.py (MemEffAttention, Attention) and
dinov2/models/vision_transformer.py (prepare_tokens_with_masks with iBOT mask_token,
interpolate_pos_encoding, forward_features_list), shrunk to tiny sizes.

xformers is not used: BlockDiagonalMask, memory_efficient_attention and unbind are
plain-torch stand-ins with the same semantics (q/k/v as [B, M, H, K], additive bias
with -inf outside each sequence's own diagonal block, split back per input tensor).

Reference: every crop run on its own through the plain (non-xformers) Attention path.
"""
import math
from functools import partial
from typing import Any, Dict, List, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor
from torch.nn.init import trunc_normal_


# ----------------------------------------------------------------- xformers stand-ins
class BlockDiagonalMask:
    """Stand-in for xformers.ops.fmha.BlockDiagonalMask (no causal part)."""

    def __init__(self, seqlens: List[int]):
        self.seqlens = list(seqlens)
        starts = [0]
        for s in self.seqlens:
            starts.append(starts[-1] + s)
        self.seqstart = starts
        self._batch_sizes = None

    @classmethod
    def from_seqlens(cls, seqlens):
        return cls(seqlens)

    def materialize(self, shape, dtype=torch.float32, device="cpu"):
        total = self.seqstart[-1]
        assert shape[-1] == total and shape[-2] == total
        bias = torch.full((total, total), float("-inf"), dtype=dtype, device=device)
        for a, b in zip(self.seqstart[:-1], self.seqstart[1:]):
            bias[a:b, a:b] = 0
        return bias.expand(shape)

    def split(self, tensor: Tensor) -> List[Tensor]:
        """[1, sum(seqlens), ...] -> one [batch_size_i, seqlen_i, ...] tensor per input."""
        assert tensor.shape[0] == 1
        batch_sizes = self._batch_sizes if self._batch_sizes is not None else [1] * len(self.seqlens)
        out, start, idx = [], 0, 0
        for bsz in batch_sizes:
            seqlen = self.seqlens[idx]
            assert all(s == seqlen for s in self.seqlens[idx:idx + bsz])
            n = bsz * seqlen
            out.append(tensor[:, start:start + n].reshape(bsz, seqlen, *tensor.shape[2:]))
            start += n
            idx += bsz
        return out


def unbind(x, dim):
    return torch.unbind(x, dim)


def memory_efficient_attention(q, k, v, attn_bias=None):
    """q, k, v: [B, M, H, K] -> [B, M, H, K]; scale 1/sqrt(K)."""
    scale = q.shape[-1] ** -0.5
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, H, M, K]
    attn = (q * scale) @ k.transpose(-2, -1)
    if attn_bias is not None:
        if isinstance(attn_bias, BlockDiagonalMask):
            attn = attn + attn_bias.materialize(attn.shape, dtype=attn.dtype, device=attn.device)
        else:
            attn = attn + attn_bias
    attn = attn.softmax(-1)
    return (attn @ v).transpose(1, 2)


XFORMERS_AVAILABLE = True


def index_select_cat(sources, indices):
    return torch.cat([s[i].flatten() for s, i in zip(sources, indices)])


# ----------------------------------------------------------------------------- layers
class Mlp(nn.Module):
    def __init__(self, in_features, hidden_features=None, out_features=None, act_layer=nn.GELU, drop=0.0, bias=True):
        super().__init__()
        out_features = out_features or in_features
        hidden_features = hidden_features or in_features
        self.fc1 = nn.Linear(in_features, hidden_features, bias=bias)
        self.act = act_layer()
        self.fc2 = nn.Linear(hidden_features, out_features, bias=bias)
        self.drop = nn.Dropout(drop)

    def forward(self, x):
        return self.drop(self.fc2(self.drop(self.act(self.fc1(x)))))


class LayerScale(nn.Module):
    def __init__(self, dim, init_values=1e-5, inplace=False):
        super().__init__()
        self.inplace = inplace
        self.gamma = nn.Parameter(init_values * torch.ones(dim))

    def forward(self, x):
        return x.mul_(self.gamma) if self.inplace else x * self.gamma


class PatchEmbed(nn.Module):
    def __init__(self, img_size=224, patch_size=16, in_chans=3, embed_dim=768):
        super().__init__()
        self.img_size = (img_size, img_size)
        self.patch_size = (patch_size, patch_size)
        self.num_patches = (img_size // patch_size) ** 2
        self.proj = nn.Conv2d(in_chans, embed_dim, kernel_size=patch_size, stride=patch_size)

    def forward(self, x):
        x = self.proj(x)  # B C H W
        return x.flatten(2).transpose(1, 2)


class Attention(nn.Module):
    def __init__(self, dim, num_heads=8, qkv_bias=False, proj_bias=True, attn_drop=0.0, proj_drop=0.0):
        super().__init__()
        self.num_heads = num_heads
        head_dim = dim // num_heads
        self.scale = head_dim ** -0.5
        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias)
        self.attn_drop = nn.Dropout(attn_drop)
        self.proj = nn.Linear(dim, dim, bias=proj_bias)
        self.proj_drop = nn.Dropout(proj_drop)

    def forward(self, x: Tensor) -> Tensor:
        B, N, C = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, C // self.num_heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0] * self.scale, qkv[1], qkv[2]
        attn = q @ k.transpose(-2, -1)
        attn = attn.softmax(dim=-1)
        attn = self.attn_drop(attn)
        x = (attn @ v).transpose(1, 2).reshape(B, N, C)
        return self.proj_drop(self.proj(x))


class MemEffAttention(Attention):
    def forward(self, x: Tensor, attn_bias=None) -> Tensor:
        if not XFORMERS_AVAILABLE:
            if attn_bias is not None:
                raise AssertionError("xFormers is required for using nested tensors")
            return super().forward(x)
        B, N, C = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, C // self.num_heads)
        q, k, v = unbind(qkv, 2)
        x = memory_efficient_attention(q, k, v, attn_bias=attn_bias)
        x = x.reshape([B, N, C])
        return self.proj_drop(self.proj(x))


class Block(nn.Module):
    def __init__(self, dim, num_heads, mlp_ratio=4.0, qkv_bias=False, proj_bias=True, ffn_bias=True, drop=0.0,
                 attn_drop=0.0, init_values=None, drop_path=0.0, act_layer=nn.GELU, norm_layer=nn.LayerNorm,
                 attn_class=Attention, ffn_layer=Mlp):
        super().__init__()
        self.norm1 = norm_layer(dim)
        self.attn = attn_class(dim, num_heads=num_heads, qkv_bias=qkv_bias, proj_bias=proj_bias,
                               attn_drop=attn_drop, proj_drop=drop)
        self.ls1 = LayerScale(dim, init_values=init_values) if init_values else nn.Identity()
        self.norm2 = norm_layer(dim)
        self.mlp = ffn_layer(in_features=dim, hidden_features=int(dim * mlp_ratio), act_layer=act_layer,
                             drop=drop, bias=ffn_bias)
        self.ls2 = LayerScale(dim, init_values=init_values) if init_values else nn.Identity()
        self.sample_drop_ratio = drop_path

    def forward(self, x: Tensor) -> Tensor:
        def attn_residual_func(x):
            return self.ls1(self.attn(self.norm1(x)))

        def ffn_residual_func(x):
            return self.ls2(self.mlp(self.norm2(x)))

        x = x + attn_residual_func(x)
        x = x + ffn_residual_func(x)
        return x


attn_bias_cache: Dict[Tuple, Any] = {}


def get_attn_bias_and_cat(x_list, branges=None):
    """perform the index select, cat the tensors, and provide the attn_bias from cache"""
    batch_sizes = [b.shape[0] for b in branges] if branges is not None else [x.shape[0] for x in x_list]
    all_shapes = tuple((b, x.shape[1]) for b, x in zip(batch_sizes, x_list))
    if all_shapes not in attn_bias_cache.keys():
        seqlens = []
        for b, x in zip(batch_sizes, x_list):
            for _ in range(b):
                seqlens.append(x.shape[1])
        attn_bias = BlockDiagonalMask.from_seqlens(seqlens)
        attn_bias._batch_sizes = batch_sizes
        attn_bias_cache[all_shapes] = attn_bias

    if branges is not None:
        cat_tensors = index_select_cat([x.flatten(1) for x in x_list], branges).view(1, -1, x_list[0].shape[-1])
    else:
        tensors_bs1 = tuple(x.reshape([1, -1, *x.shape[2:]]) for x in x_list)
        cat_tensors = torch.cat(tensors_bs1, dim=1)
    return attn_bias_cache[all_shapes], cat_tensors


class NestedTensorBlock(Block):
    def forward_nested(self, x_list: List[Tensor]) -> List[Tensor]:
        assert isinstance(self.attn, MemEffAttention)

        def attn_residual_func(x, attn_bias=None):
            return self.ls1(self.attn(self.norm1(x), attn_bias=attn_bias))

        def ffn_residual_func(x, attn_bias=None):
            return self.ls2(self.mlp(self.norm2(x)))

        attn_bias, x = get_attn_bias_and_cat(x_list)
        x = x + attn_residual_func(x, attn_bias=attn_bias)
        x = x + ffn_residual_func(x)
        return attn_bias.split(x)

    def forward(self, x_or_x_list):
        if isinstance(x_or_x_list, Tensor):
            return super().forward(x_or_x_list)
        elif isinstance(x_or_x_list, list):
            if not XFORMERS_AVAILABLE:
                raise AssertionError("xFormers is required for using nested tensors")
            return self.forward_nested(x_or_x_list)
        raise AssertionError


class DinoVisionTransformer(nn.Module):
    def __init__(self, img_size=32, patch_size=8, in_chans=3, embed_dim=32, depth=2, num_heads=4, mlp_ratio=4.0,
                 qkv_bias=True, ffn_bias=True, proj_bias=True, init_values=None, block_fn=NestedTensorBlock):
        super().__init__()
        norm_layer = partial(nn.LayerNorm, eps=1e-6)
        self.num_features = self.embed_dim = embed_dim
        self.num_tokens = 1
        self.patch_size = patch_size
        self.patch_embed = PatchEmbed(img_size=img_size, patch_size=patch_size, in_chans=in_chans, embed_dim=embed_dim)
        num_patches = self.patch_embed.num_patches
        self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dim))
        self.pos_embed = nn.Parameter(torch.zeros(1, num_patches + self.num_tokens, embed_dim))
        self.blocks = nn.ModuleList([
            block_fn(dim=embed_dim, num_heads=num_heads, mlp_ratio=mlp_ratio, qkv_bias=qkv_bias, proj_bias=proj_bias,
                     ffn_bias=ffn_bias, norm_layer=norm_layer, init_values=init_values)
            for _ in range(depth)
        ])
        self.norm = norm_layer(embed_dim)
        self.mask_token = nn.Parameter(torch.zeros(1, embed_dim))
        trunc_normal_(self.pos_embed, std=0.02)
        nn.init.normal_(self.cls_token, std=1e-6)
        nn.init.normal_(self.mask_token, std=0.5)

    def interpolate_pos_encoding(self, x, w, h):
        previous_dtype = x.dtype
        npatch = x.shape[1] - 1
        N = self.pos_embed.shape[1] - 1
        if npatch == N and w == h:
            return self.pos_embed
        pos_embed = self.pos_embed.float()
        class_pos_embed = pos_embed[:, 0]
        patch_pos_embed = pos_embed[:, 1:]
        dim = x.shape[-1]
        w0 = w // self.patch_size
        h0 = h // self.patch_size
        w0, h0 = w0 + 0.1, h0 + 0.1
        patch_pos_embed = nn.functional.interpolate(
            patch_pos_embed.reshape(1, int(math.sqrt(N)), int(math.sqrt(N)), dim).permute(0, 3, 1, 2),
            scale_factor=(w0 / math.sqrt(N), h0 / math.sqrt(N)),
            mode="bicubic",
        )
        assert int(w0) == patch_pos_embed.shape[-2] and int(h0) == patch_pos_embed.shape[-1]
        patch_pos_embed = patch_pos_embed.permute(0, 2, 3, 1).view(1, -1, dim)
        return torch.cat((class_pos_embed.unsqueeze(0), patch_pos_embed), dim=1).to(previous_dtype)

    def prepare_tokens_with_masks(self, x, masks=None):
        B, nc, w, h = x.shape
        x = self.patch_embed(x)
        if masks is not None:
            x = torch.where(masks.unsqueeze(-1), self.mask_token.to(x.dtype).unsqueeze(0), x)
        x = torch.cat((self.cls_token.expand(x.shape[0], -1, -1), x), dim=1)
        x = x + self.interpolate_pos_encoding(x, w, h)
        return x

    def forward_features_list(self, x_list, masks_list):
        x = [self.prepare_tokens_with_masks(x, masks) for x, masks in zip(x_list, masks_list)]
        for blk in self.blocks:
            x = blk(x)
        output = []
        for x, masks in zip(x, masks_list):
            x_norm = self.norm(x)
            output.append({"x_norm_clstoken": x_norm[:, 0], "x_norm_patchtokens": x_norm[:, 1:],
                           "x_prenorm": x, "masks": masks})
        return output

    def forward_features(self, x, masks=None):
        if isinstance(x, list):
            return self.forward_features_list(x, masks)
        x = self.prepare_tokens_with_masks(x, masks)
        for blk in self.blocks:
            x = blk(x)
        x_norm = self.norm(x)
        return {"x_norm_clstoken": x_norm[:, 0], "x_norm_patchtokens": x_norm[:, 1:], "x_prenorm": x, "masks": masks}


def reference_single(model, img, mask):
    """One crop at a time, plain Attention.forward (no bias, no packing)."""
    x = model.prepare_tokens_with_masks(img, mask)
    for blk in model.blocks:
        x = x + blk.ls1(Attention.forward(blk.attn, blk.norm1(x)))
        x = x + blk.ls2(blk.mlp(blk.norm2(x)))
    return model.norm(x)


def main():
    torch.manual_seed(0)
    model = DinoVisionTransformer(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=4,
                                  init_values=0.5,
                                  block_fn=partial(NestedTensorBlock, attn_class=MemEffAttention))
    model.eval()

    # ssl_meta_arch: student.backbone([global_crops, local_crops], masks=[masks, None], is_training=True)
    n_global, n_local = 2, 3
    global_crops = torch.randn(n_global, 3, 32, 32)   # 16 patches + cls = 17 tokens
    local_crops = torch.randn(n_local, 3, 16, 16)     # 4 patches + cls = 5 tokens
    g = torch.Generator().manual_seed(1)
    masks = torch.rand(n_global, 16, generator=g) < 0.4  # iBOT masked patches -> mask_token
    masks[0, 0] = True

    ok = True
    with torch.no_grad():
        outs = model.forward_features([global_crops, local_crops], [masks, None])
        # packed bias: 2 x 17 + 3 x 5 tokens in one row, block diagonal
        bias = attn_bias_cache[((n_global, 17), (n_local, 5))]
        assert bias.seqlens == [17, 17, 5, 5, 5]
        # a second call hits attn_bias_cache with the same shapes
        outs2 = model.forward_features([global_crops, local_crops], [masks, None])
        ok &= torch.equal(outs[0]["x_prenorm"], outs2[0]["x_prenorm"])

        for crops, m, out in ((global_crops, masks, outs[0]), (local_crops, None, outs[1])):
            for i in range(crops.shape[0]):
                ref = reference_single(model, crops[i:i + 1], None if m is None else m[i:i + 1])
                ok &= torch.allclose(out["x_norm_clstoken"][i], ref[0, 0], atol=1e-5)
                ok &= torch.allclose(out["x_norm_patchtokens"][i], ref[0, 1:], atol=1e-5)
                # and the single-tensor (non-nested) path agrees too
                single = model.forward_features(crops[i:i + 1], None if m is None else m[i:i + 1])
                ok &= torch.allclose(single["x_norm_clstoken"][0], ref[0, 0], atol=1e-5)

    print("nested multi-crop output matches per-crop reference:", ok)
    print("MATCH" if ok else "MISMATCH")
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
