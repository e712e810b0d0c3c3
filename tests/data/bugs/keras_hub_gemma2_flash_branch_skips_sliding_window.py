"""KerasHub Gemma 2: the flash-attention branch returned before the sliding-window mask was applied.

Citation: keras-team/keras-hub#2186 ("Flash Attention in Gemma2 will never use the sliding window attention
mask"), resolved by PR #2187 (per the issue thread). I read the issue and the pre-fix
``keras_hub/src/models/gemma/gemma_attention.py``; I did not read PR #2187's diff.

Bug: ``CachedGemmaAttention._compute_attention`` took the fused path
(``has_flash_attention_support() and use_dot_product_attention``) and returned
``ops.dot_product_attention(..., mask=attention_mask)`` with the decoder's causal+padding mask. The
``if self.use_sliding_window_attention: attention_mask = self._mask_sliding_window(...)`` step sat below,
on the fallback path only, so Gemma 2's local layers attended to the whole causal prefix whenever a fused
kernel was available.

Fix (as the issue proposes): apply ``_mask_sliding_window`` before the flash branch, so both paths use the
windowed mask.

Reproduction: the Keras layer and the decoder block's mask building rendered in torch (the Keras torch
backend's ``ops.dot_product_attention`` is ``F.scaled_dot_product_attention``). One local layer
(``use_sliding_window_attention=True, sliding_window_size=4``) with a KV cache of 12: a right-padded batch
prefills at ``cache_update_index=0``, then decode steps at indices 6, 7, 8.
"""
import sys

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv


def has_flash_attention_support():
    # keras_hub.src.utils.keras_utils: true when the backend has a fused dot_product_attention
    return True


def compute_causal_mask(batch_size, input_length, output_length, cache_index=0):
    """keras_hub.src.layers.modeling.transformer_layer_utils.compute_causal_mask."""
    i = torch.arange(output_length)[:, None] + cache_index
    j = torch.arange(input_length)[None, :]
    mask = (i >= j)
    return mask[None].expand(batch_size, output_length, input_length)


def merge_padding_and_attention_mask(inputs, padding_mask, attention_mask):
    mask = padding_mask
    if mask is not None:
        mask = mask[:, None, :].bool()
    if attention_mask is not None:
        attention_mask = attention_mask.bool()
        return attention_mask if mask is None else (mask & attention_mask)
    return mask


