"""Gemma 2 + HybridCache (transformers 4.47): sliding layers sliced the wrong mask columns past the window.

Citation: huggingface/transformers#35681 "Fix mask slicing for models with HybridCache" (merged
2025-01-14). PR text: "mask slicing was wrong in all cases when the sequence length is larger than the
sliding window. It is currently broken and leads to garbage generation when using padding. This
fixes it."

Bug: `Gemma2DecoderLayer.forward` (eager/SDPA) bands the 4D mask (width `max_cache_len`, one column
per absolute position) with `torch.tril(..., diagonal=-self.sliding_window)` and then slices it only
`if attention_mask.shape[-1] <= 1`, which a [bs, 1, q, max_cache_len] mask never satisfies. The eager
attention then takes `attention_mask[:, :, :, :key_states.shape[-2]]`, i.e. the columns of absolute
positions 0..window-1, while the sliding layer's HybridCache holds the *last* `window` positions
(rolled). Once decoding passes the window, the columns describe other tokens: the window band and the
left padding land on the wrong keys.
Fix: `effective_seq_len = max(cache_position.shape[0], self.sliding_window)`,
`offset = max(0, last_cache_position - effective_seq_len)`, and
`attention_mask = attention_mask[:, :, :, offset : offset + effective_seq_len]`.
(Both sides written from my reading of the PR's diff excerpt and the 4.47/4.48 sources as I recall
them; I could not re-read the full diff here.)

This program: a two-layer Gemma-2-style model (layer 0 sliding with `config.sliding_window = 4`, layer
1 global), eager attention with logit softcapping, HybridCache with `_sliding_update`, a left-padded
batch (prompts of 5 and 3 real tokens in width 5), then four greedy decode steps.
"""
import math
import sys
from dataclasses import dataclass

import torch
from torch import nn

FIXED = "--fixed" in sys.argv

torch.manual_seed(0)


@dataclass
class Gemma2Config:
    vocab_size: int = 64
    hidden_size: int = 32
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 8
    num_hidden_layers: int = 2
    sliding_window: int = 4
    query_pre_attn_scalar: int = 8
    attn_logit_softcapping: float = 50.0
    pad_token_id: int = 0


class HybridCache:
    def __init__(self, config, batch_size, max_cache_len):
        self.max_cache_len = max_cache_len
        self.sliding_window = config.sliding_window
        self.is_sliding = [not bool(i % 2) for i in range(config.num_hidden_layers)]
        self.key_cache, self.value_cache = [], []
        for i in range(config.num_hidden_layers):
            length = min(config.sliding_window, max_cache_len) if self.is_sliding[i] else max_cache_len
            shape = (batch_size, config.num_key_value_heads, length, config.head_dim)
            self.key_cache.append(torch.zeros(shape))
            self.value_cache.append(torch.zeros(shape))

    def _sliding_update(self, cache_position, layer_idx, key_states, value_states, k_out, v_out, max_cache_len):
        if cache_position.shape[0] > max_cache_len:
            k_out = key_states[:, :, -max_cache_len:, :]
            v_out = value_states[:, :, -max_cache_len:, :]
            self.key_cache[layer_idx] += k_out
            self.value_cache[layer_idx] += v_out
            # we should return the whole states instead of k_out, v_out to take the whole prompt
            # into consideration when building kv cache instead of just throwing away tokens outside of the window
            return key_states, value_states
        slicing = torch.ones(max_cache_len, dtype=torch.long).cumsum(0)
        cache_position = cache_position.clamp(0, max_cache_len - 1)
        to_shift = cache_position >= max_cache_len - 1
        indices = (slicing + to_shift[-1].int() - 1) % max_cache_len
        k_out = k_out[:, :, indices]
        v_out = v_out[:, :, indices]
        k_out[:, :, cache_position] = key_states
        v_out[:, :, cache_position] = value_states
        self.key_cache[layer_idx].zero_()
        self.value_cache[layer_idx].zero_()
        self.key_cache[layer_idx] += k_out
        self.value_cache[layer_idx] += v_out
        return k_out, v_out

    def _static_update(self, cache_position, layer_idx, key_states, value_states, k_out, v_out):
        k_out[:, :, cache_position] = key_states
        v_out[:, :, cache_position] = value_states
        return k_out, v_out

    def update(self, key_states, value_states, layer_idx, cache_kwargs):
        cache_position = cache_kwargs["cache_position"]
        k_out, v_out = self.key_cache[layer_idx], self.value_cache[layer_idx]
        if self.is_sliding[layer_idx]:
            return self._sliding_update(cache_position, layer_idx, key_states, value_states, k_out, v_out,
                                        k_out.shape[2])
        return self._static_update(cache_position, layer_idx, key_states, value_states, k_out, v_out)


