"""transformers masking_utils: Llama4 chunked attention starts chunks at the padded index, not the sequence start.

Citation: huggingface/transformers PR #40324 ("Fix chunked attention mask with left-padding"), fixing
issue #40214. The pre-fix overlay survives in later releases as `_legacy_chunked_overlay` (kept for
torch < 2.6); the fixed `chunked_overlay(chunk_size, left_padding)` and the `left_padding_tokens`
computation in `create_chunked_causal_mask` are read from `src/transformers/masking_utils.py`.

Bug: Llama4 "chunked_attention" layers let a token attend only to earlier tokens of its own
`attention_chunk_size` chunk. `chunked_overlay` compared `kv_idx // chunk_size == q_idx // chunk_size`
on the padded (cache) index, so in a left-padded batch the chunk boundaries of a padded row are shifted
by its number of pad tokens: its tokens are grouped with the wrong neighbours, both at prefill and in
the decode steps that follow.

Fix: count the left padding per row, `left_padding_tokens = (attention_mask.cumsum(-1) == 0).sum(-1)`,
and compare `(kv_idx - left_padding[b]) // chunk_size == (q_idx - left_padding[b]) // chunk_size`.

Reproduction: the masking_utils mask functions and an sdpa-style mask interface (index grids, AND with the
2D padding mask), a Llama4-like chunked attention layer (`attention_chunk_size = 4`) calling
`F.scaled_dot_product_attention`, a left-padded batch of prompts of 7 and 10 tokens, prefill then one
cached decode step.
"""
import sys
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


@dataclass
class Llama4TextConfig:
    hidden_size: int = 32
    num_attention_heads: int = 2
    head_dim: int = 16
    attention_chunk_size: int = 4
    vocab_size: int = 64
    pad_token_id: int = 0
    _attn_implementation: str = "sdpa"


def and_masks(*mask_functions: Callable) -> Callable:
    def and_mask(batch_idx, head_idx, q_idx, kv_idx):
        result = q_idx.new_ones((), dtype=torch.bool)
        for mask in mask_functions:
            result = result & mask(batch_idx, head_idx, q_idx, kv_idx)
        return result
    return and_mask


def causal_mask_function(batch_idx, head_idx, q_idx, kv_idx):
    return kv_idx <= q_idx


def chunked_overlay(chunk_size: int, left_padding: torch.Tensor) -> Callable:
    def inner_mask(batch_idx, head_idx, q_idx, kv_idx):
        if FIXED:
            return (kv_idx - left_padding[batch_idx]) // chunk_size == (q_idx - left_padding[batch_idx]) // chunk_size
        return kv_idx // chunk_size == q_idx // chunk_size
    return inner_mask


def chunked_causal_mask_function(chunk_size: int, left_padding: torch.Tensor) -> Callable:
    return and_masks(chunked_overlay(chunk_size, left_padding), causal_mask_function)


def padding_mask_function(padding_mask: torch.Tensor) -> Callable:
    def inner_mask(batch_idx, head_idx, q_idx, kv_idx):
        return padding_mask[batch_idx, kv_idx]
    return inner_mask


def sdpa_mask(batch_size, cache_position, kv_length, kv_offset, mask_function, attention_mask):
    """Evaluate the mask function on broadcast index grids -> bool (batch, 1, q, kv)."""
    kv_arange = torch.arange(kv_length) + kv_offset
    if attention_mask is not None:
        mask_function = and_masks(mask_function, padding_mask_function(attention_mask.bool()))
    b = torch.arange(batch_size)[:, None, None, None]
    h = torch.arange(1)[None, :, None, None]
    return mask_function(b, h, cache_position[None, None, :, None], kv_arange[None, None, None, :])


def create_chunked_causal_mask(config, input_embeds, attention_mask, cache_position, past_key_values):
    kv_length = past_key_values.get_seq_length() + input_embeds.shape[1]
    batch_size = input_embeds.shape[0]
    chunk_size = config.attention_chunk_size
    # Only count the left padding tokens, not all of them
    left_padding_tokens = (attention_mask.cumsum(dim=-1) == torch.zeros_like(attention_mask)).sum(dim=-1)
    mask_factory_function = chunked_causal_mask_function(chunk_size, left_padding_tokens)
    return sdpa_mask(batch_size, cache_position, kv_length, 0, mask_factory_function, attention_mask)


class DynamicCache:
    def __init__(self):
        self.keys, self.values = None, None

    def get_seq_length(self):
        return 0 if self.keys is None else self.keys.shape[-2]

    def update(self, k, v):
        self.keys = k if self.keys is None else torch.cat([self.keys, k], dim=-2)
        self.values = v if self.values is None else torch.cat([self.values, v], dim=-2)
        return self.keys, self.values


class Llama4TextAttention(torch.nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.num_heads, self.head_dim = config.num_attention_heads, config.head_dim
        self.q_proj = torch.nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = torch.nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.v_proj = torch.nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=False)

    def forward(self, hidden_states, attention_mask, past_key_values):
        bsz, q_len, _ = hidden_states.shape
        shape = (bsz, q_len, self.num_heads, self.head_dim)
        q = self.q_proj(hidden_states).view(shape).transpose(1, 2)
        k = self.k_proj(hidden_states).view(shape).transpose(1, 2)
        v = self.v_proj(hidden_states).view(shape).transpose(1, 2)
        k, v = past_key_values.update(k, v)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask)
        return out.transpose(1, 2).reshape(bsz, q_len, -1)


def main():
    config = Llama4TextConfig()
    embed = torch.nn.Embedding(config.vocab_size, config.hidden_size)
    attn = Llama4TextAttention(config)
    lengths = [7, 10]
    max_len = max(lengths)
    input_ids = torch.full((2, max_len), config.pad_token_id)
    attention_mask = torch.zeros(2, max_len, dtype=torch.long)
    for i, n in enumerate(lengths):    # tokenizer(padding_side="left")
        input_ids[i, max_len - n:] = torch.randint(1, config.vocab_size, (n,))
        attention_mask[i, max_len - n:] = 1
    cache = DynamicCache()
    with torch.no_grad():
        h = embed(input_ids)
        cache_position = torch.arange(max_len)
        mask = create_chunked_causal_mask(config, h, attention_mask, cache_position, cache)
        out = attn(h, mask, cache)
        # one decode step
        next_ids = torch.randint(1, config.vocab_size, (2, 1))
        attention_mask = torch.cat([attention_mask, torch.ones(2, 1, dtype=torch.long)], dim=-1)
        h = embed(next_ids)
        cache_position = torch.tensor([max_len])
        mask = create_chunked_causal_mask(config, h, attention_mask, cache_position, cache)
        step = attn(h, mask, cache)
    print("prefill checksum", round(float(out.abs().sum()), 4), "decode checksum", round(float(step.abs().sum()), 4))


if __name__ == "__main__":
    main()
