"""torch_brain: `rotary_attn_xformers_func` turns the keep-mask into an inverted bias.

Citation: neuro-galaxy/torch_brain PR #74 "Bugfix: Inverted mask in `xformers` rotary
attention forward" (merged; description: "The mask to bias transformation in
`rotary_attn_xformers_func` is currently the opposite of what it should be. The bug only
surfaces if you have `xformers` installed ... If you're using pytorch attention, you
would be unaffected."; after the fix "it atleast trains ... It wasn't learning at all
when the mask was flipped").

Bug: `attn_mask` is documented as (b, n_kv) "A value of True indicates that the element
should take part in attention"; the pytorch path hands it to SDPA as a boolean keep-mask,
but the xformers path built `attn_bias` with -inf where the mask is True, so the
latents attended only to the padded input tokens.
Fix (the fixed line, read in a stored copy of torch_brain/nn/rotary_attention.py):
`attn_mask.to(query.dtype).masked_fill(attn_mask.logical_not(), float("-inf"))`.
The pre-fix line is reconstructed from the description as the same expression filling
where the mask is True.

Reproduction: the POYO-style cross-attention from latents to a padded batch of input
tokens through `rotary_attn_xformers_func`; rotary embeddings applied as upstream
(`apply_rotary_pos_emb`, head_dim=2), `einops.rearrange/repeat` replaced by view /
expand (einops is not installed here) and xformers' `memory_efficient_attention` by a
torch reference over F.scaled_dot_product_attention with the same (b, n, h, d) layout
and additive `attn_bias`.
"""
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


def memory_efficient_attention(query, key, value, attn_bias=None, p=0.0):
    """Torch reference of xformers.ops.memory_efficient_attention, (b, n, h, d) layout."""
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_bias, dropout_p=p)
    return out.transpose(1, 2)


def rotate_half(x):
    x = x.unflatten(-1, (-1, 2))
    x1, x2 = x.unbind(dim=-1)
    x = torch.stack((-x2, x1), dim=-1)
    return x.flatten(-2)


def apply_rotary_pos_emb(pos_emb, t, head_dim=1):
    pos_emb = pos_emb.unsqueeze(head_dim).to(t.dtype)
    return (t * pos_emb.cos()) + (rotate_half(t) * pos_emb.sin())


def rotary_attn_xformers_func(*, query, key, value, q_pos_emb, kv_pos_emb, attn_mask=None,
                              num_heads: int, dropout_p: float, rotate_value: bool):
    b, n, _ = query.shape
    m = key.shape[1]
    # xformers attention expects shape (b, n, h, d)
    query = query.view(b, n, num_heads, -1)
    key = key.view(b, m, num_heads, -1)
    value = value.view(b, m, num_heads, -1)

    query = apply_rotary_pos_emb(q_pos_emb, query, head_dim=2)
    key = apply_rotary_pos_emb(kv_pos_emb, key, head_dim=2)
    if rotate_value:
        value = apply_rotary_pos_emb(kv_pos_emb, value, head_dim=2)

    # WARNING: this is very slow, avoid using attn_mask if possible, refer to xformers documentation
    attn_mask = (
        attn_mask[:, None, None, :].expand(b, num_heads, query.size(1), m)
        if attn_mask is not None
        else None
    )
    if FIXED:
        attn_bias = (
            attn_mask.to(query.dtype).masked_fill(attn_mask.logical_not(), float("-inf"))
            if attn_mask is not None
            else None
        )
    else:
        attn_bias = (
            attn_mask.to(query.dtype).masked_fill(attn_mask, float("-inf"))
            if attn_mask is not None
            else None
        )

    out = memory_efficient_attention(query, key, value, attn_bias=attn_bias, p=dropout_p)
    if rotate_value:
        out = apply_rotary_pos_emb(-q_pos_emb, out, head_dim=2)
    return out.reshape(b, n, -1)


class RotaryCrossAttention(nn.Module):
    def __init__(self, *, dim, context_dim=None, heads=2, dim_head=8, dropout=0.0, rotate_value=False):
        super().__init__()
        inner_dim = dim_head * heads
        context_dim = context_dim or dim
        self.heads = heads
        self.dropout = dropout
        self.rotate_value = rotate_value
        self.norm = nn.LayerNorm(dim)
        self.norm_context = nn.LayerNorm(context_dim)
        self.to_q = nn.Linear(dim, inner_dim, bias=False)
        self.to_kv = nn.Linear(context_dim, inner_dim * 2, bias=False)
        self.to_out = nn.Linear(inner_dim, dim)

    def forward(self, x_query, x_context, query_pos_emb, context_pos_emb, context_mask=None):
        x_query = self.norm(x_query)
        x_context = self.norm_context(x_context)
        q = self.to_q(x_query)
        k, v = self.to_kv(x_context).chunk(2, dim=-1)
        out = rotary_attn_xformers_func(
            query=q, key=k, value=v, q_pos_emb=query_pos_emb, kv_pos_emb=context_pos_emb,
            attn_mask=context_mask, num_heads=self.heads,
            dropout_p=self.dropout if self.training else 0, rotate_value=self.rotate_value)
        return self.to_out(out)


def main():
    torch.manual_seed(0)
    attn = RotaryCrossAttention(dim=16, heads=2, dim_head=8, rotate_value=True).eval()
    b, n_latents, n_tokens = 2, 4, 7
    latents = torch.randn(b, n_latents, 16)
    tokens = torch.randn(b, n_tokens, 16)
    latent_pos = torch.randn(b, n_latents, 8)
    token_pos = torch.randn(b, n_tokens, 8)
    input_mask = torch.ones(b, n_tokens, dtype=torch.bool)
    input_mask[1, 5:] = False  # the second sample has 5 spikes, padded to 7
    input_mask[0, 6:] = False
    with torch.no_grad():
        out = attn(latents, tokens, latent_pos, token_pos, context_mask=input_mask)
    print("fixed" if FIXED else "buggy", "latent 0 of sample 1:", [round(v, 4) for v in out[1, 0, :4].tolist()])


if __name__ == "__main__":
    main()
