# keras (torch backend), keras.layers.Softmax used by MultiHeadAttention._masked_softmax: keras-team/keras#21149.
# The mask is applied only as an additive (1 - mask) * -1e9 before softmax, so a row whose keys are all
# masked (a padded query) becomes a uniform distribution over the padded keys instead of all zeros (JAX behavior).
import math
import sys

import torch

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


def _large_negative_number(dtype):
    """Return a Large negative number based on dtype."""
    if dtype == torch.float16:
        return -3e4
    return -1e9


class Softmax(torch.nn.Module):
    """keras/src/layers/activations/softmax.py on the torch backend."""

    def __init__(self, axis=-1):
        super().__init__()
        self.axis = axis

    def forward(self, inputs, mask=None):
        if mask is not None:
            adder = (1.0 - mask.to(inputs.dtype)) * _large_negative_number(inputs.dtype)
            inputs += adder
        if not FIXED:
            return torch.softmax(inputs, dim=self.axis)
        outputs = torch.softmax(inputs, dim=self.axis)
        if mask is not None:
            # Apply the mask to the softmax output to ensure that masked
            # values are set to 0 in case the entire axis is masked.
            outputs = torch.multiply(outputs, mask.to(outputs.dtype))
        return outputs


class MultiHeadAttention(torch.nn.Module):
    """keras/src/layers/attention/multi_head_attention.py, attention_axes=(1,), non-fused path."""

    def __init__(self, num_heads, key_dim, dim, dropout=0.0):
        super().__init__()
        self._num_heads, self._key_dim, self._dropout = num_heads, key_dim, dropout
        self._query_dense = torch.nn.Linear(dim, num_heads * key_dim)
        self._key_dense = torch.nn.Linear(dim, num_heads * key_dim)
        self._value_dense = torch.nn.Linear(dim, num_heads * key_dim)
        self._output_dense = torch.nn.Linear(num_heads * key_dim, dim)
        self._attention_axes = (1,)
        self._inverse_sqrt_key_dim = 1.0 / math.sqrt(float(key_dim))
        self._dot_product_equation = "aecd,abcd->acbe"
        self._combine_equation = "acbe,aecd->abcd"
        self._softmax = Softmax(axis=-1)

    def _masked_softmax(self, attention_scores, attention_mask=None):
        # attention_scores = [B, N, T, S]
        if attention_mask is not None:
            mask_expansion_axis = -len(self._attention_axes) * 2 - 1
            for _ in range(len(attention_scores.shape) - len(attention_mask.shape)):
                attention_mask = torch.unsqueeze(attention_mask, dim=mask_expansion_axis)
        return self._softmax(attention_scores, mask=attention_mask)

    def _compute_attention(self, query, key, value, attention_mask=None, training=None, return_attention_scores=False):
        use_dot_product_attention = not (self._dropout > 0.0 or return_attention_scores or (len(query.shape) != 4))
        assert not use_dot_product_attention  # this program exercises the explicit-scores path
        query = torch.multiply(query, torch.tensor(self._inverse_sqrt_key_dim, dtype=query.dtype))
        attention_scores = torch.einsum(self._dot_product_equation, key, query)
        attention_scores = self._masked_softmax(attention_scores, attention_mask)
        final_attn_scores = attention_scores
        attention_output = torch.einsum(self._combine_equation, final_attn_scores, value)
        return attention_output, attention_scores

    def _compute_attention_mask(self, query, value, query_mask=None, value_mask=None, attention_mask=None):
        auto_mask = None
        if query_mask is not None:
            query_mask = query_mask.bool()
            auto_mask = torch.unsqueeze(query_mask, -1)  # shape is [B, T, 1]
        if value_mask is not None:
            value_mask = value_mask.bool()
            mask = torch.unsqueeze(value_mask, -2)  # shape is [B, 1, S]
            auto_mask = mask if auto_mask is None else auto_mask & mask
        if attention_mask is not None:
            attention_mask = attention_mask.bool()
        if auto_mask is not None:
            attention_mask = auto_mask if attention_mask is None else attention_mask & auto_mask
        return attention_mask

    def forward(self, query, value, query_mask=None, value_mask=None, return_attention_scores=False):
        key = value
        attention_mask = self._compute_attention_mask(query, value, query_mask=query_mask, value_mask=value_mask)
        B, T, _ = query.shape
        S = value.shape[1]
        q = self._query_dense(query).view(B, T, self._num_heads, self._key_dim)
        k = self._key_dense(key).view(B, S, self._num_heads, self._key_dim)
        v = self._value_dense(value).view(B, S, self._num_heads, self._key_dim)
        attention_output, attention_scores = self._compute_attention(
            q, k, v, attention_mask, None, return_attention_scores
        )
        attention_output = self._output_dense(attention_output.reshape(B, T, -1))
        if return_attention_scores:
            return attention_output, attention_scores
        return attention_output


# Self-attention over a right-padded batch whose Keras masks come from Embedding(mask_zero=True).
VOCAB, D, B, T = 30, 32, 3, 8
emb = torch.nn.Embedding(VOCAB, D)
mha = MultiHeadAttention(num_heads=4, key_dim=8, dim=D)
lengths = torch.tensor([8, 5, 3])
ids = torch.randint(1, VOCAB, (B, T))
ids[torch.arange(T)[None, :] >= lengths[:, None]] = 0

with torch.no_grad():
    x = emb(ids)
    keras_mask = ids != 0
    out, scores = mha(x, x, query_mask=keras_mask, value_mask=keras_mask, return_attention_scores=True)

# scores: [B, N, T, S]; rows of padded queries have every key masked.
padded_q = ~keras_mask  # [B, T]
row_sums = scores.sum(-1).permute(0, 2, 1)[padded_q]  # [num_padded_queries, N]
print(f"max attention weight mass on fully masked (padded-query) rows: {row_sums.max().item():.6f}")
