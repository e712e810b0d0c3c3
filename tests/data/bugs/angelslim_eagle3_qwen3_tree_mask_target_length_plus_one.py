"""AngelSlim EAGLE-3 target Qwen3: the verify-step tree mask lands one column right of the draft keys.

Citation: Tencent/AngelSlim PR #62, "Fix tree mask conflict" (merged, commit 91cd578); description and
the diff of angelslim/compressor/speculative/inference/models/eagle3/target/modeling_qwen3_kv.py read,
and the parent version of `_update_causal_mask`, `eager_attention_forward` and the KV-cache `cat`.

Bug: with no 2D attention_mask (EAGLE's verify call), `_update_causal_mask` set
`target_length = past_seen_tokens + sequence_length + 1`, one column more than the keys. The causal mask
is built for that width, then `self.tree_mask` is written into its last `tree_len` x `tree_len` block,
and `eager_attention_forward` slices the mask to `key_states.shape[-2]`: every tree constraint applies
to the key one to the left of its draft token, so a draft token sees its sibling / cousin and may lose
its own ancestor. (The PR also notes the tree mask already contains the causal part.)

Fix: `target_length = past_seen_tokens + sequence_length`; when sequence_length != target_length (tree
verification) start from zeros and apply the tree mask alone.

Reproduction: a two-layer Qwen3-like target model with EAGLE's preallocated KVCache (`cat`,
`current_length`), a prefill of 5 tokens, then verification of a 4-node draft tree
(root; a, b children of root; c child of a) with `model.tree_mask` set as EAGLE does.
"""
import sys
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv


@dataclass
class Qwen3Config:
    vocab_size: int = 64
    hidden_size: int = 32
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 8
    num_hidden_layers: int = 2
    sliding_window: Optional[int] = None
    _attn_implementation: str = "eager"


class KVCache:
    """EAGLE's preallocated cache: `cat` copies into `data` and returns the filled prefix."""

    def __init__(self, data: torch.Tensor, current_length: torch.Tensor):
        self.data = data
        self.current_length = current_length

    def cat(self, tensor: torch.Tensor, dim: int = 2):
        dst = self.data.narrow(dim, int(self.current_length), tensor.shape[dim])
        dst.copy_(tensor)
        self.current_length.add_(tensor.shape[dim])
        return torch.narrow(self.data, 2, 0, int(self.current_length))


def initialize_past_key_values(config: Qwen3Config, max_length: int = 32):
    data = torch.zeros(config.num_hidden_layers * 2, 1, config.num_key_value_heads, max_length,
                       config.head_dim)
    current_length_data = torch.zeros(config.num_hidden_layers * 2, dtype=torch.long)
    return [[KVCache(data[2 * i + j], current_length_data[2 * i + j]) for j in range(2)]
            for i in range(config.num_hidden_layers)]


def repeat_kv(hidden_states, n_rep):
    batch, num_key_value_heads, slen, head_dim = hidden_states.shape
    if n_rep == 1:
        return hidden_states
    hidden_states = hidden_states[:, :, None, :, :].expand(batch, num_key_value_heads, n_rep, slen,
                                                           head_dim)
    return hidden_states.reshape(batch, num_key_value_heads * n_rep, slen, head_dim)


def eager_attention_forward(module, query, key, value, attention_mask, scaling):
    key_states = repeat_kv(key, module.num_key_value_groups)
    value_states = repeat_kv(value, module.num_key_value_groups)
    attn_weights = torch.matmul(query, key_states.transpose(2, 3)) * scaling
    if attention_mask is not None:
        causal_mask = attention_mask[:, :, :, : key_states.shape[-2]]
        attn_weights = attn_weights + causal_mask
    attn_weights = nn.functional.softmax(attn_weights, dim=-1, dtype=torch.float32).to(query.dtype)
    attn_output = torch.matmul(attn_weights, value_states)
    return attn_output.transpose(1, 2).contiguous(), attn_weights


class Qwen3Attention(nn.Module):
    def __init__(self, config: Qwen3Config, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = self.head_dim ** -0.5
        self.q_proj = nn.Linear(config.hidden_size, config.num_attention_heads * self.head_dim)
        self.k_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * self.head_dim)
        self.v_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * self.head_dim)
        self.o_proj = nn.Linear(config.num_attention_heads * self.head_dim, config.hidden_size)

    def forward(self, hidden_states, attention_mask, past_key_value=None):
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        query_states = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        key_states = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        if past_key_value is not None:
            past_key, past_value = past_key_value[self.layer_idx]
            key_states = past_key.cat(key_states)
            value_states = past_value.cat(value_states)
        attn_output, _ = eager_attention_forward(self, query_states, key_states, value_states,
                                                 attention_mask, self.scaling)
        return self.o_proj(attn_output.reshape(*input_shape, -1))


