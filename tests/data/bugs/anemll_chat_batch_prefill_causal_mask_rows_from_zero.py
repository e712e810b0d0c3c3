# Anemll (Anemll/Anemll#17, fixed in Anemll/Anemll#18, commit 4bfa0b0): tests/chat.py run_prefill sliced the
# causal mask rows (and position ids) as [:batch_size] for every prefill chunk, so chunks after the first
# attend as if they were at positions 0..batch_size-1 (they cannot see themselves nor most earlier keys).
import sys
import math
import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)
MODEL_DTYPE = torch.float32


class LlamaConfig:
    def __init__(self, **kw):
        self.hidden_size = 32
        self.num_attention_heads = 4
        self.num_key_value_heads = 2
        self.num_hidden_layers = 2
        self.intermediate_size = 64
        self.vocab_size = 50
        self.rope_theta = 10000.0
        self.rms_norm_eps = 1e-6
        self.context_length = 32
        self.max_position_embeddings = 32
        self.__dict__.update(kw)


class LlamaRMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x):
        var = x.pow(2).mean(-1, keepdim=True)
        return self.weight * x * torch.rsqrt(var + self.eps)


class LlamaRotaryEmbedding(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.dim = config.hidden_size // config.num_attention_heads
        inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, self.dim, 2).float() / self.dim))
        t = torch.arange(config.max_position_embeddings).type_as(inv_freq)
        freqs = torch.einsum("i,j->ij", t, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos_cached = emb.cos().view(1, config.max_position_embeddings, self.dim)
        self.sin_cached = emb.sin().view(1, config.max_position_embeddings, self.dim)


class LlamaMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaAttention(nn.Module):
    """Attention mechanism optimized for Apple Neural Engine."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.hidden_size = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = self.hidden_size // self.num_heads
        self.num_key_value_heads = config.num_key_value_heads
        self.num_key_value_groups = self.num_heads // self.num_key_value_heads
        self.q_proj = nn.Conv2d(self.hidden_size, self.num_heads * self.head_dim, kernel_size=1, bias=False)
        self.k_proj = nn.Conv2d(self.hidden_size, self.num_key_value_heads * self.head_dim, kernel_size=1, bias=False)
        self.v_proj = nn.Conv2d(self.hidden_size, self.num_key_value_heads * self.head_dim, kernel_size=1, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, self.hidden_size, bias=False)
        self.rotary_emb = LlamaRotaryEmbedding(config)
        self.scaling_factor = torch.tensor(1.0 / math.sqrt(self.head_dim), dtype=MODEL_DTYPE)

    def get_new_kv_cache(self, hidden_states, current_pos, rotary_emb):
        hidden_states = hidden_states.permute(0, 2, 1).unsqueeze(2)
        query_states = self.q_proj(hidden_states).view(1, self.num_heads, 1, self.head_dim)
        key_states = self.k_proj(hidden_states).view(1, self.num_key_value_heads, 1, self.head_dim)
        value_states = self.v_proj(hidden_states).view(1, self.num_key_value_heads, 1, self.head_dim)
        cos, sin = rotary_emb
        query_states, key_states = self.apply_rotary_pos_emb(query_states, key_states, cos, sin)
        return query_states, key_states, value_states

    def get_new_kv_cache_prefill(self, hidden_states, current_pos, rotary_emb, batch_size):
        _, batch, _ = hidden_states.shape
        hidden_states = hidden_states.permute(0, 2, 1).unsqueeze(2)
        query_states = self.q_proj(hidden_states)
        key_states = self.k_proj(hidden_states)
        value_states = self.v_proj(hidden_states)
        query_states = query_states.view(1, self.num_heads, self.head_dim, batch).permute(0, 1, 3, 2)
        key_states = key_states.view(1, self.num_key_value_heads, self.head_dim, batch).permute(0, 1, 3, 2)
        value_states = value_states.view(1, self.num_key_value_heads, self.head_dim, batch).permute(0, 1, 3, 2)
        cos, sin = rotary_emb
        cos = cos.permute(0, 2, 1, 3)
        sin = sin.permute(0, 2, 1, 3)
        query_states, key_states = self.apply_rotary_pos_emb(query_states, key_states, cos, sin)
        return query_states, key_states, value_states

    def ANE_softmax(self, x, dim=-1):
        x_max = torch.max(x, dim=dim, keepdim=True)[0]
        x = x - x_max
        exp_x = torch.exp(x)
        return exp_x / torch.sum(exp_x, dim=dim, keepdim=True)

    def apply_rotary_pos_emb(self, q_states, k_states, cos, sin):
        def rotate(x, cos, sin):
            half_dim = x.shape[-1] // 2
            x1 = x[..., :half_dim]
            x2 = x[..., half_dim:]
            cos = cos[..., :half_dim]
            sin = sin[..., :half_dim]
            return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
        return rotate(q_states, cos, sin), rotate(k_states, cos, sin)

    def repeat_kv(self, x, n_rep):
        x = x.unsqueeze(1)
        x = x.repeat(1, n_rep, 1, 1)
        return x.view(1, -1, x.size(-2), x.size(-1))

    def forward_regular(self, hidden_states, query_states, kv_cache_layer=None, causal_mask=None):
        bsz, q_len, _ = hidden_states.shape
        K_layer_cache, V_layer_cache = kv_cache_layer
        K_layer_cache = K_layer_cache[..., :self.config.context_length, :]
        V_layer_cache = V_layer_cache[..., :self.config.context_length, :]
        key_states = self.repeat_kv(K_layer_cache, self.num_key_value_groups)
        value_states = self.repeat_kv(V_layer_cache, self.num_key_value_groups)
        attn_weights = torch.matmul(query_states, key_states.transpose(-1, -2)) * self.scaling_factor
        if causal_mask is not None:
            attn_weights = attn_weights + causal_mask[:, :, :self.config.context_length]
        attn_weights = self.ANE_softmax(attn_weights, dim=-1)
        attn_output = torch.matmul(attn_weights, value_states)
        attn_output = attn_output.transpose(1, 2).contiguous().reshape(bsz, q_len, self.hidden_size)
        return self.o_proj(attn_output)

    def forward_prefill(self, hidden_states, query_states, kv_cache_layer=None, causal_mask=None):
        bsz, q_len, _ = hidden_states.shape
        K_layer_cache, V_layer_cache = kv_cache_layer
        K_layer_cache = K_layer_cache[..., :self.config.context_length, :]
        V_layer_cache = V_layer_cache[..., :self.config.context_length, :]
        key_states = self.repeat_kv(K_layer_cache, self.num_key_value_groups)
        value_states = self.repeat_kv(V_layer_cache, self.num_key_value_groups)
        attn_weights = torch.einsum('bhqd,bhkd->bhqk', query_states, key_states) * self.scaling_factor
        if causal_mask is not None:
            attn_weights = attn_weights + causal_mask[:, :, :self.config.context_length]
        attn_weights = self.ANE_softmax(attn_weights, dim=-1)
        attn_output = torch.einsum('bhqk,bhkd->bhqd', attn_weights, value_states)
        attn_output = attn_output.transpose(1, 2).contiguous().reshape(bsz, q_len, self.hidden_size)
        return self.o_proj(attn_output)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.self_attn = LlamaAttention(config)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)


class LlamaModel(nn.Module):
    """FFN part of the converted model: owns the unified KV cache (a CoreML state)."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.layers = nn.ModuleList([LlamaDecoderLayer(config) for _ in range(config.num_hidden_layers)])
        self.norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        head_dim = config.hidden_size // config.num_attention_heads
        cache_size = (2 * config.num_hidden_layers, config.num_key_value_heads, config.context_length, head_dim)
        self.register_buffer("kv_cache_0", torch.zeros(cache_size, dtype=MODEL_DTYPE))

    def get_rotary_embeddings_s(self, current_pos):
        r = self.layers[0].self_attn.rotary_emb
        return r.cos_cached[:, current_pos].view(1, 1, 1, -1), r.sin_cached[:, current_pos].view(1, 1, 1, -1)

    def get_rotary_embedding_prefill(self, positions):
        r = self.layers[0].self_attn.rotary_emb
        seq_len = positions.size(0)
        cos = r.cos_cached[:, positions].view(1, seq_len, 1, r.dim)
        sin = r.sin_cached[:, positions].view(1, seq_len, 1, r.dim)
        return cos, sin

    def process_layer(self, layer_idx, hidden_states, position_ids, causal_mask, current_pos, rotary_emb, IN_PREFILL):
        layer = self.layers[layer_idx]
        L = self.config.num_hidden_layers
        normalized_states = layer.input_layernorm(hidden_states)
        if IN_PREFILL:
            q, k, v = layer.self_attn.get_new_kv_cache_prefill(normalized_states, current_pos, rotary_emb, position_ids.shape[0])
        else:
            q, k, v = layer.self_attn.get_new_kv_cache(normalized_states, current_pos, rotary_emb)
        seq_length = k.shape[2]
        self.kv_cache_0[layer_idx:layer_idx + 1, :, current_pos:current_pos + seq_length, :] = k
        self.kv_cache_0[L + layer_idx:L + layer_idx + 1, :, current_pos:current_pos + seq_length, :] = v
        key_cache = self.kv_cache_0[layer_idx:layer_idx + 1].squeeze(0)
        value_cache = self.kv_cache_0[L + layer_idx:L + layer_idx + 1].squeeze(0)
        fwd = layer.self_attn.forward_prefill if IN_PREFILL else layer.self_attn.forward_regular
        hidden_states = hidden_states + fwd(normalized_states, q, kv_cache_layer=(key_cache, value_cache), causal_mask=causal_mask)
        if IN_PREFILL and layer_idx == len(self.layers) - 1:
            return hidden_states  # Skip MLP for last layer in prefill mode since output isn't used
        return hidden_states + layer.mlp(layer.post_attention_layernorm(hidden_states))

    def forward(self, hidden_states, position_ids, causal_mask, current_pos, IN_PREFILL=False):
        if IN_PREFILL:
            rotary_emb = self.get_rotary_embedding_prefill(position_ids)
        else:
            rotary_emb = self.get_rotary_embeddings_s(current_pos)
        for i in range(len(self.layers)):
            hidden_states = self.process_layer(i, hidden_states, position_ids, causal_mask, current_pos, rotary_emb, IN_PREFILL)
        return self.norm(hidden_states)


# --- tests/chat.py driver (embed / ffn / lm_head are separate converted models) ---

def make_causal_mask(length, start):
    mask = np.full((1, 1, length, length), -np.inf, dtype=np.float32)
    row_indices = np.arange(length).reshape(length, 1)
    col_indices = np.arange(length).reshape(1, length)
    mask[:, :, col_indices <= (row_indices + start)] = 0
    return mask


def initialize_causal_mask(context_length):
    return torch.tensor(make_causal_mask(context_length, 0), dtype=torch.float32)


def run_prefill(embed_model, ffn_model, input_ids, context_pos, context_length, batch_size=8, causal_mask=None):
    batch_pos = 0
    while batch_pos < context_pos:
        batch_end = min(batch_pos + batch_size, context_pos)
        current_batch_size = batch_end - batch_pos
        batch_input = input_ids[:, batch_pos:batch_end]
        batch_input = F.pad(batch_input, (0, batch_size - current_batch_size), value=0)
        if FIXED:
            position_ids = torch.arange(batch_pos, batch_pos + batch_size, dtype=torch.int32)
            batch_causal_mask = causal_mask[:, :, batch_pos:batch_pos + batch_size, :]
        else:
            position_ids = torch.arange(batch_size, dtype=torch.int32)  # Changed: Always use full batch size
            batch_causal_mask = causal_mask[:, :, :batch_size, :]  # Changed: Use full batch size
        hidden_states = embed_model(batch_input)
        ffn_model(hidden_states, position_ids.long(), batch_causal_mask, batch_pos, IN_PREFILL=True)
        batch_pos = batch_end
    return torch.tensor([context_pos], dtype=torch.int32)


def generate_next_token(embed_model, ffn_model, lmhead_model, input_ids, pos, causal_mask):
    current_token = input_ids[:, pos - 1:pos]
    hidden_states = embed_model(current_token)
    single_causal_mask = causal_mask[:, :, pos - 1:pos, :]
    out = ffn_model(hidden_states, torch.tensor([pos - 1]), single_causal_mask, pos - 1, IN_PREFILL=False)
    return lmhead_model(out)[0, -1]


config = LlamaConfig()
embed_model = nn.Embedding(config.vocab_size, config.hidden_size)
ffn_model = LlamaModel(config)
lmhead_model = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
causal_mask = initialize_causal_mask(config.context_length)

prompt = torch.randint(1, config.vocab_size, (1, 21))
context_pos = prompt.shape[1] - 1  # prefill all but the last token; the last one is decoded

with torch.no_grad():
    # chunked prefill (batch_size=8 -> 3 chunks), then one decode step
    ffn_model.kv_cache_0.zero_()
    run_prefill(embed_model, ffn_model, prompt, context_pos, config.context_length, batch_size=8, causal_mask=causal_mask)
    logits_chunked = generate_next_token(embed_model, ffn_model, lmhead_model, prompt, context_pos + 1, causal_mask)

    # reference: feed every prompt token through the single-token (regular) path
    ffn_model.kv_cache_0.zero_()
    for p in range(1, context_pos + 2):
        logits_ref = generate_next_token(embed_model, ffn_model, lmhead_model, prompt, p, causal_mask)

print(f"max |next-token logits (chunked prefill) - logits (token-by-token)| = {(logits_chunked - logits_ref).abs().max().item():.6f}")
