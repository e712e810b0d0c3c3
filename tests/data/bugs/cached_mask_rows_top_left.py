"""rasbt/LLMs-from-scratch#1048: in cached incremental decoding the causal mask was cut from the top-left of the
buffer (self.mask[:num_tokens_Q, :num_tokens_K]) instead of at the current position, so a decoding query saw the
first keys only. The fix selects the query rows at the current position:
self.mask[ptr_current_pos:ptr_current_pos + num_tokens_Q, :num_tokens_K]."""

import sys

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv


class MultiHeadAttention(nn.Module):
    def __init__(self, d_in=8, context_length=16, num_heads=2):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, d_in // num_heads
        self.W_query, self.W_key, self.W_value = (nn.Linear(d_in, d_in, bias=False) for _ in range(3))
        self.register_buffer("mask", torch.triu(torch.ones(context_length, context_length), diagonal=1), persistent=False)
        self.cache_k = self.cache_v = None
        self.ptr_current_pos = 0

    def forward(self, x):
        b, num_tokens, d_in = x.shape
        split = lambda t: t.view(b, num_tokens, self.num_heads, self.head_dim).transpose(1, 2)  # noqa: E731
        queries, keys_new, values_new = split(self.W_query(x)), split(self.W_key(x)), split(self.W_value(x))
        self.cache_k = keys_new if self.cache_k is None else torch.cat([self.cache_k, keys_new], dim=2)
        self.cache_v = values_new if self.cache_v is None else torch.cat([self.cache_v, values_new], dim=2)
        keys, values = self.cache_k, self.cache_v
        attn_scores = queries @ keys.transpose(2, 3)
        num_tokens_Q, num_tokens_K = queries.shape[-2], keys.shape[-2]
        if FIXED:
            mask_bool = self.mask.bool()[self.ptr_current_pos:self.ptr_current_pos + num_tokens_Q, :num_tokens_K]
        else:
            mask_bool = self.mask.bool()[:num_tokens_Q, :num_tokens_K]
        self.ptr_current_pos += num_tokens_Q
        attn_scores.masked_fill_(mask_bool, -torch.inf)
        attn_weights = torch.softmax(attn_scores / self.head_dim ** 0.5, dim=-1)
        return (attn_weights @ values).transpose(1, 2).reshape(b, num_tokens, d_in)


torch.manual_seed(0)
mha = MultiHeadAttention().eval()
with torch.no_grad():
    out = mha(torch.randn(1, 4, 8))
    for _ in range(2):
        out = mha(out[:, -1:])
