# KVCache-Factory / PyramidKV (Zefan-Cai/KVCache-Factory commit 5fb995d, "Fix KV merge utilities"), pyramidkv_utils.merge_kv.
# Bug: SnapKV with --merge pivot (LOOK-M) builds the compressed cache as keys [recent, selected] but values [selected, recent]
# (and treats the recent window as "dropped" via a cross-head isin), so cache slot s pairs one token's key with another's value.
import math
import sys

import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb, repeat_kv

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


def merge_kv_before(key_states, value_states, indices, window_size, merge):
    # merge methods in LOOK-M
    bsz, num_heads, k_len, head_dim = key_states.shape

    # kv-selected
    selected_keys = key_states.gather(dim=2, index=indices)
    selected_values = value_states.gather(dim=2, index=indices)

    # kv-drop
    all_indices = torch.arange(k_len, device=key_states.device).unsqueeze(0).unsqueeze(0).expand(bsz, num_heads, k_len)
    all_indices_flattened = all_indices.flatten()
    selected_indices_flattened = indices.flatten()
    is_selected = torch.isin(all_indices_flattened, selected_indices_flattened)
    drop_indices_flattened = all_indices_flattened[~is_selected]
    drop_len = drop_indices_flattened.shape[0] // (all_indices.shape[0] * all_indices.shape[1])
    drop_indices = drop_indices_flattened.reshape(all_indices.shape[0], all_indices.shape[1], drop_len)
    drop_indices = drop_indices.unsqueeze(-1).expand(-1, -1, -1, head_dim)
    drop_keys = key_states.gather(dim=2, index=drop_indices)
    drop_values = value_states.gather(dim=2, index=drop_indices)

    # kv-recent
    recent_keys = key_states[:, :, -window_size:, :]

    k_hh_pruned = drop_keys
    k_hh_recent = torch.cat([recent_keys, selected_keys], dim=2)
    v_hh_pruned = drop_values
    v_hh_recent = torch.cat([selected_values, value_states[:, :, -window_size:, :]], dim=2)
    similarity = (k_hh_pruned / torch.norm(k_hh_pruned, dim=-1).unsqueeze(-1).repeat(1, 1, 1, 128)) @ ((k_hh_recent / (torch.norm(k_hh_recent, dim=-1).unsqueeze(-1).repeat(1, 1, 1, 128))).transpose(-1, -2))  # cosin
    max_values, max_indices = similarity.max(dim=-1)

    if merge == "pivot":
        print("Pivot merge")
        merged_indices = max_indices.unsqueeze(-1).repeat(1, 1, 1, 128)
        k_hh_selected = torch.gather(input=k_hh_recent, dim=2, index=merged_indices)
        k_hh_merged = (k_hh_pruned + k_hh_selected) / 2
        k_hh_recent = torch.scatter_reduce(input=k_hh_recent, dim=2, index=merged_indices, src=k_hh_merged, reduce='mean', include_self=True)
        v_hh_selected = torch.gather(input=v_hh_recent, dim=2, index=merged_indices)
        v_hh_merged = (v_hh_pruned + v_hh_selected) / 2
        v_hh_recent = torch.scatter_reduce(input=v_hh_recent, dim=2, index=merged_indices, src=v_hh_merged, reduce='mean', include_self=True)
    else:
        raise ValueError('Merge method not supported')

    return k_hh_recent, v_hh_recent


