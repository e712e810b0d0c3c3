"""mistral-inference Pixtral vision encoder: TransformerBlock.forward does not hand its mask to Attention.

Citation: mistralai/mistral-inference PR #218 ("[fix] Correctly pass mask in TransformerBlock.forward in
transformer_layers.py", closed without merge; a second user confirmed the bug in the thread). Source read:
src/mistral_inference/transformer_layers.py, vision_encoder.py and rope.py at the mirror's HEAD, which still has
the buggy line. `--fixed` applies the PR's one-line change.

Bug: `VisionTransformer.forward` flattens all images of a request into one sequence and builds
`BlockDiagonalMask.from_seqlens([h*w per image])` so that each image's patches attend only to their own image;
`VisionTransformerBlocks` passes it to each layer, but `TransformerBlock.forward(x, freqs_cis, cache, mask)` calls
`self.attention.forward(self.attention_norm(x), freqs_cis, cache)` without it, so `memory_efficient_attention`
runs with mask None: every patch attends to the patches of all images (the PR: "the attention would be done on
all images at the same time").

Fix: `self.attention.forward(self.attention_norm(x), freqs_cis, cache, mask=mask)`.

Stand-ins for xformers: `BlockDiagonalMask.from_seqlens` keeps the seqlens and materialises the dense
block-diagonal boolean mask; `memory_efficient_attention` is F.scaled_dot_product_attention over the same
(B=1, S, H, D) tensors. This program encodes two images of 3x4 and 2x2 patches (patch 4, hidden 32, 2 layers).
"""
import sys
from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv


class BlockDiagonalMask:
    """xformers.ops.fmha.attn_bias.BlockDiagonalMask (the part used here)."""

    def __init__(self, seqlens):
        self.seqlens = list(seqlens)

    @classmethod
    def from_seqlens(cls, q_seqlen):
        return cls(q_seqlen)

    def materialize(self):
        seq_id = torch.repeat_interleave(torch.arange(len(self.seqlens)), torch.tensor(self.seqlens))
        return seq_id[:, None] == seq_id[None, :]


def memory_efficient_attention(xq, key, val, attn_bias=None):
    """xformers memory_efficient_attention on (B, S, H, D), via SDPA."""
    mask = None if attn_bias is None else attn_bias.materialize()
    out = F.scaled_dot_product_attention(xq.transpose(1, 2), key.transpose(1, 2), val.transpose(1, 2), attn_mask=mask)
    return out.transpose(1, 2)


@dataclass
class VisionEncoderArgs:
    hidden_size: int
    num_channels: int
    image_size: int
    patch_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    rope_theta: float = 1e4


def apply_rotary_emb(xq, xk, freqs_cis) -> Tuple[torch.Tensor, torch.Tensor]:
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    freqs_cis = freqs_cis[:, None, :]
    xq_out = torch.view_as_real(xq_ * freqs_cis).flatten(-2)
    xk_out = torch.view_as_real(xk_ * freqs_cis).flatten(-2)
    return xq_out.type_as(xq), xk_out.type_as(xk)


def precompute_freqs_cis_2d(dim: int, height: int, width: int, theta: float) -> torch.Tensor:
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2).float() / dim))
    h = torch.arange(height, device=freqs.device)
    w = torch.arange(width, device=freqs.device)
    freqs_h = torch.outer(h, freqs[::2]).float()
    freqs_w = torch.outer(w, freqs[1::2]).float()
    freqs_2d = torch.cat([freqs_h[:, None, :].repeat(1, width, 1), freqs_w[None, :, :].repeat(height, 1, 1)], dim=-1)
    return torch.polar(torch.ones_like(freqs_2d), freqs_2d)


