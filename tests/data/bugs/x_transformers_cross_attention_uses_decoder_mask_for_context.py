"""x-transformers 1.16.x: cross-attention fell back to the decoder's own `mask` as the context mask.

Citation: lucidrains/x-transformers commit b0715f2ef394a1b107b98755fd1d964a2755def9 ("fix a small
issue around masking and cross attention, thanks to @pradeep-pyro").  Read: the diff and
x_transformers/x_transformers.py + attend.py at its parent (the report by @pradeep-pyro that the
commit credits was not located).

Bug: `AttentionLayers.forward` calls every cross-attention block as
`block(x, context=context, mask=mask, context_mask=context_mask, ...)`, and `Attention.forward`
picked the key mask with `input_mask = default(context_mask, mask)`: when the caller gives a
decoder `mask` but no `context_mask` (an unpadded context), the decoder's padding mask — which
describes *query* positions — is applied to the *context keys*, hiding context tokens that happen
to share an index with decoder padding.
Fix (b0715f2): `input_mask = context_mask if has_context else mask`.

Reproduction: a decoder `AttentionLayers` with layers ('a', 'c', 'f') written after that version
(non-flash `Attend`: `dots.masked_fill(mask, -max)` with True = mask out, causal triangle for
self-attention), batch 2 of 6 target tokens (second one right-padded by 2) attending to a 6-token
unpadded context.  einops `rearrange` is written as view/transpose (einops not installed here).
"""
import sys

import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv


def exists(val):
    return val is not None


def default(val, d):
    return val if exists(val) else d


class Attend(nn.Module):
    def __init__(self, *, causal=False, scale=None):
        super().__init__()
        self.causal = causal
        self.scale = scale
        self.attn_fn = F.softmax

    def forward(self, q, k, v, mask=None):
        scale = default(self.scale, q.shape[-1] ** -0.5)
        dots = torch.einsum('b h i d, b h j d -> b h i j', q, k) * scale
        mask_value = -torch.finfo(dots.dtype).max
        if exists(mask):
            dots = dots.masked_fill(mask, mask_value)
        if self.causal:
            i, j = dots.shape[-2:]
            causal_mask = torch.ones((i, j), dtype=torch.bool, device=dots.device).triu(j - i + 1)
            dots = dots.masked_fill(causal_mask, mask_value)
        attn = self.attn_fn(dots, dim=-1)
        return torch.einsum('b h i j, b h j d -> b h i d', attn, v)


class Attention(nn.Module):
    def __init__(self, dim, dim_head=8, heads=2, causal=False):
        super().__init__()
        self.heads = heads
        inner = dim_head * heads
        self.to_q = nn.Linear(dim, inner, bias=False)
        self.to_k = nn.Linear(dim, inner, bias=False)
        self.to_v = nn.Linear(dim, inner, bias=False)
        self.attend = Attend(causal=causal)
        self.to_out = nn.Linear(inner, dim, bias=False)

    def forward(self, x, context=None, mask=None, context_mask=None):
        b, n, _, h, has_context = *x.shape, self.heads, exists(context)
        kv_input = default(context, x)
        q, k, v = self.to_q(x), self.to_k(kv_input), self.to_v(kv_input)
        q, k, v = map(lambda t: t.view(b, t.shape[1], h, -1).transpose(1, 2), (q, k, v))  # 'b n (h d) -> b h n d'

        if FIXED:
            input_mask = context_mask if has_context else mask
        else:
            input_mask = default(context_mask, mask)

        final_attn_mask = None
        if exists(input_mask):
            final_attn_mask = ~input_mask[:, None, None, :]  # 'b j -> b 1 1 j', True = mask out

        out = self.attend(q, k, v, mask=final_attn_mask)
        out = out.transpose(1, 2).reshape(b, n, -1)  # 'b h n d -> b n (h d)'
        return self.to_out(out)


class FeedForward(nn.Module):
    def __init__(self, dim, mult=2):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(dim, dim * mult), nn.GELU(), nn.Linear(dim * mult, dim))

    def forward(self, x):
        return self.net(x)


class AttentionLayers(nn.Module):
    """Decoder(dim, depth=1, cross_attend=True): layer types ('a', 'c', 'f')."""

    def __init__(self, dim, causal=True, cross_attend=True):
        super().__init__()
        self.layer_types = ('a', 'c', 'f') if cross_attend else ('a', 'f')
        self.layers = nn.ModuleList()
        for layer_type in self.layer_types:
            if layer_type == 'a':
                layer = Attention(dim, causal=causal)
            elif layer_type == 'c':
                layer = Attention(dim)
            else:
                layer = FeedForward(dim)
            self.layers.append(nn.ModuleList([nn.LayerNorm(dim), layer]))

    def forward(self, x, context=None, mask=None, context_mask=None):
        for layer_type, (norm, block) in zip(self.layer_types, self.layers):
            residual = x
            x = norm(x)
            if layer_type == 'a':
                out = block(x, mask=mask)
            elif layer_type == 'c':
                out = block(x, context=context, mask=mask, context_mask=context_mask)
            else:
                out = block(x)
            x = residual + out
        return x


def main():
    torch.manual_seed(0)
    decoder = AttentionLayers(dim=16, causal=True, cross_attend=True).eval()
    x = torch.randn(2, 6, 16)
    mask = torch.tensor([[True] * 6, [True] * 4 + [False] * 2])
    context = torch.randn(2, 6, 16)  # e.g. encoded image patches, nothing padded
    with torch.no_grad():
        out = decoder(x, context=context, mask=mask)
    print("decoder output checksum", round(out[1, :4].sum().item(), 4))


if __name__ == "__main__":
    main()
