"""mistral-inference: TransformerBlock.forward drops the block-diagonal image mask.

Citation: mistralai/mistral-inference PR #218 "[fix] Correctly pass mask in
TransformerBlock.forward in transformer_layers.py" (closed; description read: "The
attention mask was not passed correctly to the `Attention` in `TransformerBlock.forward`
... when passing two images in the image encoder, the attention would be done on all
images at the same time"; confirmed by baldassarreFe: "I observed the same bug, this
PR fixes the bug"; the fix "itself is straightforward (adding `mask=mask`)").

Bug: the Pixtral `VisionTransformer` builds `BlockDiagonalMask.from_seqlens` over the
patches of each image (all images are concatenated into one flat token sequence) and
hands it to every `TransformerBlock(x, freqs_cis, mask=mask)`, but the block called
`self.attention.forward(self.attention_norm(x), freqs_cis, cache)` without it, so
`Attention` ran `memory_efficient_attention(xq, key, val, None)`: every patch attended
to the patches of every other image in the batch.
Fix: `self.attention.forward(self.attention_norm(x), freqs_cis, cache, mask=mask)`.

Reproduction: the flat (seqlen_sum, dim) layout, `Attention` / `TransformerBlock` /
`Transformer` as mistral-inference wrote them, two images of 2x3 and 2x2 patches.
Stand-ins: xformers' `BlockDiagonalMask` is a small class with the same
`from_seqlens` / `materialize` API, and `memory_efficient_attention` is a torch
reference over F.scaled_dot_product_attention; rotary embeddings are left out
(freqs_cis is passed through unused). The module code was written from the PR text and
the upstream layout as known, not re-read line by line.
"""
import sys
from typing import List, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


class BlockDiagonalMask:
    """Stand-in for xformers.ops.fmha.attn_bias.BlockDiagonalMask."""

    def __init__(self, seqlens: List[int]):
        self.seqlens = list(seqlens)

    @classmethod
    def from_seqlens(cls, q_seqlen: List[int]) -> "BlockDiagonalMask":
        return cls(q_seqlen)

    def materialize(self, shape, dtype=torch.float32):
        n = sum(self.seqlens)
        bias = torch.full((n, n), float("-inf"), dtype=dtype)
        start = 0
        for s in self.seqlens:
            bias[start:start + s, start:start + s] = 0
            start += s
        return bias.expand(shape)


def memory_efficient_attention(xq, key, val, attn_bias=None):
    """Torch reference of xformers' kernel, (1, S, H, D) layout."""
    q, k, v = (t.transpose(1, 2) for t in (xq, key, val))
    bias = None
    if attn_bias is not None:
        bias = attn_bias.materialize((q.shape[-2], k.shape[-2]), dtype=q.dtype)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
    return out.transpose(1, 2)


class Attention(nn.Module):
    def __init__(self, dim: int, n_heads: int, head_dim: int, n_kv_heads: int):
        super().__init__()
        self.n_heads = n_heads
        self.head_dim = head_dim
        self.n_kv_heads = n_kv_heads
        self.repeats = n_heads // n_kv_heads
        self.scale = head_dim ** -0.5
        self.wq = nn.Linear(dim, n_heads * head_dim, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * head_dim, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * head_dim, bias=False)
        self.wo = nn.Linear(n_heads * head_dim, dim, bias=False)

    def forward(self, x, freqs_cis, cache=None, mask: Optional[BlockDiagonalMask] = None):
        seqlen_sum, _ = x.shape
        xq, xk, xv = self.wq(x), self.wk(x), self.wv(x)
        xq = xq.view(seqlen_sum, self.n_heads, self.head_dim)
        xk = xk.view(seqlen_sum, self.n_kv_heads, self.head_dim)
        xv = xv.view(seqlen_sum, self.n_kv_heads, self.head_dim)
        key, val = xk, xv
        key = torch.repeat_interleave(key, repeats=self.repeats, dim=1)
        val = torch.repeat_interleave(val, repeats=self.repeats, dim=1)
        xq, key, val = xq[None, ...], key[None, ...], val[None, ...]
        output = memory_efficient_attention(xq, key, val, mask if cache is None else cache.mask)
        output = output.view(seqlen_sum, self.n_heads * self.head_dim)
        return self.wo(output)


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, dim, hidden_dim, n_heads, n_kv_heads, head_dim, norm_eps):
        super().__init__()
        self.attention = Attention(dim=dim, n_heads=n_heads, head_dim=head_dim, n_kv_heads=n_kv_heads)
        self.attention_norm = nn.RMSNorm(dim, eps=norm_eps)
        self.ffn_norm = nn.RMSNorm(dim, eps=norm_eps)
        self.feed_forward = FeedForward(dim=dim, hidden_dim=hidden_dim)

    def forward(self, x, freqs_cis, cache=None, mask: Optional[BlockDiagonalMask] = None):
        if FIXED:
            r = self.attention.forward(self.attention_norm(x), freqs_cis, cache, mask=mask)
        else:
            r = self.attention.forward(self.attention_norm(x), freqs_cis, cache)
        h = x + r
        r = self.feed_forward.forward(self.ffn_norm(h))
        return h + r


class Transformer(nn.Module):
    def __init__(self, n_layers, **kw):
        super().__init__()
        self.layers = nn.ModuleList([TransformerBlock(**kw) for _ in range(n_layers)])

    def forward(self, x, mask, freqs_cis=None):
        for layer in self.layers:
            x = layer(x, mask=mask, freqs_cis=freqs_cis)
        return x


class VisionTransformer(nn.Module):
    def __init__(self, num_channels=3, patch_size=4, hidden_size=32, num_hidden_layers=2,
                 num_attention_heads=4, intermediate_size=64):
        super().__init__()
        self.patch_conv = nn.Conv2d(num_channels, hidden_size, kernel_size=patch_size,
                                    stride=patch_size, bias=False)
        self.ln_pre = nn.RMSNorm(hidden_size, eps=1e-5)
        self.transformer = Transformer(
            num_hidden_layers, dim=hidden_size, hidden_dim=intermediate_size,
            n_heads=num_attention_heads, n_kv_heads=num_attention_heads,
            head_dim=hidden_size // num_attention_heads, norm_eps=1e-5)

    def forward(self, images: List[torch.Tensor]) -> torch.Tensor:
        patch_embeds_list = [self.patch_conv(img.unsqueeze(0)).squeeze(0) for img in images]
        patch_embeds = torch.cat([p.flatten(1).permute(1, 0) for p in patch_embeds_list], dim=0)
        patch_embeds = self.ln_pre(patch_embeds)
        # pass through Transformer with a block diagonal mask delimiting images
        mask = BlockDiagonalMask.from_seqlens([p.shape[-2] * p.shape[-1] for p in patch_embeds_list])
        return self.transformer(patch_embeds, mask=mask, freqs_cis=None)


def main():
    torch.manual_seed(0)
    model = VisionTransformer().eval()
    images = [torch.randn(3, 8, 12), torch.randn(3, 8, 8)]  # 2x3 and 2x2 patches
    with torch.no_grad():
        batched = model(images)
        alone = model(images[1:])
    # with the mask, image 1 encoded in the batch equals image 1 encoded alone
    diff = (batched[6:] - alone).abs().max().item()
    print("fixed" if FIXED else "buggy", "image-1 batch vs alone max diff:", f"{diff:.2e}")


if __name__ == "__main__":
    main()