class Qwen3Model(nn.Module):
    def __init__(self, config: Qwen3Config):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Qwen3Attention(config, i) for i in range(config.num_hidden_layers))
        self.tree_mask = None

    def forward(self, input_ids, attention_mask=None, past_key_values=None, position_ids=None,
                cache_position=None):
        inputs_embeds = self.embed_tokens(input_ids)
        if cache_position is None:
            past_seen_tokens = (int(past_key_values[0][0].current_length)
                                if past_key_values is not None else 0)
            cache_position = torch.arange(past_seen_tokens,
                                          past_seen_tokens + inputs_embeds.shape[1])
        causal_mask = self._update_causal_mask(attention_mask, inputs_embeds, cache_position,
                                               past_key_values)
        hidden_states = inputs_embeds
        for layer in self.layers:
            hidden_states = hidden_states + layer(hidden_states, causal_mask, past_key_values)
        return hidden_states

    def _update_causal_mask(self, attention_mask, input_tensor, cache_position, past_key_values):
        past_seen_tokens = (int(past_key_values[0][0].current_length)
                            if past_key_values is not None else 0)
        dtype, device = input_tensor.dtype, input_tensor.device
        sequence_length = input_tensor.shape[1]
        if isinstance(attention_mask, torch.Tensor):
            target_length = attention_mask.shape[-1]
        elif FIXED:
            target_length = past_seen_tokens + sequence_length
        else:
            target_length = past_seen_tokens + sequence_length + 1
        return self._prepare_4d_causal_attention_mask_with_cache_position(
            attention_mask, sequence_length=sequence_length, target_length=target_length,
            dtype=dtype, device=device, cache_position=cache_position,
            batch_size=input_tensor.shape[0], config=self.config)

    def _prepare_4d_causal_attention_mask_with_cache_position(
            self, attention_mask, sequence_length, target_length, dtype, device, cache_position,
            batch_size, config):
        min_dtype = torch.finfo(dtype).min
        if FIXED and sequence_length != target_length:
            causal_mask = torch.zeros((sequence_length, target_length), dtype=dtype, device=device)
            causal_mask = causal_mask[None, None, :, :].expand(batch_size, 1, -1, -1)
            if self.tree_mask is not None:
                tree_mask = self.tree_mask
                tree_len = tree_mask.size(-1)
                causal_mask[:, :, -tree_len:, -tree_len:][tree_mask == 0] = min_dtype
            return causal_mask
        causal_mask = torch.full((sequence_length, target_length), fill_value=min_dtype,
                                 dtype=dtype, device=device)
        diagonal_attend_mask = torch.arange(target_length, device=device) > cache_position.reshape(-1, 1)
        causal_mask *= diagonal_attend_mask
        causal_mask = causal_mask[None, None, :, :].expand(batch_size, 1, -1, -1)
        if attention_mask is not None:
            causal_mask = causal_mask.clone()
            mask_length = attention_mask.shape[-1]
            padding_mask = causal_mask[:, :, :, :mask_length] + attention_mask[:, None, None, :]
            padding_mask = padding_mask == 0
            causal_mask[:, :, :, :mask_length] = causal_mask[:, :, :, :mask_length].masked_fill(
                padding_mask, min_dtype)
        if not FIXED and self.tree_mask is not None:
            tree_mask = self.tree_mask
            tree_len = tree_mask.size(-1)
            causal_mask[:, :, -tree_len:, -tree_len:][tree_mask == 0] = causal_mask.min()
        return causal_mask


def main():
    torch.manual_seed(0)
    config = Qwen3Config()
    model = Qwen3Model(config).eval()
    past_key_values = initialize_past_key_values(config)
    input_ids = torch.randint(0, config.vocab_size, (1, 5))
    with torch.no_grad():
        model(input_ids, past_key_values=past_key_values)
        # Draft tree: 0 = root (last accepted token), 1 = a, 2 = b (children of root), 3 = c (child of a)
        tree_mask = torch.tensor([[1, 0, 0, 0],
                                  [1, 1, 0, 0],
                                  [1, 0, 1, 0],
                                  [1, 1, 0, 1]])[None, None]
        tree_position_ids = torch.tensor([0, 1, 1, 2])
        model.tree_mask = tree_mask
        tree_candidates = torch.randint(0, config.vocab_size, (1, 4))
        hidden = model(tree_candidates, past_key_values=past_key_values,
                       position_ids=(tree_position_ids + input_ids.shape[1]).unsqueeze(0))
        model.tree_mask = None
    print("verify hidden", tuple(hidden.shape), "sum %.4f" % hidden.sum().item())


if __name__ == "__main__":
    main()
