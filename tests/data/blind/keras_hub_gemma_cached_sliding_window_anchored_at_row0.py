"""KerasNLP Gemma (torch backend): cached decoding builds the sliding-window band from row 0, not the cache index.

Citation: keras-team/keras-hub (then keras-nlp) PR #1738 ("Sliding window fixes", commit 94283d6),
`keras_nlp/src/models/gemma/gemma_attention.py`, `CachedGemmaAttention._compute_attention`. Ported
from the Keras 3 ops to PyTorch (the jax/torch branch of the code), keeping the layer's structure:
`compute_causal_mask(batch, input_length, output_length, cache_index)`, a fixed-length cache updated
with `slice_update` at `cache_update_index`, einsum scores and a masked softmax.

Bug: for sliding-window layers the band was `triu(ones_like(mask), -w + 1) * tril(ones_like(mask), w - 1)`
on the `(batch, query_len, key_len)` mask itself. During cached generation `query_len == 1`, so the band
is that of row 0: it keeps keys `0 .. w - 1`, whatever the position being generated. Once generation
passes the window, each new token attends the first `w` tokens of the sequence instead of the last `w`.
(The TensorFlow branch had a different, worse variant; the maintainer notes jax/torch were hit for
generations longer than the 4096 window.)

Fix: build the band on a square `(key_len, key_len)` matrix and slice the rows starting at
`cache_update_index` (`_mask_sliding_window`).

Reproduction: Gemma2-like layer with `sliding_window_size = 4`, a 3-token prompt prefilled into a
cache of `max_length = 10`, then single-token decode steps at cache indices 3 .. 8.
"""
import sys
from dataclasses import dataclass

import numpy as np
import torch

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


@dataclass
class GemmaBackboneConfig:
    vocabulary_size: int = 64
    hidden_dim: int = 32
    num_query_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 8
    query_head_dim_normalize: bool = True
    use_sliding_window_attention: bool = True
    sliding_window_size: int = 4


def compute_causal_mask(batch_size, input_length, output_length, cache_index=0):
    i = torch.arange(output_length, dtype=torch.float32) + float(cache_index)
    i = i[:, None]
    j = torch.arange(input_length, dtype=torch.float32)
    mask = (i >= j)[None]
    return mask.expand(batch_size, output_length, input_length)


