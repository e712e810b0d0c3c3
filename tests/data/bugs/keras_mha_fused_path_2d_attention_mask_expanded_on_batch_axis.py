# keras (torch backend), MultiHeadAttention._compute_attention fused dot_product_attention path: keras-team/keras#20488.
# A 2D attention_mask (T, S) is grown to 4D with expand_dims(axis=1) twice -> (T, 1, 1, S), then tiled on axis 1,
# so the query axis lands on the batch axis: batch element b gets row b of the mask for every query (runs when B == T).
import math
import sys

import torch

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


def _get_large_negative(dtype):
    val = 65500.0 if dtype == torch.float16 else 3.38953e38
    return torch.tensor(val * -0.7, dtype=dtype)


def dot_product_attention(query, key, value, bias=None, mask=None, scale=None, is_causal=False, flash_attention=False):
    """keras/src/backend/torch/nn.py (keras 3.6/3.7)."""
    mask = mask if mask is None else mask.to(torch.bool)
    if mask is not None:
        # Explicit set `is_causal` to `False` when `mask` is not `None`.
        is_causal = False
        mask = torch.where(mask, 0.0, _get_large_negative(query.dtype))
    axis0, axis1 = 1, 2
    query = torch.transpose(query, axis0, axis1)
    key = torch.transpose(key, axis0, axis1)
    value = torch.transpose(value, axis0, axis1)
    if mask is not None:
        mask = mask.contiguous()
    attention_output = torch.nn.functional.scaled_dot_product_attention(
        query.contiguous(), key.contiguous(), value.contiguous(), attn_mask=mask, is_causal=is_causal, scale=scale
    )
    return torch.transpose(attention_output, axis1, axis0)


class MultiHeadAttention(torch.nn.Module):
    """keras/src/layers/attention/multi_head_attention.py, default attention_axes, dropout=0."""

    def __init__(self, num_heads, key_dim, dim, dropout=0.0):
        super().__init__()
        self._num_heads, self._key_dim, self._dropout = num_heads, key_dim, dropout
        self._query_dense = torch.nn.Linear(dim, num_heads * key_dim)
        self._key_dense = torch.nn.Linear(dim, num_heads * key_dim)
        self._value_dense = torch.nn.Linear(dim, num_heads * key_dim)
        self._output_dense = torch.nn.Linear(num_heads * key_dim, dim)
        self._attention_axes = (1,)
        self._inverse_sqrt_key_dim = 1.0 / math.sqrt(float(key_dim))
        self._flash_attention = False

    def _compute_attention(self, query, key, value, attention_mask=None, training=None, return_attention_scores=False):
        use_dot_product_attention = not (self._dropout > 0.0 or return_attention_scores or (len(query.shape) != 4))
        assert use_dot_product_attention
        if attention_mask is not None:
            if FIXED:
                # Ensure attention_mask has the correct shape for broadcasting
                # Expected shape: [batch_size, num_heads, query_seq_len,
                # key_seq_len].
                mask_expansion_axis = -len(self._attention_axes) * 2 - 1
                len_attention_scores_shape = 4  # Only accepts 4D inputs
                for _ in range(len_attention_scores_shape - len(attention_mask.shape)):
                    attention_mask = torch.unsqueeze(attention_mask, dim=mask_expansion_axis)
                attention_mask = attention_mask.to(torch.bool)
            else:
                # Ensure attention_mask has the correct shape for broadcasting
                # Expected shape: [batch_size, num_heads, query_seq_len,
                # key_seq_len]. This is because masked_softmax is not supported
                # in JAX.
                while len(attention_mask.shape) < 4:
                    attention_mask = torch.unsqueeze(attention_mask, dim=1)  # Add dimension for num_heads
                if attention_mask.shape[1] != self._num_heads:
                    attention_mask = torch.tile(attention_mask, (1, self._num_heads, 1, 1))
        attention_output = dot_product_attention(
            query=query, key=key, value=value, bias=None, mask=attention_mask,
            scale=self._inverse_sqrt_key_dim, is_causal=False, flash_attention=self._flash_attention,
        )
        return attention_output, None

    def forward(self, query, value, attention_mask=None):
        key = value
        if attention_mask is not None:
            attention_mask = attention_mask.to(torch.bool)  # _compute_attention_mask with no Keras masks
        B, T, _ = query.shape
        S = value.shape[1]
        q = self._query_dense(query).view(B, T, self._num_heads, self._key_dim)
        k = self._key_dense(key).view(B, S, self._num_heads, self._key_dim)
        v = self._value_dense(value).view(B, S, self._num_heads, self._key_dim)
        attention_output, _ = self._compute_attention(q, k, v, attention_mask)
        return self._output_dense(attention_output.reshape(B, T, -1))


# keras-team/keras#20488's test: one layer called with a (T, T) causal mask and with the same mask tiled to
# (B, T, T); the batch size equals the sequence length, the one shape where the buggy expansion does not crash.
B, T, D = 5, 5, 8
layer = MultiHeadAttention(num_heads=2, key_dim=4, dim=D)
x = torch.rand(B, T, D)
mask = torch.tril(torch.ones(T, T))  # (5, 5)

with torch.no_grad():
    output_1 = layer(x, x, attention_mask=mask)
    mask3 = torch.tile(mask[None, ...], (B, 1, 1))  # (5, 5, 5)
    output_2 = layer(x, x, attention_mask=mask3)
print(f"max |output with (T, S) mask - output with (B, T, S) mask|: {(output_1 - output_2).abs().max().item():.6f}")
