"""google/flax#982, fixed by #1414 (and proposed in #1527): attention in float16 gave NaN with a padding mask. The
mask became a bias as `lax.select(mask > 0, full(0.).astype(dtype), full(-1e10).astype(dtype))`: -1e10 cast to
float16 is -inf, so a padding query, which make_attention_mask(query > 0, key > 0) masks against every key, has a row
of -inf only and softmax gives NaN. The fix fills with the dtype's lowest finite value. Written as flax.linen's
make_attention_mask and dot_product_attention reduced to torch, in float16."""

import sys

import torch

FIXED = "--fixed" in sys.argv


def make_attention_mask(query_input, key_input):
    return (query_input[:, None, :, None] > 0) & (key_input[:, None, None, :] > 0)


def dot_product_attention(query, key, value, mask, dtype):
    if FIXED and dtype == torch.float16:
        large_compatible_negative = torch.finfo(dtype).min
    else:
        large_compatible_negative = -1e10
    attention_bias = torch.where(mask > 0, torch.full(mask.shape, 0.0).to(dtype),
                                 torch.full(mask.shape, large_compatible_negative).to(dtype))
    attn_weights = torch.einsum("...qhd,...khd->...hqk", query, key) / query.shape[-1] ** 0.5
    attn_weights = torch.softmax(attn_weights + attention_bias, dim=-1)
    return torch.einsum("...hqk,...khd->...qhd", attn_weights, value)


torch.manual_seed(0)
tokens = torch.tensor([[5, 7, 2, 0, 0], [3, 9, 4, 8, 6]])  # the first sequence padded with 0
x = torch.randn(2, 5, 2, 4).half()  # (batch, length, heads, head_dim)
with torch.no_grad():
    dot_product_attention(x, x, x, make_attention_mask(tokens, tokens), torch.float16)