class CachedGemmaAttention(torch.nn.Module):
    def __init__(self, config: GemmaBackboneConfig):
        super().__init__()
        self.head_dim = config.head_dim
        self.hidden_dim = config.hidden_dim
        self.num_query_heads = config.num_query_heads
        self.num_key_value_heads = config.num_key_value_heads
        self.query_head_dim_normalize = config.query_head_dim_normalize
        self.use_sliding_window_attention = config.use_sliding_window_attention
        self.sliding_window_size = config.sliding_window_size
        self.query_dense = torch.nn.Linear(config.hidden_dim, config.num_query_heads * config.head_dim, bias=False)
        self.key_dense = torch.nn.Linear(config.hidden_dim, config.num_key_value_heads * config.head_dim, bias=False)
        self.value_dense = torch.nn.Linear(config.hidden_dim, config.num_key_value_heads * config.head_dim, bias=False)
        self.output_dense = torch.nn.Linear(config.num_query_heads * config.head_dim, config.hidden_dim, bias=False)

    def _mask_sliding_window(self, attention_mask, cache_update_index=0):
        batch_size, query_len, key_len = attention_mask.shape
        # Compute the sliding window for square attention.
        all_ones = torch.ones((key_len, key_len), dtype=torch.bool)
        sliding_mask = torch.triu(all_ones, -1 * self.sliding_window_size + 1) * torch.tril(
            all_ones, self.sliding_window_size - 1)
        # Slice the window for short queries during generation.
        sliding_mask = sliding_mask[cache_update_index:cache_update_index + query_len, :key_len]
        return torch.logical_and(attention_mask, sliding_mask[None])

    def _compute_attention(self, q, k, v, attention_mask, cache_update_index=0):
        if self.query_head_dim_normalize:
            query_normalization = 1 / np.sqrt(self.head_dim)
        else:
            query_normalization = 1 / np.sqrt(self.hidden_dim // self.num_query_heads)
        q = q * query_normalization
        b, q_len = q.shape[:2]
        q = q.reshape(b, q_len, self.num_key_value_heads, self.num_query_heads // self.num_key_value_heads, -1)
        attention_logits = torch.einsum("btkgh,bskh->bkgts", q, k)

        if self.use_sliding_window_attention:
            if FIXED:
                attention_mask = self._mask_sliding_window(attention_mask, cache_update_index=cache_update_index)
            else:
                all_ones = torch.ones_like(attention_mask, dtype=torch.float32)
                sliding_mask = torch.triu(all_ones, -1 * self.sliding_window_size + 1) * torch.tril(
                    all_ones, self.sliding_window_size - 1)
                attention_mask = sliding_mask * attention_mask

        attention_mask = attention_mask[:, None, None, :, :].bool()
        # keras.layers.Softmax(mask=...): masked logits pushed to a large negative value
        attention_logits = attention_logits.masked_fill(~attention_mask, -1e9)
        attention_softmax = torch.softmax(attention_logits, dim=-1)
        results = torch.einsum("bkgts,bskh->btkgh", attention_softmax, v)
        return results.reshape(b, q_len, self.num_query_heads, -1)

    def forward(self, x, attention_mask, cache, cache_update_index):
        b, t, _ = x.shape
        query = self.query_dense(x).view(b, t, self.num_query_heads, self.head_dim)
        key_update = self.key_dense(x).view(b, t, self.num_key_value_heads, self.head_dim)
        value_update = self.value_dense(x).view(b, t, self.num_key_value_heads, self.head_dim)
        key = cache[:, 0].clone()
        value = cache[:, 1].clone()
        key[:, cache_update_index:cache_update_index + t] = key_update    # ops.slice_update
        value[:, cache_update_index:cache_update_index + t] = value_update
        cache = torch.stack((key, value), dim=1)
        attention_vec = self._compute_attention(query, key, value, attention_mask, cache_update_index)
        return self.output_dense(attention_vec.reshape(b, t, -1)), cache


class GemmaDecoderBlock(torch.nn.Module):
    def __init__(self, config):
        super().__init__()
        self.attention = CachedGemmaAttention(config)

    def _compute_attention_mask(self, x, cache, cache_update_index):
        batch_size = x.shape[0]
        input_length = output_length = x.shape[1]
        if cache is not None:
            input_length = cache.shape[2]
        return compute_causal_mask(batch_size, input_length, output_length, cache_update_index)

    def forward(self, x, cache, cache_update_index):
        attention_mask = self._compute_attention_mask(x, cache, cache_update_index)
        out, cache = self.attention(x, attention_mask, cache, cache_update_index)
        return x + out, cache


def main():
    config = GemmaBackboneConfig()
    embed = torch.nn.Embedding(config.vocabulary_size, config.hidden_dim)
    block = GemmaDecoderBlock(config)
    head = torch.nn.Linear(config.hidden_dim, config.vocabulary_size, bias=False)
    batch_size, max_length, prompt_len = 1, 10, 3
    cache = torch.zeros(batch_size, 2, max_length, config.num_key_value_heads, config.head_dim)
    tokens = torch.randint(0, config.vocabulary_size, (batch_size, prompt_len)).tolist()[0]
    with torch.no_grad():
        x, cache = block(embed(torch.tensor([tokens])), cache, 0)
        next_token = int(head(x[:, -1]).argmax())
        for index in range(prompt_len, max_length - 1):
            tokens.append(next_token)
            x, cache = block(embed(torch.tensor([[next_token]])), cache, index)
            next_token = int(head(x[:, -1]).argmax())
    print("generated", tokens[prompt_len:])


if __name__ == "__main__":
    main()