class RMSNorm(torch.nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        output = (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x)
        return output * self.weight


class Attention(nn.Module):
    def __init__(self, dim: int, n_heads: int, head_dim: int, n_kv_heads: int):
        super().__init__()
        self.n_heads, self.head_dim, self.n_kv_heads = n_heads, head_dim, n_kv_heads
        self.repeats = self.n_heads // self.n_kv_heads
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
        key, val = xk, xv
        key = torch.repeat_interleave(key, repeats=self.repeats, dim=1)
        val = torch.repeat_interleave(val, repeats=self.repeats, dim=1)
        # xformers requires (B=1, S, H, D)
        xq, key, val = xq[None, ...], key[None, ...], val[None, ...]
        output = memory_efficient_attention(xq, key, val, mask)
        output = output.reshape(seqlen_sum, self.n_heads * self.head_dim)
        return self.wo(output)


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x):
        return self.w2(nn.functional.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, dim, hidden_dim, n_heads, n_kv_heads, head_dim, norm_eps):
        super().__init__()
        self.attention = Attention(dim=dim, n_heads=n_heads, head_dim=head_dim, n_kv_heads=n_kv_heads)
        self.attention_norm = RMSNorm(dim, eps=norm_eps)
        self.ffn_norm = RMSNorm(dim, eps=norm_eps)
        self.feed_forward = FeedForward(dim=dim, hidden_dim=hidden_dim)

    def forward(self, x, freqs_cis, cache=None, mask: Optional[BlockDiagonalMask] = None):
        if FIXED:
            r = self.attention.forward(self.attention_norm(x), freqs_cis, cache, mask=mask)
        else:
            r = self.attention.forward(self.attention_norm(x), freqs_cis, cache)
        h = x + r
        r = self.feed_forward.forward(self.ffn_norm(h))
        return h + r


def position_meshgrid(patch_embeds_list: list) -> torch.Tensor:
    return torch.cat([torch.stack(torch.meshgrid(torch.arange(p.shape[-2]), torch.arange(p.shape[-1]), indexing="ij"),
                                  dim=-1).reshape(-1, 2) for p in patch_embeds_list])


class VisionTransformerBlocks(nn.Module):
    def __init__(self, args: VisionEncoderArgs):
        super().__init__()
        self.layers = torch.nn.ModuleList()
        for _ in range(args.num_hidden_layers):
            self.layers.append(TransformerBlock(dim=args.hidden_size, hidden_dim=args.intermediate_size,
                                                n_heads=args.num_attention_heads, n_kv_heads=args.num_attention_heads,
                                                head_dim=args.hidden_size // args.num_attention_heads, norm_eps=1e-5))

    def forward(self, x, mask: BlockDiagonalMask, freqs_cis):
        for layer in self.layers:
            x = layer(x, mask=mask, freqs_cis=freqs_cis)
        return x


class VisionTransformer(nn.Module):
    def __init__(self, args: VisionEncoderArgs):
        super().__init__()
        self.args = args
        self.patch_conv = nn.Conv2d(args.num_channels, args.hidden_size, kernel_size=args.patch_size,
                                    stride=args.patch_size, bias=False)
        self.ln_pre = RMSNorm(args.hidden_size, eps=1e-5)
        self.transformer = VisionTransformerBlocks(args)
        self.freqs_cis = precompute_freqs_cis_2d(dim=args.hidden_size // args.num_attention_heads,
                                                 height=args.image_size // args.patch_size,
                                                 width=args.image_size // args.patch_size, theta=args.rope_theta)

    def forward(self, images: List[torch.Tensor]) -> torch.Tensor:
        patch_embeds_list = [self.patch_conv(img.unsqueeze(0)).squeeze(0) for img in images]
        patch_embeds = torch.cat([p.flatten(1).permute(1, 0) for p in patch_embeds_list], dim=0)
        patch_embeds = self.ln_pre(patch_embeds)
        positions = position_meshgrid(patch_embeds_list)
        freqs_cis = self.freqs_cis[positions[:, 0], positions[:, 1]]
        # pass through Transformer with a block diagonal mask delimiting images
        mask = BlockDiagonalMask.from_seqlens([p.shape[-2] * p.shape[-1] for p in patch_embeds_list])
        return self.transformer(patch_embeds, mask=mask, freqs_cis=freqs_cis)


if __name__ == "__main__":
    torch.manual_seed(0)
    args = VisionEncoderArgs(hidden_size=32, num_channels=3, image_size=32, patch_size=4, intermediate_size=64,
                             num_hidden_layers=2, num_attention_heads=2)
    encoder = VisionTransformer(args).eval()
    images = [torch.randn(3, 12, 16), torch.randn(3, 8, 8)]
    with torch.no_grad():
        out = encoder(images)
    print("fixed" if FIXED else "buggy", tuple(out.shape), f"{out[12:].sum().item():.4f}")
