# mistral-inference (Pixtral vision encoder), mistralai/mistral-inference#218.
# TransformerBlock.forward drops its `mask` argument, so the BlockDiagonalMask built in
# VisionTransformer.forward never reaches Attention: patches of one image attend to every other image.
import sys
from typing import List, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class BlockDiagonalMask:
    """Stand-in for xformers.ops.fmha.attn_bias.BlockDiagonalMask (xformers is not installed here)."""

    def __init__(self, seqlens: List[int]):
        self.seqlens = list(seqlens)

    @classmethod
    def from_seqlens(cls, q_seqlen: List[int]) -> "BlockDiagonalMask":
        return cls(q_seqlen)

    def materialize(self) -> torch.Tensor:
        ids = torch.cat([torch.full((n,), i) for i, n in enumerate(self.seqlens)])
        return ids[:, None] == ids[None, :]


def memory_efficient_attention(q, k, v, attn_bias=None):
    # xformers layout (B, S, H, D); dense equivalent of the block-diagonal bias.
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    mask = attn_bias.materialize() if attn_bias is not None else None
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return out.transpose(1, 2)


def apply_rotary_emb(xq, xk, freqs_cis):
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    freqs_cis = freqs_cis[:, None, :]
    xq_out = torch.view_as_real(xq_ * freqs_cis).flatten(-2)
    xk_out = torch.view_as_real(xk_ * freqs_cis).flatten(-2)
    return xq_out.type_as(xq), xk_out.type_as(xk)


def precompute_freqs_cis_2d(dim, height, width, theta):
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2).float() / dim))
    h = torch.arange(height)
    w = torch.arange(width)
    freqs_h = torch.outer(h, freqs[::2]).float()
    freqs_w = torch.outer(w, freqs[1::2]).float()
    freqs_2d = torch.cat(
        [freqs_h[:, None, :].repeat(1, width, 1), freqs_w[None, :, :].repeat(height, 1, 1)], dim=-1
    )
    return torch.polar(torch.ones_like(freqs_2d), freqs_2d)


class Attention(nn.Module):
    def __init__(self, dim, n_heads, head_dim, n_kv_heads):
        super().__init__()
        self.n_heads, self.head_dim, self.n_kv_heads = n_heads, head_dim, n_kv_heads
        self.repeats = n_heads // n_kv_heads
        self.wq = nn.Linear(dim, n_heads * head_dim, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * head_dim, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * head_dim, bias=False)
        self.wo = nn.Linear(n_heads * head_dim, dim, bias=False)

    def forward(self, x, freqs_cis, cache=None, mask: Optional[BlockDiagonalMask] = None):
        assert mask is None or cache is None
        seqlen_sum, _ = x.shape
        xq, xk, xv = self.wq(x), self.wk(x), self.wv(x)
        xq = xq.view(seqlen_sum, self.n_heads, self.head_dim)
        xk = xk.view(seqlen_sum, self.n_kv_heads, self.head_dim)
        xv = xv.view(seqlen_sum, self.n_kv_heads, self.head_dim)
        xq, xk = apply_rotary_emb(xq, xk, freqs_cis=freqs_cis)
        key, val = xk, xv  # cache is None in the vision encoder
        key = torch.repeat_interleave(key, repeats=self.repeats, dim=1)
        val = torch.repeat_interleave(val, repeats=self.repeats, dim=1)
        xq, key, val = xq[None, ...], key[None, ...], val[None, ...]
        output = memory_efficient_attention(xq, key, val, mask if cache is None else cache.mask)
        output = output.reshape(seqlen_sum, self.n_heads * self.head_dim)
        return self.wo(output)


class FeedForward(nn.Module):
    def __init__(self, dim, hidden_dim):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        out = (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x)
        return out * self.weight


class TransformerBlock(nn.Module):
    def __init__(self, dim, hidden_dim, n_heads, n_kv_heads, head_dim, norm_eps):
        super().__init__()
        self.attention = Attention(dim, n_heads, head_dim, n_kv_heads)
        self.attention_norm = RMSNorm(dim, eps=norm_eps)
        self.ffn_norm = RMSNorm(dim, eps=norm_eps)
        self.feed_forward = FeedForward(dim, hidden_dim)

    def forward(self, x, freqs_cis, cache=None, mask: Optional[BlockDiagonalMask] = None):
        if FIXED:
            r = self.attention.forward(self.attention_norm(x), freqs_cis, cache, mask)
        else:
            r = self.attention.forward(self.attention_norm(x), freqs_cis, cache)
        h = x + r
        r = self.feed_forward.forward(self.ffn_norm(h))
        return h + r


class VisionTransformerBlocks(nn.Module):
    def __init__(self, hidden_size, intermediate_size, num_heads, num_layers):
        super().__init__()
        self.layers = nn.ModuleList(
            TransformerBlock(hidden_size, intermediate_size, num_heads, num_heads, hidden_size // num_heads, 1e-5)
            for _ in range(num_layers)
        )

    def forward(self, x, mask, freqs_cis):
        for layer in self.layers:
            x = layer(x, mask=mask, freqs_cis=freqs_cis)
        return x


def position_meshgrid(patch_embeds_list):
    return torch.cat(
        [
            torch.stack(
                torch.meshgrid(torch.arange(p.shape[-2]), torch.arange(p.shape[-1]), indexing="ij"), dim=-1
            ).reshape(-1, 2)
            for p in patch_embeds_list
        ]
    )


class VisionTransformer(nn.Module):
    def __init__(self, hidden_size=32, num_heads=4, num_layers=2, patch_size=4, image_size=16):
        super().__init__()
        self.patch_conv = nn.Conv2d(3, hidden_size, kernel_size=patch_size, stride=patch_size, bias=False)
        self.ln_pre = RMSNorm(hidden_size, eps=1e-5)
        self.transformer = VisionTransformerBlocks(hidden_size, 2 * hidden_size, num_heads, num_layers)
        mp = image_size // patch_size
        self.freqs_cis = precompute_freqs_cis_2d(hidden_size // num_heads, mp, mp, 10000.0)

    def forward(self, images: List[torch.Tensor]) -> torch.Tensor:
        patch_embeds_list = [self.patch_conv(img.unsqueeze(0)).squeeze(0) for img in images]
        patch_embeds = torch.cat([p.flatten(1).permute(1, 0) for p in patch_embeds_list], dim=0)
        patch_embeds = self.ln_pre(patch_embeds)
        positions = position_meshgrid(patch_embeds_list)
        freqs_cis = self.freqs_cis[positions[:, 0], positions[:, 1]]
        mask = BlockDiagonalMask.from_seqlens([p.shape[-2] * p.shape[-1] for p in patch_embeds_list])
        return self.transformer(patch_embeds, mask=mask, freqs_cis=freqs_cis)


enc = VisionTransformer().eval()
images = [torch.randn(3, 16, 12), torch.randn(3, 8, 16), torch.randn(3, 12, 12)]
with torch.no_grad():
    together = enc(images)
    alone = torch.cat([enc([img]) for img in images], dim=0)
print(f"max |encode(all images) - encode(each image alone)| = {(together - alone).abs().max().item():.6f}")