class CachedGemmaAttention(nn.Module):
    """A cached grouped query attention layer."""

    def __init__(self, hidden_dim, head_dim, num_query_heads, num_key_value_heads, logit_soft_cap=None,
                 use_sliding_window_attention=False, sliding_window_size=4096, query_head_dim_normalize=True,
                 dropout=0):
        super().__init__()
        self.num_query_heads = num_query_heads
        self.num_key_value_heads = num_key_value_heads
        self.head_dim = head_dim
        self.hidden_dim = hidden_dim
        self.logit_soft_cap = logit_soft_cap
        self.use_sliding_window_attention = use_sliding_window_attention
        self.sliding_window_size = sliding_window_size
        self.query_head_dim_normalize = query_head_dim_normalize
        self.dropout = dropout
        self.query_dense = nn.Linear(hidden_dim, num_query_heads * head_dim, bias=False)
        self.key_dense = nn.Linear(hidden_dim, num_key_value_heads * head_dim, bias=False)
        self.value_dense = nn.Linear(hidden_dim, num_key_value_heads * head_dim, bias=False)
        self.output_dense = nn.Linear(num_query_heads * head_dim, hidden_dim, bias=False)

    def _compute_attention(self, q, k, v, attention_mask, training=False, cache_update_index=0):
        if self.query_head_dim_normalize:
            query_normalization = 1 / np.sqrt(self.head_dim)
        else:
            query_normalization = 1 / np.sqrt(self.hidden_dim // self.num_query_heads)
        use_dot_product_attention = not (self.dropout > 0.0 or (len(q.shape) != 4))

        if FIXED and self.use_sliding_window_attention:
            attention_mask = self._mask_sliding_window(attention_mask, cache_update_index=cache_update_index)

        if has_flash_attention_support() and use_dot_product_attention:
            if attention_mask is not None:
                attention_mask = attention_mask[:, None].bool()
            # ops.dot_product_attention takes (batch, seq, heads, dim)
            attention_output = F.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                attn_mask=attention_mask, scale=float(query_normalization), enable_gqa=True,
            )
            return attention_output.transpose(1, 2)

        q = q * query_normalization
        b, q_len, _, h = q.shape
        q = q.reshape(b, q_len, self.num_key_value_heads, self.num_query_heads // self.num_key_value_heads, h)
        attention_logits = torch.einsum("btkgh,bskh->bkgts", q, k)
        if not FIXED and self.use_sliding_window_attention:
            attention_mask = self._mask_sliding_window(attention_mask, cache_update_index=cache_update_index)
        attention_mask = attention_mask[:, None, None, :, :]
        attention_logits = attention_logits.masked_fill(~attention_mask, torch.finfo(attention_logits.dtype).min)
        attention_softmax = torch.softmax(attention_logits, dim=-1)
        results = torch.einsum("bkgts,bskh->btkgh", attention_softmax, v)
        return results.reshape(b, q_len, self.num_query_heads, h)

    def _mask_sliding_window(self, attention_mask, cache_update_index=0):
        batch_size, query_len, key_len = attention_mask.shape
        # Compute the sliding window for square attention.
        all_ones = torch.ones((key_len, key_len), dtype=torch.bool)
        sliding_mask = torch.triu(all_ones, -1 * self.sliding_window_size + 1) * torch.tril(
            all_ones, self.sliding_window_size - 1)
        # Slice the window for short queries during generation.
        sliding_mask = sliding_mask[cache_update_index:cache_update_index + query_len, :key_len]
        sliding_mask = sliding_mask[None]
        return torch.logical_and(attention_mask, sliding_mask.bool())

    def forward(self, x, attention_mask=None, cache=None, cache_update_index=0):
        b, t, _ = x.shape
        query = self.query_dense(x).view(b, t, self.num_query_heads, self.head_dim)
        key_update = self.key_dense(x).view(b, t, self.num_key_value_heads, self.head_dim)
        value_update = self.value_dense(x).view(b, t, self.num_key_value_heads, self.head_dim)
        key_cache, value_cache = cache[:, 0], cache[:, 1]
        key = key_cache.clone()
        value = value_cache.clone()
        key[:, cache_update_index:cache_update_index + t] = key_update
        value[:, cache_update_index:cache_update_index + t] = value_update
        cache = torch.stack((key, value), dim=1)
        attention_vec = self._compute_attention(query, key, value, attention_mask,
                                                cache_update_index=cache_update_index)
        # Wipe attn vec if there are no attended tokens.
        no_attended_tokens = torch.all(attention_mask == 0, dim=-1, keepdim=True)[..., None]
        attention_vec = torch.where(no_attended_tokens, torch.zeros_like(attention_vec), attention_vec)
        return self.output_dense(attention_vec.reshape(b, t, -1)), cache


class GemmaDecoderBlock(nn.Module):
    def __init__(self, hidden_dim, **attention_kwargs):
        super().__init__()
        self.attention = CachedGemmaAttention(hidden_dim, **attention_kwargs)

    def _compute_attention_mask(self, x, padding_mask, cache, cache_update_index):
        decoder_mask = merge_padding_and_attention_mask(inputs=x, padding_mask=padding_mask, attention_mask=None)
        batch_size = x.shape[0]
        input_length = output_length = x.shape[1]
        if cache is not None:
            input_length = cache.shape[2]
        causal_mask = compute_causal_mask(batch_size=batch_size, input_length=input_length,
                                          output_length=output_length, cache_index=cache_update_index)
        return (decoder_mask & causal_mask) if decoder_mask is not None else causal_mask

    def forward(self, x, padding_mask=None, cache=None, cache_update_index=0):
        attention_mask = self._compute_attention_mask(x, padding_mask, cache, cache_update_index)
        out, cache = self.attention(x, attention_mask=attention_mask, cache=cache,
                                    cache_update_index=cache_update_index)
        return x + out, cache


def main():
    torch.manual_seed(0)
    hidden_dim, max_length = 16, 12
    block = GemmaDecoderBlock(hidden_dim, head_dim=8, num_query_heads=4, num_key_value_heads=2,
                              use_sliding_window_attention=True, sliding_window_size=4).eval()
    x = torch.randn(2, max_length, hidden_dim)
    # prompts of 8 and 6 tokens, right padded to max_length
    padding_mask = torch.arange(max_length)[None, :] < torch.tensor([[8], [6]])
    cache = torch.zeros(2, 2, max_length, 2, 8)
    with torch.no_grad():
        _, cache = block(x, padding_mask=padding_mask, cache=cache, cache_update_index=0)
        # generation steps from the shortest prompt's end, as the sampler does: a row whose prompt is longer
        # feeds its prompt token at that index
        for index in range(6, 9):
            step_mask = torch.arange(max_length)[None, :].expand(2, -1) <= index
            y, cache = block(x[:, index:index + 1], padding_mask=step_mask, cache=cache, cache_update_index=index)
    print("decode out[:, 0, :3]:", [[round(v, 4) for v in row[0, :3].tolist()] for row in y])


if __name__ == "__main__":
    main()
