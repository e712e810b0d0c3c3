"""Equinox MultiheadAttention vmapped its per-head mask over the wrong axis (ported to torch).

Citation: patrick-kidger/equinox#190 ("fix attention with mask and add tests"), commit 69c8fb5
(bug read at 69c8fb5^, equinox/nn/attention.py, MultiheadAttention.__call__).

Bug: `MultiheadAttention.__call__` splits the projections into heads laid out
(seq_length, num_heads, head_size) and runs one head at a time with
`jax.vmap(attn_fn, in_axes=1, out_axes=1)(query_heads, key_heads, value_heads, mask, key=keys)`.
The mask, documented as (num_heads, query_seq_length, kv_seq_length), is passed positionally,
so `in_axes=1` maps it over its query axis too: head h gets `mask[:, h, :]` (query i reads
row h of head i's mask) instead of `mask[h]`. When the sequence length equals the number of
heads the shapes still agree and nothing is raised.
Fix: pass the mask as `mask=mask`; vmap maps keyword arguments over axis 0, i.e. over heads.

Port: equinox's Linear / Dropout / dot_product_attention / MultiheadAttention written as torch
modules called on one unbatched example (shapes as equinox writes them), with `torch.vmap`
standing in for `jax.vmap` (torch.vmap does not map keyword arguments, so the fixed call maps
the mask over axis 0 with `in_dims`). On top, a small decoder-only LM in the style of the
equinox examples: per-example `__call__`, a (num_heads, seq, seq) mask built from the tokens
(causal, pad keys off, 0 = pad, right padding) and repeated over heads, `vmap` over the batch.
Context of 8 tokens, 8 heads.
"""
import math
import sys
from functools import partial

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


class Linear(nn.Module):
    """eqx.nn.Linear: weight (out_features, in_features), called on one vector."""

    def __init__(self, in_features, out_features, use_bias=True):
        super().__init__()
        lim = 1 / math.sqrt(in_features)
        self.weight = nn.Parameter(torch.empty(out_features, in_features).uniform_(-lim, lim))
        self.bias = nn.Parameter(torch.empty(out_features).uniform_(-lim, lim)) if use_bias else None
        self.use_bias = use_bias

    def forward(self, x):
        x = self.weight @ x
        if self.use_bias:
            x = x + self.bias
        return x


class Dropout(nn.Module):
    def __init__(self, p=0.5, inference=False):
        super().__init__()
        self.p = p
        self.inference = inference

    def forward(self, x, *, key=None, inference=None):
        if inference is None:
            inference = self.inference
        if inference or self.p == 0.0:
            return x
        return F.dropout(x, self.p, training=True)


def dot_product_attention_weights(query, key, mask=None):
    logits = torch.einsum("sd,Sd->sS", query, key)
    logits = logits / math.sqrt(query.shape[-1])
    if mask is not None:
        if mask.shape != logits.shape:
            raise ValueError(
                f"mask must have shape (query_seq_length, "
                f"kv_seq_length)=({query.shape[0]}, "
                f"{key.shape[0]}). Got {mask.shape}."
            )
        logits = torch.where(mask, logits, -torch.inf)
    return torch.softmax(logits, dim=-1)


def dot_product_attention(query, key_, value, mask=None, dropout=None, *, key=None, inference=None):
    weights = dot_product_attention_weights(query, key_, mask)
    if dropout is not None:
        weights = dropout(weights, key=key, inference=inference)
    attn = torch.einsum("sS,Sd->sd", weights, value)
    return attn


class MultiheadAttention(nn.Module):
    def __init__(self, num_heads, query_size, key_size=None, value_size=None, output_size=None,
                 qk_size=None, vo_size=None, use_query_bias=False, use_key_bias=False,
                 use_value_bias=False, use_output_bias=False, dropout_p=0.0, inference=False):
        super().__init__()
        if key_size is None:
            key_size = query_size
        if value_size is None:
            value_size = query_size
        if qk_size is None:
            qk_size = query_size // num_heads
        if vo_size is None:
            vo_size = query_size // num_heads
        if output_size is None:
            output_size = query_size

        self.query_proj = Linear(query_size, num_heads * qk_size, use_bias=use_query_bias)
        self.key_proj = Linear(key_size, num_heads * qk_size, use_bias=use_key_bias)
        self.value_proj = Linear(value_size, num_heads * vo_size, use_bias=use_value_bias)
        self.output_proj = Linear(num_heads * vo_size, output_size, use_bias=use_output_bias)
        self.dropout = Dropout(dropout_p, inference=inference)

        self.num_heads = num_heads
        self.query_size = query_size
        self.qk_size = qk_size
        self.vo_size = vo_size

    def forward(self, query, key_, value, mask=None, *, key=None, inference=None):
        # query: (query_seq_length, query_size); mask: (num_heads, query_seq_length, kv_seq_length)
        query_seq_length, _ = query.shape
        kv_seq_length, _ = key_.shape
        kv_seq_length2, _ = value.shape
        if kv_seq_length != kv_seq_length2:
            raise ValueError("key and value must both be sequences of equal length.")

        query_heads = self._project(self.query_proj, query)
        key_heads = self._project(self.key_proj, key_)
        value_heads = self._project(self.value_proj, value)

        attn_fn = partial(dot_product_attention, dropout=self.dropout, inference=inference)
        if FIXED:
            # upstream: jax.vmap(attn_fn, in_axes=1, out_axes=1)(q, k, v, mask=mask, key=keys)
            attn = torch.vmap(attn_fn, in_dims=(1, 1, 1, 0), out_dims=1)(
                query_heads, key_heads, value_heads, mask
            )
        else:
            # upstream: jax.vmap(attn_fn, in_axes=1, out_axes=1)(q, k, v, mask, key=keys)
            attn = torch.vmap(attn_fn, in_dims=1, out_dims=1)(
                query_heads, key_heads, value_heads, mask
            )
        attn = attn.reshape(query_seq_length, -1)

        return torch.vmap(self.output_proj)(attn)

    def _project(self, proj, x):
        seq_length, _ = x.shape
        projection = torch.vmap(proj)(x)
        return projection.reshape(seq_length, self.num_heads, -1)


