# intel/ipex-llm#11767 (commit 841dbcdf): with the SnapKV-style DynamicCompressCache, the multi-token
# "lookup" (lookahead / prompt-lookup verify) step set attention_mask = None before xe_addons.sdp, so the
# candidate tokens attended to each other's future. Fix: keep the mask's last key_states.size(2) columns.
import math
import sys
import types

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)

# CPU stand-ins for the XPU kernels the Qwen2 path dispatches to.
xe_addons = types.SimpleNamespace(
    sdp=lambda q, k, v, mask: F.scaled_dot_product_attention(q, k, v, attn_mask=mask),
    sdp_causal=lambda q, k, v, mask: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None),
)


def use_sdp(q_len, kv_len):
    return q_len != kv_len and q_len <= 32  # next token / lookup


def use_sdp_causal(q_len, kv_len):
    return q_len == kv_len  # first token


class Qwen2Config:
    hidden_size, num_attention_heads, num_hidden_layers, vocab_size = 32, 4, 2, 50
    window_size, max_capacity_prompt, kernel_size, pooling = 4, 8, 3, "maxpool"  # compresskv settings


def compress_kv(attn_config, key_states, query_states, value_states):
    bsz, num_heads, q_len, head_dim = query_states.shape
    if q_len <= attn_config.max_capacity_prompt:
        return key_states, value_states
    w = attn_config.window_size
    attn_weights = torch.matmul(query_states[..., -w:, :], key_states.transpose(2, 3)) / math.sqrt(head_dim)
    mask = torch.full((w, w), torch.finfo(attn_weights.dtype).min)
    mask_cond = torch.arange(w)
    mask.masked_fill_(mask_cond < (mask_cond + 1).view(w, 1), 0)
    attn_weights[:, :, -w:, -w:] += mask[None, None]
    attn_weights = F.softmax(attn_weights, dim=-1, dtype=torch.float32)
    attn_weights_sum = attn_weights[:, :, -w:, :-w].sum(dim=-2)
    attn_cache = F.max_pool1d(attn_weights_sum, kernel_size=attn_config.kernel_size,
                              padding=attn_config.kernel_size // 2, stride=1)
    indices = attn_cache.topk(attn_config.max_capacity_prompt - w, dim=-1).indices
    indices = indices.unsqueeze(-1).expand(-1, -1, -1, head_dim)
    k_past = key_states[:, :, :-w, :].gather(dim=2, index=indices)
    v_past = value_states[:, :, :-w, :].gather(dim=2, index=indices)
    return torch.cat([k_past, key_states[:, :, -w:]], dim=2), torch.cat([v_past, value_states[:, :, -w:]], dim=2)


class DynamicCompressCache:
    def __init__(self):
        self.key_cache, self.value_cache, self.real_kv_len = [], [], 0

    def update(self, key_states, value_states, layer_idx, query_states, attn_config):
        if layer_idx == 0:
            self.real_kv_len += key_states.shape[2]
        if len(self.key_cache) <= layer_idx:  # first token: compress, attend over the full prompt
            k, v = compress_kv(attn_config, key_states, query_states, value_states)
            self.key_cache.append(k)
            self.value_cache.append(v)
            return key_states, value_states
        self.key_cache[layer_idx] = torch.cat([self.key_cache[layer_idx], key_states], dim=2)
        self.value_cache[layer_idx] = torch.cat([self.value_cache[layer_idx], value_states], dim=2)
        return self.key_cache[layer_idx], self.value_cache[layer_idx]

    def get_seq_length(self):
        return self.real_kv_len


def rotate(x, position_ids):
    d = x.shape[-1]
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    freqs = position_ids[:, None, :, None].float() * inv_freq
    cos, sin = torch.cat([freqs, freqs], -1).cos(), torch.cat([freqs, freqs], -1).sin()
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


class Qwen2Attention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.config, self.layer_idx = config, layer_idx
        self.num_heads, self.head_dim = config.num_attention_heads, config.hidden_size // config.num_attention_heads
        self.q_proj = nn.Linear(config.hidden_size, config.hidden_size)
        self.k_proj = nn.Linear(config.hidden_size, config.hidden_size)
        self.v_proj = nn.Linear(config.hidden_size, config.hidden_size)
        self.o_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=False)

    def forward(self, hidden_states, attention_mask, position_ids, past_key_value):
        bsz, q_len, _ = hidden_states.size()
        use_compresskv = isinstance(past_key_value, DynamicCompressCache)
        shape = lambda t: t.view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        query_states, key_states, value_states = shape(self.q_proj(hidden_states)), shape(self.k_proj(hidden_states)), shape(self.v_proj(hidden_states))
        kv_seq_len = q_len + past_key_value.get_seq_length()
        query_states, key_states = rotate(query_states, position_ids), rotate(key_states, position_ids)
        key_states, value_states = past_key_value.update(key_states, value_states, self.layer_idx, query_states, self.config)
        if use_sdp(q_len, kv_seq_len):
            if use_compresskv:
                if FIXED:
                    attention_mask = attention_mask[:, :, :, -key_states.size(2):]
                else:
                    attention_mask = None
            attn_output = xe_addons.sdp(query_states, key_states, value_states, attention_mask)
        else:
            attn_output = xe_addons.sdp_causal(query_states, key_states, value_states, attention_mask)
        return self.o_proj(attn_output.transpose(1, 2).reshape(bsz, q_len, -1))


class Qwen2ForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Qwen2Attention(config, i) for i in range(config.num_hidden_layers))
        self.norms = nn.ModuleList(nn.LayerNorm(config.hidden_size) for _ in range(config.num_hidden_layers))
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids, past_key_values):
        bsz, q_len = input_ids.shape
        past = past_key_values.get_seq_length()
        position_ids = torch.arange(past, past + q_len)[None].expand(bsz, -1)
        # 4D causal mask over the full (uncompressed) history, as transformers prepares it
        full = torch.full((q_len, past + q_len), torch.finfo(torch.float32).min).triu(past + 1)
        attention_mask = full[None, None].expand(bsz, 1, -1, -1)
        h = self.embed_tokens(input_ids)
        for attn, norm in zip(self.layers, self.norms):
            h = h + attn(norm(h), attention_mask if q_len > 1 or past else None, position_ids, past_key_values)
        return self.lm_head(h)


with torch.no_grad():
    model = Qwen2ForCausalLM(Qwen2Config()).eval()
    prompt = torch.randint(0, 50, (1, 16))
    candidates = torch.randint(0, 50, (1, 4))  # tokens proposed by prompt lookup

    cache = DynamicCompressCache()
    model(prompt, cache)
    verify_logits = model(candidates, cache)  # one lookup step verifies all candidates at once

    cache = DynamicCompressCache()
    model(prompt, cache)
    step_logits = torch.cat([model(candidates[:, i : i + 1], cache) for i in range(4)], dim=1)

diff = (verify_logits - step_logits).abs().max().item()
print(f"fixed={FIXED} lookup verify step vs token-by-token decode: max |logit diff| = {diff:.3e}")
