# keras-hub (torch backend), Qwen3Attention._compute_attention: keras-team/keras-hub#2289 (commit cf8aedf).
# The guard reads `if not self.sliding_window_size:`, so a model configured with a sliding window never
# ANDs the band into the causal+padding mask (and a model without one would crash): queries see the whole prefix.
import math
import sys

import torch

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


def compute_causal_mask(batch_size, input_length, output_length, cache_index=0):
    i = torch.arange(output_length, dtype=torch.float32)
    i = i + float(cache_index)
    i = torch.unsqueeze(i, 1)
    j = torch.arange(input_length, dtype=torch.float32)
    mask = torch.unsqueeze(i >= j, 0)
    return torch.broadcast_to(mask, (batch_size, output_length, input_length))


def merge_padding_and_attention_mask(inputs, padding_mask, attention_mask):
    mask = padding_mask
    if mask is not None:
        mask = torch.unsqueeze(mask, 1).to(torch.int32)
    if attention_mask is not None:
        attention_mask = attention_mask.to(torch.int32)
        if mask is None:
            return attention_mask
        return torch.minimum(mask, attention_mask)
    return mask


def _large_negative_number(dtype):
    return -3e4 if dtype == torch.float16 else -1e9


def keras_softmax(inputs, mask=None):
    """keras.layers.Softmax(axis=-1) on the torch backend (keras 3.10)."""
    if mask is not None:
        inputs = inputs + (1.0 - mask.to(inputs.dtype)) * _large_negative_number(inputs.dtype)
    outputs = torch.softmax(inputs, dim=-1)
    if mask is not None:
        outputs = outputs * mask.to(outputs.dtype)
    return outputs


class Qwen3LayerNorm(torch.nn.Module):
    def __init__(self, head_dim, epsilon=1e-6):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.ones(head_dim))
        self.epsilon = epsilon

    def forward(self, x):
        var = torch.mean(torch.pow(x, 2), dim=-1, keepdim=True)
        x = x * torch.rsqrt(var + self.epsilon)
        return x * self.scale


