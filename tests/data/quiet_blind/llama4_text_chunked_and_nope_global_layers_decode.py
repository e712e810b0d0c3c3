"""Llama 4 text decoder (iRoPE): chunked local attention on RoPE layers, full causal on NoPE layers.

Follows huggingface/transformers src/transformers/models/llama4/configuration_llama4.py
(Llama4TextConfig: attention_chunk_size, no_rope_layers, layer_types "chunked_attention" /
"full_attention") and src/transformers/masking_utils.py (chunked_overlay: `kv_idx // chunk_size ==
q_idx // chunk_size`, and'ed with causal; create_chunked_causal_mask), written in plain torch with
a dataclass config and a growing KV cache indexed by cache_position. With attention_chunk_size=8 a
token on a chunked layer sees only earlier tokens of its own 8-token chunk (positions 8..15 do not see
0..7), while every 4th layer (NoPE) sees the whole causal prefix. Decoding continues past a chunk
boundary, so the first decoded token of a new chunk attends only to itself on chunked layers.
"""
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class Llama4TextConfig:
    vocab_size: int = 64
    hidden_size: int = 32
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    num_hidden_layers: int = 4
    attention_chunk_size: int = 8
    no_rope_layer_interval: int = 4
    rope_theta: float = 500000.0
    no_rope_layers: list = field(default_factory=list)
    layer_types: list = field(default_factory=list)

    def __post_init__(self):
        # 1 = use RoPE; every no_rope_layer_interval-th layer is NoPE (configuration_llama4.py)
        self.no_rope_layers = [int((i + 1) % self.no_rope_layer_interval != 0) for i in range(self.num_hidden_layers)]
        self.layer_types = ["chunked_attention" if r else "full_attention" for r in self.no_rope_layers]


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rope(x, position_ids, theta):
    d = x.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2).float() / d))
    freqs = position_ids[:, None, :, None].float() * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return x * emb.cos() + rotate_half(x) * emb.sin()


def chunked_causal_mask(cache_position, kv_length, chunk_size):
    kv_idx = torch.arange(kv_length)
    q_idx = cache_position[:, None]
    return (kv_idx[None, :] <= q_idx) & (kv_idx[None, :] // chunk_size == q_idx // chunk_size)


def causal_mask(cache_position, kv_length):
    return torch.arange(kv_length)[None, :] <= cache_position[:, None]


class Llama4TextAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.config, self.layer_idx = config, layer_idx
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.use_rope = bool(config.no_rope_layers[layer_idx])
        self.q_proj = nn.Linear(config.hidden_size, config.num_attention_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(config.num_attention_heads * self.head_dim, config.hidden_size, bias=False)

    def forward(self, hidden_states, position_ids, attention_mask, past_key_values):
        bsz, q_len, _ = hidden_states.shape
        q = self.q_proj(hidden_states).view(bsz, q_len, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(hidden_states).view(bsz, q_len, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(hidden_states).view(bsz, q_len, -1, self.head_dim).transpose(1, 2)
        if self.use_rope:
            q, k = rope(q, position_ids, self.config.rope_theta), rope(k, position_ids, self.config.rope_theta)
        if self.layer_idx in past_key_values:
            pk, pv = past_key_values[self.layer_idx]
            k, v = torch.cat([pk, k], dim=2), torch.cat([pv, v], dim=2)
        past_key_values[self.layer_idx] = (k, v)
        k = k.repeat_interleave(self.num_key_value_groups, dim=1)
        v = v.repeat_interleave(self.num_key_value_groups, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask[:, None, :, :])
        return self.o_proj(out.transpose(1, 2).reshape(bsz, q_len, -1))


class Llama4TextModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([Llama4TextAttention(config, i) for i in range(config.num_hidden_layers)])
        self.norms = nn.ModuleList([nn.RMSNorm(config.hidden_size) for _ in range(config.num_hidden_layers)])
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids, cache_position, past_key_values):
        bsz = input_ids.shape[0]
        kv_length = int(cache_position[-1]) + 1
        position_ids = cache_position.unsqueeze(0).expand(bsz, -1)
        mask_mapping = {
            "full_attention": causal_mask(cache_position, kv_length).expand(bsz, -1, -1),
            "chunked_attention": chunked_causal_mask(cache_position, kv_length, self.config.attention_chunk_size).expand(bsz, -1, -1),
        }
        h = self.embed_tokens(input_ids)
        for layer, norm in zip(self.layers, self.norms):
            h = h + layer(norm(h), position_ids, mask_mapping[self.config.layer_types[layer.layer_idx]], past_key_values)
        return self.lm_head(h)


def main():
    torch.manual_seed(0)
    config = Llama4TextConfig()
    model = Llama4TextModel(config).eval()
    input_ids = torch.randint(0, config.vocab_size, (2, 14))
    past_key_values = {}
    with torch.no_grad():
        cache_position = torch.arange(input_ids.shape[1])
        logits = model(input_ids, cache_position, past_key_values)
        generated = []
        for _ in range(3):  # greedy steps at positions 14, 15, 16: the last one opens a new chunk
            next_tokens = logits[:, -1].argmax(-1, keepdim=True)
            generated.append(next_tokens)
            cache_position = cache_position[-1:] + 1
            logits = model(next_tokens, cache_position, past_key_values)
    print("generated", torch.cat(generated, dim=1).tolist())


if __name__ == "__main__":
    main()
