"""lalamo DynamicKVCacheLayer: causal sliding window built on suffix-local rows (torch port of JAX code).

Citation: trymirai/lalamo#200 "Fix dynamic sliding-window KV cache mask for multi-token causal decode"
(merged 2026-04-05). PR text: "Previously, the dynamic KV cache built the sliding-window mask with
tril/triu based on suffix-local row indices. That was incorrect when a prefix KV cache was already
present, because the visible window should be defined in terms of absolute query/key positions. As a
result, for models using sliding-window attention: single-token sequential decode [and] multi-token
causal decode could attend to different key sets".

Bug (pre-fix lalamo/modules/token_mixers/state/kv_cache.py, read from upstream at commit f5b4ade):
    result = jnp.tril(result, k=total_num_tokens - suffix_length)
    if sliding_window_size is not None:
        result = jnp.triu(result, k=1 - sliding_window_size)
The causal band is offset by the cached prefix, the window band is not: a query of a suffix that
follows a cached prefix sees every older key (a single decode token sees the whole history).
Fix (post-fix file): absolute positions, `query_positions = num_tokens + arange(suffix_length) -
suffix_length_without_padding`, `result = query_positions[:, None] >= key_positions[None, :]` and,
with a window, `& (query_positions[:, None] < key_positions[None, :] + sliding_window_size)`.

This program: the JAX/equinox cache layer ported to torch as the project wrote it (immutable layer,
`init` / `extend` / `attention_mask`), a two-layer decoder whose layers alternate sliding
(`sliding_window_size=4`) and global attention, a 6-token prefill, a 3-token multi-token step
(speculative verification of drafted tokens) and one single-token step.
"""
import sys
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv

torch.manual_seed(0)


@dataclass(frozen=True)
class DynamicKVCacheLayer:
    has_sinks: bool
    keys: torch.Tensor  # [tokens, groups, head_channels]
    values: torch.Tensor
    padding_mask: Optional[torch.Tensor] = None

    @classmethod
    def init(cls, has_sinks, keys, values, length=None):
        num_tokens, num_groups, head_dim = keys.shape
        padding_mask = None if length is None else torch.arange(num_tokens) < length
        if has_sinks:
            sinks = torch.zeros((1, num_groups, head_dim), dtype=keys.dtype)
            keys = torch.cat([sinks, keys], dim=0)
            values = torch.cat([sinks, values], dim=0)
            if padding_mask is not None:
                padding_mask = torch.cat([torch.ones(1, dtype=torch.bool), padding_mask], dim=0)
        return cls(has_sinks, keys, values, padding_mask)

    def attention_mask(self, suffix_length, is_causal, suffix_length_without_padding=None,
                       sliding_window_size=None):
        total_num_tokens, _, _ = self.keys.shape
        if suffix_length_without_padding is None:
            suffix_length_without_padding = suffix_length
        result = torch.ones((suffix_length, total_num_tokens), dtype=torch.bool)
        if is_causal and not FIXED:
            result = torch.tril(result, diagonal=total_num_tokens - suffix_length)
            if sliding_window_size is not None:
                result = torch.triu(result, diagonal=1 - sliding_window_size)
        elif is_causal:
            query_offsets = torch.arange(0, suffix_length, dtype=torch.int32) - suffix_length_without_padding
            query_positions = total_num_tokens + query_offsets
            key_positions = torch.arange(total_num_tokens, dtype=torch.int32)
            result = query_positions[:, None] >= key_positions[None, :]
            if sliding_window_size is not None:
                result = result & (query_positions[:, None] < (key_positions[None, :] + sliding_window_size))
        elif sliding_window_size is not None:
            top_zeroed = torch.tril(result, diagonal=sliding_window_size // 2)
            result = torch.triu(top_zeroed, diagonal=-sliding_window_size // 2)
        if self.has_sinks:
            result[:, 0] = True
        if self.padding_mask is not None:
            result = result & self.padding_mask[None, :]
        return result

    def extend(self, added_keys, added_values, added_length=None):
        updated_keys = torch.cat([self.keys, added_keys], dim=0)
        updated_values = torch.cat([self.values, added_values], dim=0)
        if self.padding_mask is None and added_length is None:
            return DynamicKVCacheLayer(self.has_sinks, updated_keys, updated_values)
        added_padded_length = added_keys.shape[0]
        if added_length is None:
            added_length = added_padded_length
        old = self.padding_mask if self.padding_mask is not None else torch.ones(self.keys.shape[0], dtype=torch.bool)
        added = torch.arange(added_padded_length) < added_length
        return DynamicKVCacheLayer(self.has_sinks, updated_keys, updated_values, torch.cat([old, added]))


@dataclass
class AttentionConfig:
    num_heads: int = 4
    num_groups: int = 2
    head_dim: int = 8
    is_causal: bool = True
    sliding_window_size: Optional[int] = None
    has_sinks: bool = False


class Attention(torch.nn.Module):
    def __init__(self, config: AttentionConfig, model_dim: int):
        super().__init__()
        self.config = config
        c = config
        self.qkv_projection = torch.nn.Linear(model_dim, (c.num_heads + 2 * c.num_groups) * c.head_dim, bias=False)
        self.out_projection = torch.nn.Linear(c.num_heads * c.head_dim, model_dim, bias=False)

    def forward(self, inputs, state: Optional[DynamicKVCacheLayer]):
        c = self.config
        suffix_length = inputs.shape[0]
        q, k, v = self.qkv_projection(inputs).split(
            [c.num_heads * c.head_dim, c.num_groups * c.head_dim, c.num_groups * c.head_dim], dim=-1)
        q = q.view(suffix_length, c.num_heads, c.head_dim)
        k = k.view(suffix_length, c.num_groups, c.head_dim)
        v = v.view(suffix_length, c.num_groups, c.head_dim)
        if state is None:
            state = DynamicKVCacheLayer.init(c.has_sinks, k, v)
        else:
            state = state.extend(k, v)
        mask = state.attention_mask(suffix_length, c.is_causal, sliding_window_size=c.sliding_window_size)
        # [tokens, heads, dim] -> [heads, tokens, dim]
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1), state.keys.transpose(0, 1), state.values.transpose(0, 1),
            attn_mask=mask, enable_gqa=True)
        return self.out_projection(out.transpose(0, 1).reshape(suffix_length, -1)), state


class Decoder(torch.nn.Module):
    def __init__(self, vocab_size=64, model_dim=32, sliding_window_sizes=(4, None)):
        super().__init__()
        self.embedding = torch.nn.Embedding(vocab_size, model_dim)
        self.layers = torch.nn.ModuleList(
            Attention(AttentionConfig(sliding_window_size=w), model_dim) for w in sliding_window_sizes)
        self.readout = torch.nn.Linear(model_dim, vocab_size, bias=False)

    def forward(self, token_ids, state=None):
        x = self.embedding(token_ids)
        state = list(state) if state is not None else [None] * len(self.layers)
        for i, layer in enumerate(self.layers):
            out, state[i] = layer(x, state[i])
            x = x + out
        return self.readout(x), tuple(state)


def main():
    model = Decoder().eval()
    with torch.no_grad():
        logits, state = model(torch.tensor([4, 17, 9, 33, 2, 41]))
        # verify three drafted tokens at once (speculative decoding), then one normal step
        draft = torch.tensor([12, 5, 28])
        logits, state = model(draft, state)
        accepted = logits.argmax(-1)
        logits, state = model(accepted[-1:], state)
    print("verify argmax:", accepted.tolist(), "next:", logits.argmax(-1).tolist())


if __name__ == "__main__":
    main()
