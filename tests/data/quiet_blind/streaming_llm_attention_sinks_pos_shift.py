"""StreamingLLM: keep 4 attention-sink tokens plus a recent window in the KV cache; positions are cache slots.

Follows mit-han-lab/streaming-llm streaming_llm/kv_cache.py (StartRecentKVCache.evict_for_space: keep
[0, start_size) and the last recent_size - num_coming keys) and streaming_llm/pos_shift/modify_llama.py
(keys cached BEFORE rotary; rotary applied with key_position_ids = arange(kv_seq_len), the query at
kv_seq_len - 1, i.e. positions inside the cache, not in the original text) and examples/run_streaming_llama.py
(greedy_generate token by token). Mask meant: prefill causal; each decode step's query sees every kept key
(sinks + recent). Tokens evicted from the middle are gone, which is the method, not a mask error.
"""
import torch
import torch.nn.functional as F
from torch import nn


def slice2d(x, start, end):
    return x[:, :, start:end, ...]


class StartRecentKVCache:
    def __init__(self, start_size=4, recent_size=8, k_seq_dim=2):
        self.start_size, self.recent_size = start_size, recent_size
        self.cache_size = start_size + recent_size
        self.k_seq_dim = k_seq_dim

    def evict_for_space(self, past_key_values, num_coming):
        if past_key_values is None:
            return None
        seq_len = past_key_values[0][0].size(self.k_seq_dim)
        if seq_len + num_coming <= self.cache_size:
            return past_key_values
        return [[torch.cat([slice2d(t, 0, self.start_size),
                            slice2d(t, seq_len - self.recent_size + num_coming, seq_len)], dim=self.k_seq_dim)
                 for t in kv] for kv in past_key_values]


def apply_rotary_pos_emb_single(x, position_ids, base=10000.0):
    half = x.shape[-1] // 2
    inv_freq = 1.0 / (base ** (torch.arange(half, dtype=torch.float32) / half))
    freqs = position_ids[:, None, :, None].float() * inv_freq
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * freqs.cos() - x2 * freqs.sin(), x1 * freqs.sin() + x2 * freqs.cos()], dim=-1)


class LlamaAttentionPosShift(nn.Module):
    def __init__(self, hidden_size=32, num_heads=4):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, hidden_size // num_heads
        self.q_proj = nn.Linear(hidden_size, hidden_size, bias=False)
        self.k_proj = nn.Linear(hidden_size, hidden_size, bias=False)
        self.v_proj = nn.Linear(hidden_size, hidden_size, bias=False)
        self.o_proj = nn.Linear(hidden_size, hidden_size, bias=False)

    def forward(self, hidden_states, past_key_value=None):
        bsz, q_len, _ = hidden_states.shape
        shape = (bsz, q_len, self.num_heads, self.head_dim)
        query_states = self.q_proj(hidden_states).view(shape).transpose(1, 2)
        key_states = self.k_proj(hidden_states).view(shape).transpose(1, 2)
        value_states = self.v_proj(hidden_states).view(shape).transpose(1, 2)
        kv_seq_len = q_len + (past_key_value[0].shape[-2] if past_key_value is not None else 0)
        query_position_ids = torch.arange(kv_seq_len - q_len, kv_seq_len)[None]
        query_states = apply_rotary_pos_emb_single(query_states, query_position_ids)
        if past_key_value is not None:
            key_states = torch.cat([past_key_value[0], key_states], dim=2)
            value_states = torch.cat([past_key_value[1], value_states], dim=2)
        past_key_value = (key_states, value_states)          # cached without rotary
        key_position_ids = torch.arange(kv_seq_len)[None]
        key_states = apply_rotary_pos_emb_single(key_states, key_position_ids)
        out = F.scaled_dot_product_attention(query_states, key_states, value_states, is_causal=q_len > 1)
        return self.o_proj(out.transpose(1, 2).reshape(bsz, q_len, -1)), past_key_value


@torch.no_grad()
def greedy_generate(embed_tokens, attn, lm_head, input_ids, kv_cache, max_gen_len):
    outputs, past_key_values = attn(embed_tokens(input_ids))
    past_key_values = [past_key_values]
    pred_token_idx = lm_head(outputs[:, -1]).argmax(dim=-1, keepdim=True)
    generated_ids = [pred_token_idx.item()]
    for _ in range(max_gen_len - 1):
        past_key_values = kv_cache.evict_for_space(past_key_values, 1)
        outputs, kv = attn(embed_tokens(pred_token_idx), past_key_value=past_key_values[0])
        past_key_values = [kv]
        pred_token_idx = lm_head(outputs[:, -1]).argmax(dim=-1, keepdim=True)
        generated_ids.append(pred_token_idx.item())
    return generated_ids, past_key_values[0][0].shape[2]


def main():
    torch.manual_seed(0)
    vocab, hidden = 64, 32
    embed_tokens, attn, lm_head = nn.Embedding(vocab, hidden), LlamaAttentionPosShift(hidden), nn.Linear(hidden, vocab)
    kv_cache = StartRecentKVCache(start_size=4, recent_size=8)
    input_ids = torch.randint(0, vocab, (1, 10))
    ids, cache_len = greedy_generate(embed_tokens, attn, lm_head, input_ids, kv_cache, max_gen_len=10)
    print(ids, "cache", cache_len)


if __name__ == "__main__":
    main()