def merge_kv_after(key_states, value_states, indices, window_size, merge):
    # Merge methods inspired by LOOK-M and KVMerger.
    bsz, num_heads, k_len, head_dim = key_states.shape
    past_len = k_len - window_size
    if past_len <= 0:
        return key_states, value_states

    token_indices = indices[..., 0] if indices.dim() == 4 else indices
    token_indices = token_indices.clamp(min=0, max=past_len - 1)
    gather_indices = token_indices.unsqueeze(-1).expand(-1, -1, -1, head_dim)

    past_keys = key_states[:, :, :past_len, :]
    past_values = value_states[:, :, :past_len, :]
    recent_keys = key_states[:, :, past_len:, :]
    recent_values = value_states[:, :, past_len:, :]

    selected_keys = past_keys.gather(dim=2, index=gather_indices)
    selected_values = past_values.gather(dim=2, index=gather_indices)

    selected_mask = torch.zeros((bsz, num_heads, past_len), dtype=torch.bool, device=key_states.device)
    selected_mask.scatter_(dim=2, index=token_indices, value=True)
    drop_mask = ~selected_mask
    drop_len = int(drop_mask.sum(dim=2).max().item())
    retained_keys = torch.cat([selected_keys, recent_keys], dim=2)
    retained_values = torch.cat([selected_values, recent_values], dim=2)
    if drop_len == 0:
        return retained_keys, retained_values

    drop_indices = []
    for batch_idx in range(bsz):
        head_indices = []
        for head_idx in range(num_heads):
            current = torch.nonzero(drop_mask[batch_idx, head_idx], as_tuple=False).flatten()
            if current.numel() < drop_len:
                pad = current.new_full((drop_len - current.numel(),), current[-1].item() if current.numel() else 0)
                current = torch.cat([current, pad], dim=0)
            head_indices.append(current)
        drop_indices.append(torch.stack(head_indices, dim=0))
    drop_indices = torch.stack(drop_indices, dim=0).unsqueeze(-1).expand(-1, -1, -1, head_dim)
    dropped_keys = past_keys.gather(dim=2, index=drop_indices)
    dropped_values = past_values.gather(dim=2, index=drop_indices)

    dropped_norm = F.normalize(dropped_keys, p=2, dim=-1, eps=1e-6)
    retained_norm = F.normalize(retained_keys, p=2, dim=-1, eps=1e-6)
    similarity = torch.matmul(dropped_norm, retained_norm.transpose(-1, -2))
    max_values, max_indices = similarity.max(dim=-1)
    scatter_indices = max_indices.unsqueeze(-1).expand(-1, -1, -1, head_dim)

    if merge == "pivot":
        selected_keys_for_merge = torch.gather(retained_keys, dim=2, index=scatter_indices)
        merged_keys = (dropped_keys + selected_keys_for_merge) / 2
        retained_keys = torch.scatter_reduce(input=retained_keys, dim=2, index=scatter_indices, src=merged_keys, reduce="mean", include_self=True)
        selected_for_merge = torch.gather(retained_values, dim=2, index=scatter_indices)
        merged_values = (dropped_values + selected_for_merge) / 2
        retained_values = torch.scatter_reduce(input=retained_values, dim=2, index=scatter_indices, src=merged_values, reduce="mean", include_self=True)
    else:
        raise ValueError(f"Merge method {merge!r} not supported")

    return retained_keys, retained_values


merge_kv = merge_kv_after if FIXED else merge_kv_before


