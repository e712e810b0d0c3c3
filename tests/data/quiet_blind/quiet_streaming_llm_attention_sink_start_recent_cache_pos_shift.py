# Citation: mit-han-lab/streaming-llm streaming_llm/kv_cache.py @d729b3f (StartRecentKVCache __call__ /
#   evict_for_space), streaming_llm/pos_shift/modify_llama.py (llama_pos_shift_attention_forward: keys cached
#   before RoPE and re-rotated with their position inside the cache), examples/run_streaming_llama.py
#   (streaming_inference / greedy_generate).
# Masking: the cache keeps start_size attention-sink tokens plus the most recent tokens; middle tokens are evicted
#   before each prompt (evict_for_space) and after each step. Positions are re-assigned inside the cache, so a
#   multi-token prompt uses the llama causal mask offset by the (evicted) cache length and single-token decode
#   attends every kept token. Nothing evicted is ever attended, sinks always are.
import math
import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)


def slice2d(x, start, end):
    return x[:, :, start:end, ...]


class StartRecentKVCache:
    def __init__(self, start_size=4, recent_size=512, k_seq_dim=2, v_seq_dim=2):
        self.start_size = start_size
        self.recent_size = recent_size
        self.cache_size = start_size + recent_size
        self.k_seq_dim = k_seq_dim
        self.v_seq_dim = v_seq_dim
        self.k_slice = slice2d
        self.v_slice = slice2d

    def __call__(self, past_key_values):
        if past_key_values is None:
            return None
        seq_len = past_key_values[0][0].size(self.k_seq_dim)
        if seq_len <= self.cache_size:
            return past_key_values
        return [[torch.cat([self.k_slice(k, 0, self.start_size), self.k_slice(k, seq_len - self.recent_size, seq_len)], dim=self.k_seq_dim),
                 torch.cat([self.v_slice(v, 0, self.start_size), self.v_slice(v, seq_len - self.recent_size, seq_len)], dim=self.v_seq_dim)]
                for k, v in past_key_values]

    def evict_for_space(self, past_key_values, num_coming):
        if past_key_values is None:
            return None
        seq_len = past_key_values[0][0].size(self.k_seq_dim)
        if seq_len + num_coming <= self.cache_size:
            return past_key_values
        return [[torch.cat([self.k_slice(k, 0, self.start_size), self.k_slice(k, seq_len - self.recent_size + num_coming, seq_len)], dim=self.k_seq_dim),
                 torch.cat([self.v_slice(v, 0, self.start_size), self.v_slice(v, seq_len - self.recent_size + num_coming, seq_len)], dim=self.v_seq_dim)]
                for k, v in past_key_values]


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb_single(x, cos, sin, position_ids):
    cos = cos[position_ids].unsqueeze(1)  # [bs, 1, seq_len, dim]
    sin = sin[position_ids].unsqueeze(1)
    return (x * cos) + (rotate_half(x) * sin)


def _make_causal_mask(input_ids_shape, dtype, past_key_values_length=0):
    bsz, tgt_len = input_ids_shape
    mask = torch.full((tgt_len, tgt_len), torch.finfo(dtype).min)
    mask_cond = torch.arange(mask.size(-1))
    mask.masked_fill_(mask_cond < (mask_cond + 1).view(mask.size(-1), 1), 0)
    mask = mask.to(dtype)
    if past_key_values_length > 0:
        mask = torch.cat([torch.zeros(tgt_len, past_key_values_length, dtype=dtype), mask], dim=-1)
    return mask[None, None, :, :].expand(bsz, 1, tgt_len, tgt_len + past_key_values_length)


