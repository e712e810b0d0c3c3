"""Llama 4 chunked attention: the chunked mask was built one position early during cached decoding.

Citation: huggingface/transformers#37414 "Fix Llama4 offset" (merged 2025-04-10), following the
chunked-attention reports in huggingface/transformers#37351 and #37329. PR text: "It's the same as
before + 1. Indeed, we need to add the +1 to match correctly the positions ... I used
`first_cache_position - attention_chunk_size + 1` ... we always have
`max(first_cache_position - attention_chunk_size + 1, 0) == max(last_cache_position + 1 - key_length, 0)`".

Bug: in `Llama4TextModel._update_causal_mask` the chunked mask is `create_chunked_attention_mask(
attention_chunk_size, start=start_idx, end=start_idx + key_length)` over absolute positions, while the
chunked layers' cache (HybridChunkedCache) holds the last `attention_chunk_size - 1` tokens plus the new
ones, i.e. absolute positions from `first_cache_position - attention_chunk_size + 1`. Before the fix
`start_idx` was one less, so every key was labelled with the position before its own and the chunk
boundaries moved by one: at a chunk's first token the query still saw the previous chunk's tail, and
later in the chunk it lost the chunk's first token.
Fix: `start_idx = max(first_cache_position - attention_chunk_size + 1, 0)`.
The post-fix code was read from upstream; the pre-fix line is "the same as before + 1" per the PR, and
`max(first_cache_position - attention_chunk_size, 0)` is that expression (I did not read the old line).

This program: a two-layer Llama4-style text model (layer 0 chunked, layer 1 global), eager attention,
`config.attention_chunk_size = 4`, a 6-token prompt then five greedy decode steps through a cache whose
chunked layer keeps `attention_chunk_size - 1` past tokens, as HybridChunkedCache does.
"""
import math
import sys
from dataclasses import dataclass

import torch
from torch import nn

FIXED = "--fixed" in sys.argv

torch.manual_seed(0)


@dataclass
class Llama4TextConfig:
    vocab_size: int = 64
    hidden_size: int = 32
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    num_hidden_layers: int = 2
    attention_chunk_size: int = 4
    no_rope_layers: tuple = (1, 0)  # 1 = rope + chunked (local) layer, 0 = global NoPE layer
    _attn_implementation: str = "eager"


class HybridChunkedCache:
    """Chunked layers keep the last `attention_chunk_size - 1` tokens plus the tokens being added."""

    def __init__(self, config, max_cache_len):
        self.max_cache_len = max_cache_len
        self.is_sliding = list(config.no_rope_layers)
        self.window = config.attention_chunk_size
        self.key_cache = [None] * config.num_hidden_layers
        self.value_cache = [None] * config.num_hidden_layers

    def get_max_cache_shape(self):
        return self.max_cache_len

    def update(self, key_states, value_states, layer_idx):
        if self.key_cache[layer_idx] is None:
            k, v = key_states, value_states
        else:
            k = torch.cat([self.key_cache[layer_idx], key_states], dim=-2)
            v = torch.cat([self.value_cache[layer_idx], value_states], dim=-2)
        if self.is_sliding[layer_idx]:
            self.key_cache[layer_idx] = k[:, :, -(self.window - 1):]
            self.value_cache[layer_idx] = v[:, :, -(self.window - 1):]
            if k.shape[-2] > self.window - 1 + key_states.shape[-2]:
                k = k[:, :, -(self.window - 1 + key_states.shape[-2]):]
                v = v[:, :, -(self.window - 1 + key_states.shape[-2]):]
            return k, v
        self.key_cache[layer_idx], self.value_cache[layer_idx] = k, v
        return k, v