class LayerNorm(nn.Module):
    def __init__(self, shape, eps=1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(shape))
        self.bias = nn.Parameter(torch.zeros(shape))
        self.eps = eps

    def forward(self, x):
        mean = x.mean(-1, keepdim=True)
        var = ((x - mean) ** 2).mean(-1, keepdim=True)
        return (x - mean) / torch.sqrt(var + self.eps) * self.weight + self.bias


class DecoderBlock(nn.Module):
    def __init__(self, hidden_size, intermediate_size, num_heads):
        super().__init__()
        self.num_heads = num_heads
        self.ln1 = LayerNorm(hidden_size)
        self.attention = MultiheadAttention(num_heads=num_heads, query_size=hidden_size,
                                            use_query_bias=True, use_key_bias=True,
                                            use_value_bias=True, use_output_bias=True)
        self.ln2 = LayerNorm(hidden_size)
        self.mlp_in = Linear(hidden_size, intermediate_size)
        self.mlp_out = Linear(intermediate_size, hidden_size)

    def make_self_attention_mask(self, mask):
        """(seq_len,) token mask -> (num_heads, seq_len, seq_len) causal mask over real keys."""
        seq_len = mask.shape[-1]
        causal = torch.tril(torch.ones(seq_len, seq_len, dtype=torch.bool))
        mask = causal & mask.unsqueeze(-2).bool()
        mask = mask.unsqueeze(-3)
        mask = mask.repeat_interleave(self.num_heads, dim=-3)
        return mask

    def forward(self, inputs, mask):
        attn_mask = self.make_self_attention_mask(mask)
        x = torch.vmap(self.ln1)(inputs)
        x = self.attention(x, x, x, mask=attn_mask, inference=True)
        h = inputs + x
        y = torch.vmap(self.ln2)(h)
        y = torch.vmap(lambda v: self.mlp_out(F.gelu(self.mlp_in(v))))(y)
        return h + y


class DecoderLM(nn.Module):
    def __init__(self, vocab_size, max_len, hidden_size, intermediate_size, num_heads, num_layers):
        super().__init__()
        self.token_embedder = nn.Parameter(torch.randn(vocab_size, hidden_size) * 0.5)
        self.position_embedder = nn.Parameter(torch.randn(max_len, hidden_size) * 0.5)
        self.layers = nn.ModuleList(
            [DecoderBlock(hidden_size, intermediate_size, num_heads) for _ in range(num_layers)]
        )
        self.ln_f = LayerNorm(hidden_size)
        self.head = Linear(hidden_size, vocab_size)

    def forward(self, token_ids):
        # token_ids: (seq_len,), 0 = pad
        seq_len = token_ids.shape[0]
        x = self.token_embedder[token_ids] + self.position_embedder[:seq_len]
        mask = (token_ids != 0).to(torch.int32)
        for layer in self.layers:
            x = layer(x, mask)
        x = torch.vmap(self.ln_f)(x)
        return torch.vmap(self.head)(x)


def main():
    torch.manual_seed(0)
    vocab, ctx, heads = 50, 8, 8
    model = DecoderLM(vocab_size=vocab, max_len=ctx, hidden_size=32, intermediate_size=64,
                      num_heads=heads, num_layers=2)
    model.eval()

    lengths = [8, 5, 3]
    rows = []
    for n in lengths:
        ids = torch.randint(1, vocab, (n,)).tolist()
        rows.append(ids + [0] * (ctx - n))
    token_ids = torch.tensor(rows)

    with torch.no_grad():
        logits = torch.vmap(model)(token_ids)  # (batch, seq, vocab)

    inputs_mask = (token_ids != 0)
    targets = token_ids[:, 1:]
    tmask = inputs_mask[:, 1:].float()
    logp = torch.log_softmax(logits[:, :-1], dim=-1)
    nll = -logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    loss = (nll * tmask).sum() / tmask.sum()

    last = torch.tensor(lengths) - 1
    next_tok = logits[torch.arange(len(lengths)), last].argmax(-1)
    print("loss over real tokens:", round(loss.item(), 6))
    print("next token after each prompt:", next_tok.tolist())


if __name__ == "__main__":
    main()