class LlamaAttention(nn.Module):
    def __init__(self, dim, heads, max_pos=256):
        super().__init__()
        self.num_heads, self.head_dim = heads, dim // heads
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(dim, dim, bias=False) for _ in range(4))
        inv_freq = 1.0 / (10000 ** (torch.arange(0, self.head_dim, 2).float() / self.head_dim))
        freqs = torch.outer(torch.arange(max_pos).float(), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos_cached, self.sin_cached = emb.cos(), emb.sin()

    def forward(self, hidden_states, attention_mask, position_ids, past_key_value):
        # llama_pos_shift_attention_forward
        bsz, q_len, _ = hidden_states.size()
        query_states = self.q_proj(hidden_states).view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        key_states = self.k_proj(hidden_states).view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        value_states = self.v_proj(hidden_states).view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        kv_seq_len = key_states.shape[-2]
        if past_key_value is not None:
            kv_seq_len += past_key_value[0].shape[-2]
        cos, sin = self.cos_cached, self.sin_cached
        ### Shift Pos: query pos is min(cache_size, idx)
        query_states = apply_rotary_pos_emb_single(query_states, cos, sin, position_ids)
        if past_key_value is not None:
            key_states = torch.cat([past_key_value[0], key_states], dim=2)
            value_states = torch.cat([past_key_value[1], value_states], dim=2)
        past_key_value = (key_states, value_states)
        ### Shift Pos: key pos is the pos in cache
        key_position_ids = torch.arange(kv_seq_len).unsqueeze(0)
        key_states = apply_rotary_pos_emb_single(key_states, cos, sin, key_position_ids)
        attn_weights = torch.matmul(query_states, key_states.transpose(2, 3)) / math.sqrt(self.head_dim)
        if attention_mask is not None:
            attn_weights = attn_weights + attention_mask
            attn_weights = torch.max(attn_weights, torch.tensor(torch.finfo(attn_weights.dtype).min))
        attn_weights = F.softmax(attn_weights, dim=-1, dtype=torch.float32).to(query_states.dtype)
        attn_output = torch.matmul(attn_weights, value_states).transpose(1, 2).reshape(bsz, q_len, -1)
        return self.o_proj(attn_output), past_key_value


class LlamaForCausalLM(nn.Module):
    def __init__(self, vocab=64, dim=32, heads=4, layers=2):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList([LlamaAttention(dim, heads) for _ in range(layers)])
        self.mlps = nn.ModuleList([nn.Sequential(nn.Linear(dim, 2 * dim), nn.SiLU(), nn.Linear(2 * dim, dim)) for _ in range(layers)])
        self.norm = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)

    def forward(self, input_ids, past_key_values=None):
        bsz, seq_length = input_ids.shape
        past_key_values_length = 0 if past_key_values is None else past_key_values[0][0].shape[2]
        position_ids = torch.arange(past_key_values_length, seq_length + past_key_values_length).unsqueeze(0)
        attention_mask = None
        if seq_length > 1:
            attention_mask = _make_causal_mask((bsz, seq_length), torch.float32, past_key_values_length)
        x = self.embed_tokens(input_ids)
        new_past = []
        for i, (attn, mlp) in enumerate(zip(self.layers, self.mlps)):
            a, pkv = attn(x, attention_mask, position_ids, None if past_key_values is None else past_key_values[i])
            x = x + a
            x = x + mlp(x)
            new_past.append(pkv)
        return self.lm_head(self.norm(x)), new_past


@torch.no_grad()
def greedy_generate(model, input_ids, past_key_values, max_gen_len, kv_cache):
    logits, past_key_values = model(input_ids, past_key_values)
    past_key_values = kv_cache(past_key_values)
    pred_token_idx = logits[:, -1, :].argmax(dim=-1).unsqueeze(1)
    generated_ids = [pred_token_idx.item()]
    for _ in range(max_gen_len - 1):
        logits, past_key_values = model(pred_token_idx, past_key_values)
        past_key_values = kv_cache(past_key_values)
        pred_token_idx = logits[:, -1, :].argmax(dim=-1).unsqueeze(1)
        generated_ids.append(pred_token_idx.item())
    return past_key_values, generated_ids


@torch.no_grad()
def streaming_inference(model, prompts, kv_cache, max_gen_len=8):
    past_key_values = None
    outs = []
    for input_ids in prompts:
        seq_len = input_ids.shape[1]
        if kv_cache is not None:
            space_needed = seq_len + max_gen_len
            past_key_values = kv_cache.evict_for_space(past_key_values, space_needed)
        past_key_values, ids = greedy_generate(model, input_ids, past_key_values, max_gen_len, kv_cache)
        outs.append(ids)
        assert past_key_values[0][0].shape[2] <= kv_cache.cache_size
    return outs


model = LlamaForCausalLM().eval()
kv_cache = StartRecentKVCache(start_size=2, recent_size=14)
prompts = [torch.randint(0, 64, (1, n)) for n in (5, 4, 6)]
outs = streaming_inference(model, prompts, kv_cache, max_gen_len=8)
print(f"streamed {outs}")