class Qwen3Attention(torch.nn.Module):
    def __init__(self, num_query_heads, num_key_value_heads, head_dim, hidden_dim, sliding_window_size=None):
        super().__init__()
        self.num_query_heads = num_query_heads
        self.num_key_value_heads = num_key_value_heads
        self.head_dim = head_dim
        self.num_key_value_groups = num_query_heads // num_key_value_heads
        self.sliding_window_size = sliding_window_size
        self._inv_norm_factor = 1.0 / math.sqrt(self.head_dim)
        # EinsumDense kernels: "bqm,muh->bquh", "bkm,mvh->bkvh", "bquh,uhm->bqm"
        self.query_kernel = torch.nn.Parameter(torch.randn(hidden_dim, num_query_heads, head_dim) * 0.2)
        self.key_kernel = torch.nn.Parameter(torch.randn(hidden_dim, num_key_value_heads, head_dim) * 0.2)
        self.value_kernel = torch.nn.Parameter(torch.randn(hidden_dim, num_key_value_heads, head_dim) * 0.2)
        self.output_kernel = torch.nn.Parameter(torch.randn(num_query_heads, head_dim, hidden_dim) * 0.2)
        self._query_dense_layer_norm = Qwen3LayerNorm(head_dim)
        self._key_dense_layer_norm = Qwen3LayerNorm(head_dim)
        self._dot_product_equation = "bquh,bkuh->buqk"
        self._combine_equation = "buqk,bkuh->bquh"

    def forward(self, hidden_states, attention_mask=None, cache_update_index=None):
        query = torch.einsum("bqm,muh->bquh", hidden_states, self.query_kernel)
        query = self._query_dense_layer_norm(query)
        key = torch.einsum("bkm,mvh->bkvh", hidden_states, self.key_kernel)
        key = self._key_dense_layer_norm(key)
        value = torch.einsum("bkm,mvh->bkvh", hidden_states, self.value_kernel)
        key = torch.repeat_interleave(key, repeats=self.num_key_value_groups, dim=2)
        value = torch.repeat_interleave(value, repeats=self.num_key_value_groups, dim=2)
        attention_output = self._compute_attention(
            query, key, value, attention_mask, cache_update_index=cache_update_index
        )
        return torch.einsum("bquh,uhm->bqm", attention_output, self.output_kernel)

    def _masked_softmax(self, attention_scores, attention_mask=None):
        if attention_mask is not None:
            return keras_softmax(attention_scores, attention_mask[:, None, :, :])
        return keras_softmax(attention_scores)

    def _compute_attention(self, query, key, value, attention_mask=None, cache_update_index=None):
        # fused_attention_op_available() is False on the torch backend.
        attention_scores = torch.einsum(self._dot_product_equation, query, key)
        attention_scores = torch.multiply(attention_scores, self._inv_norm_factor)
        if (self.sliding_window_size) if FIXED else (not self.sliding_window_size):
            attention_mask = self._mask_sliding_window(
                attention_mask,
                cache_update_index=cache_update_index if cache_update_index else 0,
            )
        attention_scores = self._masked_softmax(attention_scores, attention_mask)
        return torch.einsum(self._combine_equation, attention_scores, value)

    def _mask_sliding_window(self, attention_mask, cache_update_index=0):
        _, query_len, key_len = attention_mask.shape
        all_ones = torch.ones((key_len, key_len), dtype=torch.bool)
        sliding_mask = torch.triu(all_ones, -1 * self.sliding_window_size + 1) * torch.tril(
            all_ones, self.sliding_window_size - 1
        )
        sliding_mask = sliding_mask[cache_update_index : cache_update_index + query_len, :key_len]
        sliding_mask = torch.unsqueeze(sliding_mask, 0)
        return torch.logical_and(attention_mask, sliding_mask.bool())


# Qwen3Decoder._compute_self_attention_mask: padding mask merged with the causal mask, then the layer.
B, T, D, W = 2, 12, 32, 4
attn = Qwen3Attention(num_query_heads=4, num_key_value_heads=2, head_dim=8, hidden_dim=D, sliding_window_size=W)
x = torch.randn(B, T, D)
padding_mask = torch.ones(B, T, dtype=torch.bool)
padding_mask[1, 9:] = False

with torch.no_grad():
    decoder_mask = merge_padding_and_attention_mask(x, padding_mask, None)
    causal_mask = compute_causal_mask(B, T, T, 0)
    self_attention_mask = torch.minimum(decoder_mask, causal_mask.to(torch.int32))
    out = attn(x, attention_mask=self_attention_mask)

    # Reference: each query attends, in a plain loop, to the last W real positions up to itself.
    q = attn._query_dense_layer_norm(torch.einsum("bqm,muh->bquh", x, attn.query_kernel))
    k = attn._key_dense_layer_norm(torch.einsum("bkm,mvh->bkvh", x, attn.key_kernel)).repeat_interleave(2, dim=2)
    v = torch.einsum("bkm,mvh->bkvh", x, attn.value_kernel).repeat_interleave(2, dim=2)
    worst = 0.0
    for b in range(B):
        for i in range(T):
            if not padding_mask[b, i]:
                continue
            keys = [j for j in range(max(0, i - W + 1), i + 1) if padding_mask[b, j]]
            s = torch.einsum("uh,kuh->uk", q[b, i], k[b, keys]) / math.sqrt(8)
            o = torch.einsum("uk,kuh->uh", torch.softmax(s, -1), v[b, keys])
            ref = torch.einsum("uh,uhm->m", o, attn.output_kernel)
            worst = max(worst, (out[b, i] - ref).abs().max().item())
print(f"max |layer output - sliding-window reference| over real tokens: {worst:.6f}")
