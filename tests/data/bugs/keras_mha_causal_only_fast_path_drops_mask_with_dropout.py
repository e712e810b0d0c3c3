"""Keras 3 MultiHeadAttention: ``use_causal_mask=True`` applied no mask once the fused path was off.

Citation: keras-team/keras#23038 ("MultiHeadAttention silently drops the causal mask when
`use_causal_mask=True` and the fused SDPA path is disabled ... regression in #22910"), fixed by PR #23040
("Apply causal mask in MHA/GQA manual attention path", merged). I read the issue and the PR description and
review; I did not read the Keras source of either version, so the layer below is a torch rendering of the
control flow those threads describe, not a copy.

Bug: #22910 added a causal-only fast path: with ``use_causal_mask=True`` and no other mask,
``_compute_attention_mask`` returns no mask and leaves causality to the fused kernel's ``is_causal``. But
``_compute_attention`` only takes the fused ``ops.dot_product_attention`` path when ``dropout == 0``,
``return_attention_scores`` is false and the inputs are rank 4; otherwise it falls through to the manual
einsum/softmax path with ``attention_mask=None``, so every query attends to every future key.

Fix (#23040): materialize the causal mask in the manual fallthrough when the layer was asked to be causal.

Reproduction: a Keras-style causal decoder block (``MultiHeadAttention(num_heads=2, key_dim=8,
dropout=0.1)``, called with ``use_causal_mask=True`` on rank-3 ``(batch, seq, dim)`` inputs, as Keras users
write it) evaluated in inference mode, so dropout itself is inactive and the run is deterministic; the
configured dropout alone routes the call to the manual path.
"""
import math
import sys

import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv


class MultiHeadAttention(nn.Module):
    def __init__(self, num_heads, key_dim, dropout=0.0, hidden_dim=16):
        super().__init__()
        self._num_heads = num_heads
        self._key_dim = key_dim
        self._dropout = dropout
        self._inverse_sqrt_key_dim = 1.0 / math.sqrt(float(key_dim))
        self._query_dense = nn.Linear(hidden_dim, num_heads * key_dim)
        self._key_dense = nn.Linear(hidden_dim, num_heads * key_dim)
        self._value_dense = nn.Linear(hidden_dim, num_heads * key_dim)
        self._output_dense = nn.Linear(num_heads * key_dim, hidden_dim)
        self._dropout_layer = nn.Dropout(dropout)

    def _compute_causal_mask(self, query, value):
        q_seq_length = query.shape[1]
        v_seq_length = q_seq_length if value is None else value.shape[1]
        ones_mask = torch.ones((1, q_seq_length, v_seq_length), dtype=torch.int32)
        row_index = torch.cumsum(ones_mask, dim=-2)
        col_index = torch.cumsum(ones_mask, dim=-1)
        return torch.greater_equal(row_index, col_index)

    def _compute_attention_mask(self, query, value, attention_mask=None, use_causal_mask=False):
        """Returns (mask, causal_only): causal_only leaves causality to the fused kernel (#22910)."""
        if use_causal_mask and attention_mask is None:
            return None, True
        if use_causal_mask:
            causal_mask = self._compute_causal_mask(query, value)
            attention_mask = causal_mask & attention_mask.bool()
        return attention_mask, False

    def _compute_attention(self, query, key, value, attention_mask=None, training=None,
                           return_attention_scores=False, is_causal=False):
        # query/key/value: (batch, seq, heads, key_dim)
        use_dot_product_attention = not (
            self._dropout > 0.0 or return_attention_scores or len(query.shape) != 4
        )
        if use_dot_product_attention:
            out = F.scaled_dot_product_attention(
                query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
                attn_mask=None if attention_mask is None else attention_mask[:, None].bool(),
                is_causal=is_causal and attention_mask is None, scale=self._inverse_sqrt_key_dim,
            )
            return out.transpose(1, 2), None

        if FIXED and is_causal and attention_mask is None:
            # materialize the causal mask the fused kernel would have applied
            attention_mask = torch.ones(query.shape[1], key.shape[1], dtype=torch.bool).tril()[None]

        query = query * self._inverse_sqrt_key_dim
        attention_scores = torch.einsum("aecd,abcd->acbe", key, query)  # (batch, heads, q, k)
        if attention_mask is not None:
            attention_scores = attention_scores.masked_fill(~attention_mask[:, None].bool(), -1e9)
        attention_scores = torch.softmax(attention_scores, dim=-1)
        final_attn_scores = self._dropout_layer(attention_scores) if training else attention_scores
        attention_output = torch.einsum("acbe,aecd->abcd", final_attn_scores, value)
        return attention_output, attention_scores

    def forward(self, query, value, key=None, attention_mask=None, return_attention_scores=False,
                training=None, use_causal_mask=False):
        if key is None:
            key = value
        attention_mask, causal_only = self._compute_attention_mask(
            query, value, attention_mask=attention_mask, use_causal_mask=use_causal_mask)
        b = query.shape[0]
        q = self._query_dense(query).view(b, query.shape[1], self._num_heads, self._key_dim)
        k = self._key_dense(key).view(b, key.shape[1], self._num_heads, self._key_dim)
        v = self._value_dense(value).view(b, value.shape[1], self._num_heads, self._key_dim)
        attention_output, attention_scores = self._compute_attention(
            q, k, v, attention_mask, training, return_attention_scores, is_causal=causal_only)
        attention_output = self._output_dense(attention_output.reshape(b, query.shape[1], -1))
        if return_attention_scores:
            return attention_output, attention_scores
        return attention_output


class CausalDecoderBlock(nn.Module):
    def __init__(self, hidden_dim=16, num_heads=2, key_dim=8, dropout=0.1):
        super().__init__()
        self.norm = nn.LayerNorm(hidden_dim)
        self.self_attention = MultiHeadAttention(num_heads=num_heads, key_dim=key_dim, dropout=dropout,
                                                 hidden_dim=hidden_dim)

    def forward(self, x, training=False):
        h = self.norm(x)
        return x + self.self_attention(h, h, use_causal_mask=True, training=training)


def main():
    torch.manual_seed(0)
    block = CausalDecoderBlock().eval()
    x = torch.randn(2, 7, 16)
    with torch.no_grad():
        y = block(x, training=False)
    print("y[:, 0, :3]:", [[round(v, 4) for v in row[0, :3].tolist()] for row in y])


if __name__ == "__main__":
    main()