class SnapKVCluster():
    def __init__(self, window_size=64, max_capacity_prompt=256 + 64, kernel_size=5, pooling='avgpool', merge=None):
        self.window_size = window_size
        self.max_capacity_prompt = max_capacity_prompt
        assert self.max_capacity_prompt - self.window_size > 0
        self.kernel_size = kernel_size
        self.pooling = pooling
        self.merge = merge

    def update_kv(self, key_states, query_states, value_states, attention_mask, num_key_value_groups):
        assert key_states.shape[-2] == query_states.shape[-2]
        bsz, num_heads, q_len, head_dim = query_states.shape
        if q_len < self.max_capacity_prompt:
            return key_states, value_states
        else:
            attn_weights = torch.matmul(query_states[..., -self.window_size:, :], key_states.transpose(2, 3)) / math.sqrt(head_dim)
            mask = torch.full((self.window_size, self.window_size), torch.finfo(attn_weights.dtype).min, device=attn_weights.device)
            mask_cond = torch.arange(mask.size(-1), device=attn_weights.device)
            mask.masked_fill_(mask_cond < (mask_cond + 1).view(mask.size(-1), 1), 0)
            mask = mask.to(attn_weights.device)
            attention_mask = mask[None, None, :, :]
            attn_weights[:, :, -self.window_size:, -self.window_size:] += attention_mask
            attn_weights = nn.functional.softmax(attn_weights, dim=-1, dtype=torch.float32).to(query_states.dtype)
            attn_weights_sum = attn_weights[:, :, -self.window_size:, : -self.window_size].sum(dim=-2)
            if self.pooling == 'avgpool':
                attn_cache = F.avg_pool1d(attn_weights_sum, kernel_size=self.kernel_size, padding=self.kernel_size // 2, stride=1)
            else:
                attn_cache = F.max_pool1d(attn_weights_sum, kernel_size=self.kernel_size, padding=self.kernel_size // 2, stride=1)
            indices = attn_cache.topk(self.max_capacity_prompt - self.window_size, dim=-1).indices
            indices = indices.unsqueeze(-1).expand(-1, -1, -1, head_dim)

            if self.merge is not None:
                key_states, value_states = merge_kv(key_states, value_states, indices, self.window_size, self.merge)
                return key_states, value_states

            k_past_compress = key_states[:, :, :-self.window_size, :].gather(dim=2, index=indices)
            v_past_compress = value_states[:, :, :-self.window_size, :].gather(dim=2, index=indices)
            k_cur = key_states[:, :, -self.window_size:, :]
            v_cur = value_states[:, :, -self.window_size:, :]
            key_states = torch.cat([k_past_compress, k_cur], dim=2)
            value_states = torch.cat([v_past_compress, v_cur], dim=2)
            return key_states, value_states


class SimpleCache:
    def __init__(self):
        self.key_cache, self.value_cache = [], []

    def update(self, k, v, layer_idx, cache_kwargs=None):
        if len(self.key_cache) <= layer_idx:
            self.key_cache.append(k)
            self.value_cache.append(v)
        else:
            self.key_cache[layer_idx] = torch.cat([self.key_cache[layer_idx], k], dim=-2)
            self.value_cache[layer_idx] = torch.cat([self.value_cache[layer_idx], v], dim=-2)
        return self.key_cache[layer_idx], self.value_cache[layer_idx]


class LlamaAttention(nn.Module):
    def __init__(self, config, layer_idx=0):
        super().__init__()
        self.config, self.layer_idx = config, layer_idx
        self.hidden_size = config.hidden_size
        self.num_heads, self.num_key_value_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        self.num_key_value_groups = self.num_heads // self.num_key_value_heads
        self.q_proj = nn.Linear(self.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(self.hidden_size, self.num_key_value_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(self.hidden_size, self.num_key_value_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, self.hidden_size, bias=False)
        self.rotary_emb = LlamaRotaryEmbedding(config)


def init_snapkv(self):
    if not hasattr(self, "kv_cluster"):
        self.kv_cluster = SnapKVCluster(window_size=self.config.window_size, max_capacity_prompt=self.config.max_capacity_prompt,
                                        kernel_size=self.config.kernel_size, pooling=self.config.pooling, merge=self.config.merge)


def llama_attn_forward_SnapKV(self, hidden_states, attention_mask=None, position_ids=None, past_key_value=None, compress=True):
    bsz, q_len, _ = hidden_states.size()
    if compress:
        init_snapkv(self)
    query_states = self.q_proj(hidden_states).view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
    key_states = self.k_proj(hidden_states).view(bsz, q_len, self.num_key_value_heads, self.head_dim).transpose(1, 2)
    value_states = self.v_proj(hidden_states).view(bsz, q_len, self.num_key_value_heads, self.head_dim).transpose(1, 2)

    kv_seq_len = key_states.shape[-2]
    if getattr(self, "kv_seq_len", 0) != 0:
        kv_seq_len += self.kv_seq_len
    cos, sin = self.rotary_emb(value_states, position_ids)
    query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)
    key_states = repeat_kv(key_states, self.num_key_value_groups)
    value_states = repeat_kv(value_states, self.num_key_value_groups)

    if key_states.shape[-2] == kv_seq_len:
        self.kv_seq_len = kv_seq_len
        if compress:
            key_states_compress, value_states_compress = self.kv_cluster.update_kv(key_states, query_states, value_states, attention_mask, self.num_key_value_groups)
        else:
            key_states_compress, value_states_compress = key_states, value_states
        past_key_value.update(key_states_compress, value_states_compress, self.layer_idx)
    else:
        self.kv_seq_len += q_len
        key_states, value_states = past_key_value.update(key_states, value_states, self.layer_idx)

    attn_weights = torch.matmul(query_states, key_states.transpose(2, 3)) / math.sqrt(self.head_dim)
    if attention_mask is not None:
        attn_weights = attn_weights + attention_mask[:, :, :, : key_states.shape[-2]]
    attn_weights = nn.functional.softmax(attn_weights, dim=-1, dtype=torch.float32).to(query_states.dtype)
    attn_output = torch.matmul(attn_weights, value_states)
    attn_output = attn_output.transpose(1, 2).contiguous().reshape(bsz, q_len, -1)
    return self.o_proj(attn_output)


config = LlamaConfig(hidden_size=64, num_attention_heads=2, num_key_value_heads=2, head_dim=128, max_position_embeddings=64)
config.window_size, config.max_capacity_prompt, config.kernel_size, config.pooling, config.merge = 4, 12, 5, "avgpool", "pivot"
attn = LlamaAttention(config).eval()
prompt_len, new_tokens = 24, 4
h = torch.randn(1, prompt_len + new_tokens, config.hidden_size)
causal = torch.full((prompt_len, prompt_len), torch.finfo(torch.float32).min).triu(1)[None, None]


def run(compress):
    attn.kv_seq_len = 0
    cache = SimpleCache()
    llama_attn_forward_SnapKV(attn, h[:, :prompt_len], causal, torch.arange(prompt_len)[None], cache, compress)
    outs = []
    for t in range(prompt_len, prompt_len + new_tokens):  # greedy-decode style loop on the (compressed) cache
        outs.append(llama_attn_forward_SnapKV(attn, h[:, t:t + 1], None, torch.tensor([[t]]), cache, compress))
    return torch.cat(outs, dim=1)


with torch.no_grad():
    full = run(compress=False)
    compressed = run(compress=True)
print(f"decode output, merged SnapKV cache (24 -> 12 slots) vs full cache: max abs diff {(compressed - full).abs().max().item():.6f}")
