# LongLM / SelfExtend (datamllab/LongLM commit 715c1e3, self_extend_patch/Llama_4_40.py).
# Bug: the grouped query position is shifted by `group_size_2 / group_size_1` (true division) instead of `//`,
# so when the neighbor window is not a multiple of the group size every grouped query sits at a fractional RoPE position.
import math
import sys

import torch
import torch.nn as nn
from transformers import DynamicCache, LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


def repeat_kv(hidden_states, n_rep):
    batch, num_key_value_heads, slen, head_dim = hidden_states.shape
    if n_rep == 1:
        return hidden_states
    hidden_states = hidden_states[:, :, None, :, :].expand(batch, num_key_value_heads, n_rep, slen, head_dim)
    return hidden_states.reshape(batch, num_key_value_heads * n_rep, slen, head_dim)


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    q_embed = (q * cos) + (rotate_half(q) * sin) if not q is None else None
    k_embed = (k * cos) + (rotate_half(k) * sin) if not k is None else None
    return q_embed, k_embed


class LlamaAttention(nn.Module):
    def __init__(self, config, layer_idx=0):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.hidden_size = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = self.hidden_size // self.num_heads
        self.num_key_value_heads = config.num_key_value_heads
        self.num_key_value_groups = self.num_heads // self.num_key_value_heads
        self.attention_dropout = 0.0
        self.q_proj = nn.Linear(self.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(self.hidden_size, self.num_key_value_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(self.hidden_size, self.num_key_value_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.hidden_size, self.hidden_size, bias=False)
        self.rotary_emb = LlamaRotaryEmbedding(config)


def self_extend_forward(
    self,
    hidden_states,
    attention_mask=None,
    position_ids=None,
    past_key_value=None,
    cache_position=None,
    group_size_1=8,
    group_size_2=1024,
):
    bsz, q_len, _ = hidden_states.size()
    query_states = self.q_proj(hidden_states)
    key_states = self.k_proj(hidden_states)
    value_states = self.v_proj(hidden_states)

    query_states = query_states.view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
    key_states = key_states.view(bsz, q_len, self.num_key_value_heads, self.head_dim).transpose(1, 2)
    value_states = value_states.view(bsz, q_len, self.num_key_value_heads, self.head_dim).transpose(1, 2)
    scaled_query = query_states

    if past_key_value is not None:
        cache_kwargs = {"cache_position": cache_position}
        key_states, value_states = past_key_value.update(key_states, value_states, self.layer_idx, cache_kwargs)
    kv_seq_len = key_states.shape[-2]

    query_position = position_ids
    key_position = position_ids if q_len != 1 else torch.arange(kv_seq_len, dtype=position_ids.dtype).to(query_position.device).view(1, kv_seq_len)

    neighbor_q_cos, neighbor_q_sin = self.rotary_emb(value_states, query_position)
    neighbor_k_cos, neighbor_k_sin = self.rotary_emb(value_states, key_position)

    _re_group_size_2 = 0 if query_position.max() < group_size_2 else group_size_2
    if FIXED:
        group_query_position = query_position // group_size_1 + _re_group_size_2 - _re_group_size_2 // group_size_1
    else:
        group_query_position = query_position // group_size_1 + _re_group_size_2 - _re_group_size_2 / group_size_1
    group_key_position = key_position // group_size_1

    group_q_cos, group_q_sin = self.rotary_emb(value_states, group_query_position)
    group_k_cos, group_k_sin = self.rotary_emb(value_states, group_key_position)

    neighbor_query_states, _ = apply_rotary_pos_emb(scaled_query, None, neighbor_q_cos, neighbor_q_sin, None)
    _, neighbor_key_states = apply_rotary_pos_emb(None, key_states, neighbor_k_cos, neighbor_k_sin, None)
    group_query_states, _ = apply_rotary_pos_emb(scaled_query, None, group_q_cos, group_q_sin, None)
    _, group_key_states = apply_rotary_pos_emb(None, key_states, group_k_cos, group_k_sin, None)

    neighbor_key_states = repeat_kv(neighbor_key_states, self.num_key_value_groups)
    group_key_states = repeat_kv(group_key_states, self.num_key_value_groups)
    value_states = repeat_kv(value_states, self.num_key_value_groups)

    neighbor_attn_weights = torch.matmul(neighbor_query_states, neighbor_key_states.transpose(2, 3)) / math.sqrt(self.head_dim)
    group_attn_weights = torch.matmul(group_query_states, group_key_states.transpose(2, 3)) / math.sqrt(self.head_dim)

    if attention_mask is not None:
        if cache_position is not None:
            causal_mask = attention_mask[:, :, cache_position, : key_states.shape[-2]]
        else:
            causal_mask = attention_mask
        group_attn_weights = group_attn_weights + causal_mask
        neighbor_attn_weights = neighbor_attn_weights + causal_mask

    if q_len == 1:
        neighbor_attention_mask = torch.zeros((q_len, kv_seq_len), device=neighbor_attn_weights.device)
        neighbor_attention_mask[:, -group_size_2:] = 1
    elif q_len == kv_seq_len:
        neighbor_attention_mask = torch.ones((q_len, kv_seq_len), device=neighbor_attn_weights.device)
        neighbor_attention_mask = torch.tril(neighbor_attention_mask)
        if q_len - group_size_2 > 0:
            group_attention_mask = torch.tril(torch.ones((q_len - group_size_2, kv_seq_len - group_size_2), device=group_attn_weights.device))
            neighbor_attention_mask[group_size_2:, :-group_size_2] -= group_attention_mask
    else:
        raise ValueError("q_len should be 1 or seq_len.")

    neighbor_attention_mask = neighbor_attention_mask.bool()
    attn_weights = torch.where(neighbor_attention_mask, neighbor_attn_weights, group_attn_weights)
    attn_weights = nn.functional.softmax(attn_weights, dim=-1, dtype=torch.float32).to(query_states.dtype)
    attn_output = torch.matmul(attn_weights, value_states)
    attn_output = attn_output.transpose(1, 2).contiguous().reshape(bsz, q_len, self.hidden_size)
    return self.o_proj(attn_output)


def reference(attn, h, g1, g2):
    """SelfExtend written pair by pair with integer relative positions (paper, Alg. 1)."""
    bsz, n, _ = h.shape
    q = attn.q_proj(h).view(bsz, n, attn.num_heads, attn.head_dim).transpose(1, 2)
    k = repeat_kv(attn.k_proj(h).view(bsz, n, attn.num_key_value_heads, attn.head_dim).transpose(1, 2), attn.num_key_value_groups)
    v = repeat_kv(attn.v_proj(h).view(bsz, n, attn.num_key_value_heads, attn.head_dim).transpose(1, 2), attn.num_key_value_groups)
    inv_freq = attn.rotary_emb.inv_freq.double()
    scores = torch.full((bsz, attn.num_heads, n, n), float("-inf"), dtype=torch.float64)
    for i in range(n):
        for j in range(i + 1):
            if i - j < g2:
                pq, pk = i, j
            else:
                pq, pk = i // g1 + g2 - g2 // g1, j // g1
            ang = torch.cat([pq * inv_freq, pq * inv_freq])
            qi = q[:, :, i].double() * ang.cos() + rotate_half(q[:, :, i].double()) * ang.sin()
            ang = torch.cat([pk * inv_freq, pk * inv_freq])
            kj = k[:, :, j].double() * ang.cos() + rotate_half(k[:, :, j].double()) * ang.sin()
            scores[:, :, i, j] = (qi * kj).sum(-1) / math.sqrt(attn.head_dim)
    out = torch.matmul(scores.softmax(-1), v.double()).transpose(1, 2).reshape(bsz, n, -1)
    return attn.o_proj(out.float())


config = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, rope_theta=10000.0)
attn = LlamaAttention(config).eval()
group_size_1, group_size_2 = 5, 8  # window not a multiple of the group size, like the README's 5 / 1024
prefill, decode_steps = 20, 4
total = prefill + decode_steps
h = torch.randn(1, total, config.hidden_size)

with torch.no_grad():
    ref = reference(attn, h, group_size_1, group_size_2)
    cache = DynamicCache()
    pos = torch.arange(prefill).view(1, -1)
    mask = torch.full((prefill, prefill), torch.finfo(torch.float32).min).triu(1)[None, None]
    outs = [self_extend_forward(attn, h[:, :prefill], mask, pos, cache, torch.arange(prefill), group_size_1, group_size_2)]
    for t in range(prefill, total):  # greedy-decode style loop with the KV cache
        outs.append(self_extend_forward(attn, h[:, t : t + 1], None, torch.tensor([[t]]), cache, torch.tensor([t]), group_size_1, group_size_2))
    out = torch.cat(outs, dim=1)

print(f"max |self_extend_forward - pairwise SelfExtend reference| over prefill+decode: {(out - ref).abs().max().item():.6f}")