class Gemma2Attention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv, self.head_dim = (config.num_attention_heads, config.num_key_value_heads,
                                                      config.head_dim)
        self.num_key_value_groups = self.num_heads // self.num_kv
        self.scaling = config.query_pre_attn_scalar ** -0.5
        self.sliding_window = config.sliding_window if not bool(layer_idx % 2) else None
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv * self.head_dim, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)

    def forward(self, hidden_states, attention_mask, past_key_value, cache_position):
        b, s, _ = hidden_states.shape
        q = self.q_proj(hidden_states).view(b, s, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(hidden_states).view(b, s, self.num_kv, self.head_dim).transpose(1, 2)
        v = self.v_proj(hidden_states).view(b, s, self.num_kv, self.head_dim).transpose(1, 2)
        cache_kwargs = {"cache_position": cache_position, "sliding_window": self.sliding_window}
        k, v = past_key_value.update(k, v, self.layer_idx, cache_kwargs)
        k = k.repeat_interleave(self.num_key_value_groups, dim=1)
        v = v.repeat_interleave(self.num_key_value_groups, dim=1)
        attn_weights = torch.matmul(q, k.transpose(2, 3)) * self.scaling
        softcap = self.config.attn_logit_softcapping
        attn_weights = torch.tanh(attn_weights / softcap) * softcap
        if attention_mask is not None:  # no matter the length, we just slice it
            causal_mask = attention_mask[:, :, :, : k.shape[-2]]
            attn_weights = attn_weights + causal_mask
        attn_weights = nn.functional.softmax(attn_weights, dim=-1, dtype=torch.float32).to(q.dtype)
        out = torch.matmul(attn_weights, v).transpose(1, 2).reshape(b, s, -1)
        return self.o_proj(out)


class Gemma2DecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.config = config
        self.is_sliding = not bool(layer_idx % 2)
        self.sliding_window = config.sliding_window
        self.self_attn = Gemma2Attention(config, layer_idx)

    def forward(self, hidden_states, attention_mask, past_key_value, cache_position, last_cache_position):
        if self.is_sliding and attention_mask is not None:  # efficient SDPA and no padding
            min_dtype = torch.finfo(hidden_states.dtype).min
            sliding_window_mask = torch.tril(
                torch.ones_like(attention_mask, dtype=torch.bool), diagonal=-self.sliding_window)
            attention_mask = torch.where(sliding_window_mask, min_dtype, attention_mask)
            if FIXED:
                # In prefill, we may be larger than sliding window
                effective_seq_len = max(cache_position.shape[0], self.sliding_window)
                # In case we are beyond the sliding window, we need to correctly offset the mask slicing
                offset = max(0, last_cache_position - effective_seq_len)
                attention_mask = attention_mask[:, :, :, offset: offset + effective_seq_len]
            elif attention_mask.shape[-1] <= 1:  # when decoding
                attention_mask = attention_mask[:, :, :, -self.sliding_window:]
        return hidden_states + self.self_attn(hidden_states, attention_mask, past_key_value, cache_position)


class Gemma2ForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        self.layers = nn.ModuleList(Gemma2DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    @staticmethod
    def _prepare_4d_causal_attention_mask_with_cache_position(attention_mask, sequence_length, target_length,
                                                              dtype, cache_position, batch_size):
        min_dtype = torch.finfo(dtype).min
        causal_mask = torch.full((sequence_length, target_length), fill_value=min_dtype, dtype=dtype)
        if sequence_length != 1:
            causal_mask = torch.triu(causal_mask, diagonal=1)
        causal_mask *= torch.arange(target_length) > cache_position.reshape(-1, 1)
        causal_mask = causal_mask[None, None, :, :].expand(batch_size, 1, -1, -1)
        if attention_mask is not None:
            causal_mask = causal_mask.clone()
            mask_length = attention_mask.shape[-1]
            padding_mask = causal_mask[:, :, :, :mask_length] + attention_mask[:, None, None, :]
            padding_mask = padding_mask == 0
            causal_mask[:, :, :, :mask_length] = causal_mask[:, :, :, :mask_length].masked_fill(
                padding_mask, min_dtype)
        return causal_mask

    def forward(self, input_ids, attention_mask, past_key_values, cache_position):
        h = self.embed_tokens(input_ids) * self.config.hidden_size ** 0.5
        # used to slice the mask without data-dependent slicing later on
        last_cache_position = attention_mask.shape[-1]
        causal_mask = self._prepare_4d_causal_attention_mask_with_cache_position(
            attention_mask, input_ids.shape[1], past_key_values.max_cache_len, h.dtype, cache_position,
            input_ids.shape[0])
        for layer in self.layers:
            h = layer(h, causal_mask, past_key_values, cache_position, last_cache_position)
        return self.lm_head(h)


def main():
    config = Gemma2Config()
    model = Gemma2ForCausalLM(config).eval()
    input_ids = torch.tensor([[12, 40, 7, 33, 9],
                              [0, 0, 25, 17, 60]])
    attention_mask = (input_ids != config.pad_token_id).long()
    cache = HybridCache(config, batch_size=2, max_cache_len=16)
    cache_position = torch.arange(input_ids.shape[1])
    out = []
    with torch.no_grad():
        logits = model(input_ids, attention_mask, cache, cache_position)
        for _ in range(4):
            nxt = logits[:, -1].argmax(-1, keepdim=True)
            out.append(nxt)
            attention_mask = torch.cat([attention_mask, torch.ones_like(nxt)], dim=-1)
            cache_position = cache_position[-1:] + 1
            logits = model(nxt, attention_mask, cache, cache_position)
    print("generated:", torch.cat(out, -1).tolist())


if __name__ == "__main__":
    main()