class Llama4TextAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.num_heads, self.num_kv = config.num_attention_heads, config.num_key_value_heads
        self.num_key_value_groups = self.num_heads // self.num_kv
        self.use_rope = bool(config.no_rope_layers[layer_idx])
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv * self.head_dim, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)

    def forward(self, hidden_states, attention_mask, past_key_value):
        b, s, _ = hidden_states.shape
        q = self.q_proj(hidden_states).view(b, s, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(hidden_states).view(b, s, self.num_kv, self.head_dim).transpose(1, 2)
        v = self.v_proj(hidden_states).view(b, s, self.num_kv, self.head_dim).transpose(1, 2)
        k, v = past_key_value.update(k, v, self.layer_idx)
        k = k.repeat_interleave(self.num_key_value_groups, dim=1)
        v = v.repeat_interleave(self.num_key_value_groups, dim=1)
        attn_weights = torch.matmul(q, k.transpose(2, 3)) / math.sqrt(self.head_dim)
        causal_mask = attention_mask[:, :, :, : k.shape[-2]]
        attn_weights = attn_weights + causal_mask
        attn_weights = nn.functional.softmax(attn_weights, dim=-1, dtype=torch.float32).to(q.dtype)
        out = torch.matmul(attn_weights, v).transpose(1, 2).reshape(b, s, -1)
        return self.o_proj(out)


class Llama4TextModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Llama4TextAttention(config, i) for i in range(config.num_hidden_layers))
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def create_chunked_attention_mask(self, attention_chunk_size, start, end, device):
        """True where a query (row) and key (column) sit in the same chunk and the key is not ahead."""
        arange_vector = torch.arange(start, end, device=device)
        block_pos = torch.abs(
            arange_vector.unsqueeze(0) // attention_chunk_size - arange_vector.unsqueeze(1) // attention_chunk_size)
        token_pos = arange_vector.unsqueeze(0) - arange_vector.unsqueeze(1)
        mask = (block_pos == 0) & (token_pos <= 0)
        return mask.to(device)

    def _update_causal_mask(self, attention_mask, input_tensor, cache_position, past_key_values):
        attention_chunk_size = self.config.attention_chunk_size
        sequence_length = input_tensor.shape[1]
        first_cache_position = int(cache_position[0])
        full_cache_length = past_key_values.get_max_cache_shape() or sequence_length
        cond1 = first_cache_position >= attention_chunk_size
        cond2 = (first_cache_position < attention_chunk_size) and (
            first_cache_position + sequence_length > attention_chunk_size)
        key_length = (attention_chunk_size + sequence_length - 1 if cond1
                      else first_cache_position + sequence_length if cond2 else attention_chunk_size)

        dtype, device = input_tensor.dtype, input_tensor.device
        min_dtype = torch.finfo(dtype).min
        # global layers: causal over the whole history, with the 2D padding mask
        kv_len = attention_mask.shape[-1]
        causal_mask = torch.arange(kv_len, device=device)[None, :] > cache_position[:, None]
        causal_mask = causal_mask[None, None] | (attention_mask[:, None, None, :] == 0)
        causal_mask = torch.where(causal_mask, min_dtype, 0.0).to(dtype)

        chunked_attention_mask = None
        if full_cache_length > attention_chunk_size:
            if FIXED:
                start_idx = max(first_cache_position - attention_chunk_size + 1, 0)
            else:
                start_idx = max(first_cache_position - attention_chunk_size, 0)
            end_idx = start_idx + key_length
            chunked_attention_mask = self.create_chunked_attention_mask(
                attention_chunk_size, start=start_idx, end=end_idx, device=device)
            local_attention_mask = attention_mask[:, start_idx:end_idx]  # offset here as well
            # It may be smaller than attention_chunk_size -> pad it
            requires_padding = local_attention_mask.shape[-1] < attention_chunk_size
            if requires_padding:
                local_attention_mask = nn.functional.pad(
                    local_attention_mask, (0, attention_chunk_size - local_attention_mask.shape[-1]))
            # Depending on the padding, take the query tokens from the end or the cache_position
            if not requires_padding:
                chunked_attention_mask = chunked_attention_mask[None, None, -sequence_length:, :]
            else:
                chunked_attention_mask = chunked_attention_mask[None, None, cache_position, :]
            chunked_attention_mask = chunked_attention_mask.expand(input_tensor.shape[0], -1, -1, -1)
            chunked_attention_mask = chunked_attention_mask * local_attention_mask[:, None, None, :]
            chunked_attention_mask = torch.where(chunked_attention_mask == 0, min_dtype, 0.0).to(dtype)
        return causal_mask, chunked_attention_mask

    def forward(self, input_ids, attention_mask, cache_position, past_key_values):
        h = self.embed_tokens(input_ids)
        causal_mask, chunk_causal_mask = self._update_causal_mask(attention_mask, h, cache_position,
                                                                  past_key_values)
        for layer in self.layers:
            mask = chunk_causal_mask if layer.use_rope and chunk_causal_mask is not None else causal_mask
            h = h + layer(h, mask, past_key_values)
        return self.lm_head(h)


def main():
    config = Llama4TextConfig()
    model = Llama4TextModel(config).eval()
    cache = HybridChunkedCache(config, max_cache_len=16)
    input_ids = torch.tensor([[7, 3, 19, 42, 5, 11]])
    attention_mask = torch.ones_like(input_ids)
    cache_position = torch.arange(input_ids.shape[1])
    generated = []
    with torch.no_grad():
        logits = model(input_ids, attention_mask, cache_position, cache)
        for _ in range(5):
            nxt = logits[:, -1].argmax(-1, keepdim=True)
            generated.append(nxt.item())
            cache_position = cache_position[-1:] + 1
            attention_mask = torch.cat([attention_mask, torch.ones_like(nxt)], dim=-1)
            logits = model(nxt, attention_mask, cache_position, cache)
    print("generated:", generated)


if __name__ == "__main__":
    main()
