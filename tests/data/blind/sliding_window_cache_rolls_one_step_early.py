"""transformers SlidingWindowCache (Mistral, v4.5x): the ring buffer rolls one step early.

Citation: huggingface/transformers#37574 "Wrong KV cache update for sliding-window attention
(SWA) layers when total sequence length reaches window size" (bug label, closed; a maintainer
confirmed the linked PR fixes it). I read the issue, not the fix diff: the fixed branch below
is written to produce exactly the cache states the issue lists as expected behaviour.

``SlidingWindowCache.update`` keeps a ring of ``max_cache_len = sliding_window`` slots. On each
decode step it computes ``to_shift = cache_position >= max_cache_len - 1`` (after clamping), so it
already rolls the buffer when it writes position ``window - 1``, the last free slot: the oldest key
(position 0) is dropped while it is still inside the window, and the slot that has never been
written (all zeros) rolls into place and stays. The causal mask, built by
``_prepare_4d_causal_attention_mask_with_cache_position`` against ``target_length =
max_cache_len``, marks every slot visible once the cache is full, so the decode query attends to a
zero key that stands for no token and misses a key its window contains. The fix rolls only when
the write position is past the end of the buffer.

This program: Mistral-style config (sliding_window 8), the cache class, the mask builder and an
SDPA attention layer; a prefill of 6 tokens, then 3 decode steps (positions 6, 7, 8).
"""
import sys
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


@dataclass
class MistralConfig:
    vocab_size: int = 64
    hidden_size: int = 32
    num_attention_heads: int = 4
    sliding_window: int = 8


class SlidingWindowCache:
    def __init__(self, config: MistralConfig, batch_size: int, num_layers: int):
        self.max_cache_len = config.sliding_window
        head_dim = config.hidden_size // config.num_attention_heads
        shape = (batch_size, config.num_attention_heads, self.max_cache_len, head_dim)
        self.key_cache = [torch.zeros(shape) for _ in range(num_layers)]
        self.value_cache = [torch.zeros(shape) for _ in range(num_layers)]

    def update(self, key_states, value_states, layer_idx, cache_kwargs):
        cache_position = cache_kwargs.get("cache_position")
        k_out = self.key_cache[layer_idx]
        v_out = self.value_cache[layer_idx]
        if cache_position.shape[0] > self.max_cache_len:
            k_out = key_states[:, :, -self.max_cache_len :, :]
            v_out = value_states[:, :, -self.max_cache_len :, :]
            self.key_cache[layer_idx] += k_out
            self.value_cache[layer_idx] += v_out
            return key_states, value_states

        slicing = torch.ones(self.max_cache_len, dtype=torch.long).cumsum(0)
        if FIXED:
            to_shift = cache_position >= self.max_cache_len
            cache_position = cache_position.clamp(0, self.max_cache_len - 1)
        else:
            cache_position = cache_position.clamp(0, self.max_cache_len - 1)
            to_shift = cache_position >= self.max_cache_len - 1
        indices = (slicing + to_shift[-1].int() - 1) % self.max_cache_len
        k_out = k_out[:, :, indices]
        v_out = v_out[:, :, indices]
        k_out.index_copy_(2, cache_position, key_states)
        v_out.index_copy_(2, cache_position, value_states)
        self.key_cache[layer_idx].zero_()
        self.value_cache[layer_idx].zero_()
        self.key_cache[layer_idx] += k_out
        self.value_cache[layer_idx] += v_out
        return k_out, v_out


def _prepare_4d_causal_attention_mask_with_cache_position(attention_mask, sequence_length, target_length, dtype,
                                                          cache_position, batch_size, config, past_key_values):
    min_dtype = torch.finfo(dtype).min
    causal_mask = torch.full((sequence_length, target_length), fill_value=min_dtype, dtype=dtype)
    diagonal_attend_mask = torch.arange(target_length) > cache_position.reshape(-1, 1)
    if config.sliding_window is not None:
        # if we have sliding window, we should not attend to tokens beyond sliding window length, so we
        # mask them out also; the check is needed to verify is current checkpoint was trained with sliding window or not
        if not isinstance(past_key_values, SlidingWindowCache) or sequence_length > target_length:
            sliding_attend_mask = torch.arange(target_length) <= (cache_position.reshape(-1, 1) - config.sliding_window)
            diagonal_attend_mask.bitwise_or_(sliding_attend_mask)
    causal_mask *= diagonal_attend_mask
    causal_mask = causal_mask[None, None, :, :].expand(batch_size, 1, -1, -1)
    if attention_mask is not None:
        causal_mask = causal_mask.clone()
        if attention_mask.shape[-1] > target_length:
            attention_mask = attention_mask[:, :target_length]
        mask_length = attention_mask.shape[-1]
        padding_mask = causal_mask[:, :, :, :mask_length] + attention_mask[:, None, None, :].to(causal_mask.dtype)
        padding_mask = padding_mask == 0
        causal_mask[:, :, :, :mask_length] = causal_mask[:, :, :, :mask_length].masked_fill(padding_mask, min_dtype)
    return causal_mask


class MistralAttention(nn.Module):
    def __init__(self, config: MistralConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.q_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=False)
        self.o_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=False)

    def forward(self, hidden_states, attention_mask, past_key_value, cache_position):
        bsz, q_len, _ = hidden_states.shape
        q = self.q_proj(hidden_states).view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(hidden_states).view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(hidden_states).view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        k, v = past_key_value.update(k, v, self.layer_idx, {"cache_position": cache_position})
        causal_mask = attention_mask[:, :, :, : k.shape[-2]]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=causal_mask)
        return self.o_proj(out.transpose(1, 2).reshape(bsz, q_len, -1))


class MistralModel(nn.Module):
    def __init__(self, config: MistralConfig):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([MistralAttention(config, 0)])
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids, attention_mask, past_key_values, cache_position):
        h = self.embed_tokens(input_ids)
        causal_mask = _prepare_4d_causal_attention_mask_with_cache_position(
            attention_mask, sequence_length=input_ids.shape[1], target_length=past_key_values.max_cache_len,
            dtype=h.dtype, cache_position=cache_position, batch_size=input_ids.shape[0], config=self.config,
            past_key_values=past_key_values,
        )
        for layer in self.layers:
            h = h + layer(h, causal_mask, past_key_values, cache_position)
        return self.lm_head(h)


def main():
    torch.manual_seed(0)
    config = MistralConfig()
    model = MistralModel(config).eval()
    cache = SlidingWindowCache(config, batch_size=1, num_layers=1)
    prompt = torch.randint(0, 64, (1, 6))
    attention_mask = torch.ones(1, 6, dtype=torch.long)
    generated = []
    with torch.no_grad():
        logits = model(prompt, attention_mask, cache, torch.arange(6))
        next_token = logits[:, -1:].argmax(-1)
        for pos in range(6, 9):
            attention_mask = torch.cat([attention_mask, torch.ones(1, 1, dtype=torch.long)], dim=-1)
            logits = model(next_token, attention_mask, cache, torch.tensor([pos]))
            generated.append(round(float(logits[0, -1, 0]), 4))
            next_token = logits[:, -1:].argmax(-1)
    print("decode logits[0] at positions 6, 7, 8:", generated)


if __name__ == "__main__":
    main()
