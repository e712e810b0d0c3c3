# sgl-project/sglang#26147: "[NPU] Add Gemma4 Sliding Window Attention support on Ascend backend"
# Gemma4Attention.__init__ (python/sglang/srt/models/gemma4_causal.py) handed RadixAttention
# `sliding_window_size=config.sliding_window`. HF's sliding_window counts the current token, SGLang's
# backends treat sliding_window_size as exclusive (keys k >= q - sliding_window_size), so every sliding
# layer saw one key more than the model was trained with. The fix uses get_attention_sliding_window_size(config),
# i.e. config.sliding_window - 1, as gemma2.py / gemma3_causal.py already did.
import sys
from typing import List

import torch
from torch import nn
from torch.nn.functional import scaled_dot_product_attention
from transformers import Gemma4TextConfig

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


# Aligned with HF's implementation, using sliding window inclusive with the last token
# SGLang assumes exclusive
def get_attention_sliding_window_size(config):
    return config.sliding_window - 1


# ---------------------------------------------------------------- memory pools / batch
class ReqToTokenPool:
    def __init__(self, size, max_context_len):
        self.req_to_token = torch.zeros((size, max_context_len), dtype=torch.int64)


class MHATokenToKVPool:
    def __init__(self, size, head_num, head_dim, layer_num):
        self.k_buffer = [torch.zeros(size, head_num, head_dim) for _ in range(layer_num)]
        self.v_buffer = [torch.zeros(size, head_num, head_dim) for _ in range(layer_num)]

    def get_key_buffer(self, layer_id):
        return self.k_buffer[layer_id]

    def get_value_buffer(self, layer_id):
        return self.v_buffer[layer_id]

    def set_kv_buffer(self, layer, loc, cache_k, cache_v):
        self.k_buffer[layer.layer_id][loc] = cache_k
        self.v_buffer[layer.layer_id][loc] = cache_v


class ForwardBatch:
    def __init__(self, is_extend, req_pool_indices, seq_lens, out_cache_loc, positions,
                 req_to_token_pool, token_to_kv_pool, extend_prefix_lens=None, extend_seq_lens=None):
        self.is_extend = is_extend
        self.req_pool_indices = req_pool_indices
        self.seq_lens = seq_lens
        self.seq_lens_cpu = seq_lens.tolist()
        self.out_cache_loc = out_cache_loc
        self.positions = positions
        self.req_to_token_pool = req_to_token_pool
        self.token_to_kv_pool = token_to_kv_pool
        if is_extend:
            self.extend_prefix_lens = extend_prefix_lens
            self.extend_prefix_lens_cpu = extend_prefix_lens.tolist()
            self.extend_seq_lens = extend_seq_lens
            self.extend_seq_lens_cpu = extend_seq_lens.tolist()


# ---------------------------------------------------------------- torch_native backend
def _make_sliding_window_mask(q_len, kv_len, sliding_window_size, device, query_offset):
    q = torch.arange(q_len, device=device)[:, None] + query_offset
    k = torch.arange(kv_len, device=device)[None, :]
    return (k <= q) & (k >= q - sliding_window_size)


class TorchNativeAttnBackend:
    def _run_sdpa_forward_extend(self, query, output, k_cache, v_cache, req_to_token, req_pool_indices,
                                 seq_lens, seq_lens_cpu: List[int], extend_prefix_lens,
                                 extend_prefix_lens_cpu: List[int], extend_seq_lens,
                                 extend_seq_lens_cpu: List[int], scaling=None, enable_gqa=False,
                                 causal=False, sliding_window_size=None):
        query = query.movedim(0, query.dim() - 2)
        start_q = 0
        for seq_idx in range(seq_lens.shape[0]):
            extend_seq_len_q = extend_seq_lens_cpu[seq_idx]
            prefill_seq_len_q = extend_prefix_lens_cpu[seq_idx]
            seq_len_kv = seq_lens_cpu[seq_idx]
            end_q = start_q + extend_seq_len_q

            per_req_query = query[:, start_q:end_q, :]
            per_req_query_redudant = torch.empty(
                (per_req_query.shape[0], seq_len_kv, per_req_query.shape[2]), dtype=per_req_query.dtype)
            per_req_query_redudant[:, prefill_seq_len_q:, :] = per_req_query

            req_pool_idx = req_pool_indices[seq_idx]
            per_req_tokens = req_to_token[req_pool_idx, :seq_len_kv]
            per_req_key = k_cache[per_req_tokens].movedim(0, query.dim() - 2)
            per_req_value = v_cache[per_req_tokens].movedim(0, query.dim() - 2)

            attn_mask = None
            is_causal = causal
            if sliding_window_size is not None and sliding_window_size > -1:
                attn_mask = _make_sliding_window_mask(seq_len_kv, seq_len_kv, sliding_window_size,
                                                      query.device, query_offset=0)
                is_causal = False
            per_req_out_redudant = (
                scaled_dot_product_attention(
                    per_req_query_redudant.unsqueeze(0), per_req_key.unsqueeze(0), per_req_value.unsqueeze(0),
                    attn_mask=attn_mask, enable_gqa=enable_gqa, scale=scaling, is_causal=is_causal,
                ).squeeze(0).movedim(query.dim() - 2, 0)
            )
            output[start_q:end_q, :, :] = per_req_out_redudant[prefill_seq_len_q:, :, :]
            start_q = end_q
        return output

    def _run_sdpa_forward_decode(self, query, output, k_cache, v_cache, req_to_token, req_pool_indices,
                                 seq_lens, seq_lens_cpu: List[int], scaling=None, enable_gqa=False,
                                 causal=False, sliding_window_size=None):
        query = query.movedim(0, query.dim() - 2)
        start_q = 0
        for seq_idx in range(seq_lens.shape[0]):
            seq_len_q = 1
            seq_len_kv = seq_lens_cpu[seq_idx]
            end_q = start_q + seq_len_q
            per_req_query = query[:, start_q:end_q, :]
            req_pool_idx = req_pool_indices[seq_idx]
            per_req_tokens = req_to_token[req_pool_idx, :seq_len_kv]
            per_req_key = k_cache[per_req_tokens].movedim(0, query.dim() - 2)
            per_req_value = v_cache[per_req_tokens].movedim(0, query.dim() - 2)

            attn_mask = None
            if sliding_window_size is not None and sliding_window_size > -1:
                attn_mask = _make_sliding_window_mask(seq_len_q, seq_len_kv, sliding_window_size,
                                                      query.device, query_offset=seq_len_kv - seq_len_q)
            per_req_out = (
                scaled_dot_product_attention(
                    per_req_query.unsqueeze(0), per_req_key.unsqueeze(0), per_req_value.unsqueeze(0),
                    attn_mask=attn_mask, enable_gqa=enable_gqa, scale=scaling, is_causal=causal,
                ).squeeze(0).movedim(query.dim() - 2, 0)
            )
            output[start_q:end_q, :, :] = per_req_out
            start_q = end_q
        return output

    def forward(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        o = torch.empty_like(q)
        if save_kv_cache:
            forward_batch.token_to_kv_pool.set_kv_buffer(layer, forward_batch.out_cache_loc, k, v)
        use_gqa = layer.tp_q_head_num != layer.tp_k_head_num
        q_ = q.view(-1, layer.tp_q_head_num, layer.qk_head_dim)
        o_ = o.view(-1, layer.tp_q_head_num, layer.v_head_dim)
        pool = forward_batch.token_to_kv_pool
        if forward_batch.is_extend:
            self._run_sdpa_forward_extend(
                q_, o_, pool.get_key_buffer(layer.layer_id), pool.get_value_buffer(layer.layer_id),
                forward_batch.req_to_token_pool.req_to_token, forward_batch.req_pool_indices,
                forward_batch.seq_lens, forward_batch.seq_lens_cpu, forward_batch.extend_prefix_lens,
                forward_batch.extend_prefix_lens_cpu, forward_batch.extend_seq_lens,
                forward_batch.extend_seq_lens_cpu, scaling=layer.scaling, enable_gqa=use_gqa,
                causal=True, sliding_window_size=layer.sliding_window_size)
        else:
            self._run_sdpa_forward_decode(
                q_, o_, pool.get_key_buffer(layer.layer_id), pool.get_value_buffer(layer.layer_id),
                forward_batch.req_to_token_pool.req_to_token, forward_batch.req_pool_indices,
                forward_batch.seq_lens, forward_batch.seq_lens_cpu, scaling=layer.scaling,
                enable_gqa=use_gqa, causal=False, sliding_window_size=layer.sliding_window_size)
        return o


ATTN_BACKEND = TorchNativeAttnBackend()


class RadixAttention(nn.Module):
    def __init__(self, num_heads, head_dim, scaling, num_kv_heads, layer_id, sliding_window_size=-1):
        super().__init__()
        self.tp_q_head_num = num_heads
        self.tp_k_head_num = num_kv_heads
        self.qk_head_dim = head_dim
        self.v_head_dim = head_dim
        self.scaling = scaling
        self.layer_id = layer_id
        self.sliding_window_size = sliding_window_size or -1

    def forward(self, q, k, v, forward_batch, save_kv_cache=True):
        k = k.view(-1, self.tp_k_head_num, self.qk_head_dim)
        v = v.view(-1, self.tp_k_head_num, self.v_head_dim)
        return ATTN_BACKEND.forward(q, k, v, self, forward_batch, save_kv_cache)


# ---------------------------------------------------------------- model
def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim, base):
        super().__init__()
        self.head_dim = head_dim
        self.inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2).float() / head_dim))

    def forward(self, positions, q, k):
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos()[:, None, :], emb.sin()[:, None, :]
        q = q.unflatten(-1, (-1, self.head_dim))
        k = k.unflatten(-1, (-1, self.head_dim))
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        return q.flatten(-2, -1), k.flatten(-2, -1)


class Gemma4Attention(nn.Module):
    def __init__(self, layer_id, config: Gemma4TextConfig, head_dim):
        super().__init__()
        self.layer_id = layer_id
        layer_type = config.layer_types[layer_id]
        if FIXED:
            self.sliding_window = (
                get_attention_sliding_window_size(config) if layer_type == "sliding_attention" else None
            )
        else:
            self.sliding_window = config.sliding_window if layer_type == "sliding_attention" else None
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = head_dim
        self.q_size = self.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=False)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=False)
        rope_parameters = dict(config.rope_parameters[layer_type])
        self.rotary_emb = RotaryEmbedding(head_dim, rope_parameters.get("rope_theta", 10000.0))
        self.attn = RadixAttention(self.num_heads, head_dim, 1.0, num_kv_heads=self.num_kv_heads,
                                   layer_id=layer_id, sliding_window_size=self.sliding_window)

    def forward(self, positions, hidden_states, forward_batch):
        qkv = self.qkv_proj(hidden_states)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = nn.functional.normalize(q.unflatten(-1, (self.num_heads, self.head_dim)), dim=-1).flatten(-2, -1)
        k = nn.functional.normalize(k.unflatten(-1, (self.num_kv_heads, self.head_dim)), dim=-1).flatten(-2, -1)
        q, k = self.rotary_emb(positions, q, k)
        attn_output = self.attn(q, k, v, forward_batch=forward_batch)
        return self.o_proj(attn_output)


class Gemma4DecoderLayer(nn.Module):
    def __init__(self, layer_id, config):
        super().__init__()
        self.self_attn = Gemma4Attention(layer_id, config, config.head_dim)
        self.input_layernorm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = nn.Sequential(nn.Linear(config.hidden_size, config.intermediate_size), nn.GELU(),
                                 nn.Linear(config.intermediate_size, config.hidden_size))

    def forward(self, positions, hidden_states, forward_batch):
        hidden_states = hidden_states + self.self_attn(positions, self.input_layernorm(hidden_states), forward_batch)
        return hidden_states + self.mlp(hidden_states)


class Gemma4ForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([Gemma4DecoderLayer(i, config) for i in range(config.num_hidden_layers)])
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids, positions, forward_batch):
        h = self.embed_tokens(input_ids) * (self.embed_tokens.embedding_dim ** 0.5)
        for layer in self.layers:
            h = layer(positions, h, forward_batch)
        return self.lm_head(h)


# ---------------------------------------------------------------- serve two requests: extend, then decode
config = Gemma4TextConfig(
    vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
    num_key_value_heads=1, head_dim=16, sliding_window=4,
    layer_types=["sliding_attention", "full_attention"],
)
config.allow_global_per_layer_attribute_access = True
model = Gemma4ForCausalLM(config).eval()
print("sliding layer RadixAttention.sliding_window_size =", model.layers[0].self_attn.attn.sliding_window_size,
      "(config.sliding_window =", config.sliding_window, ")")

req_to_token_pool = ReqToTokenPool(4, 32)
kv_pool = MHATokenToKVPool(128, config.num_key_value_heads, config.head_dim, config.num_hidden_layers)
prompts = [torch.randint(0, 64, (7,)), torch.randint(0, 64, (10,))]
req_pool_indices = torch.tensor([0, 1])
next_free = 0
for i, p in enumerate(prompts):
    req_to_token_pool.req_to_token[i, : len(p)] = torch.arange(next_free, next_free + len(p))
    next_free += len(p)

seq_lens = torch.tensor([len(p) for p in prompts])
fb = ForwardBatch(True, req_pool_indices, seq_lens, torch.arange(0, next_free),
                  torch.cat([torch.arange(len(p)) for p in prompts]), req_to_token_pool, kv_pool,
                  extend_prefix_lens=torch.zeros(2, dtype=torch.int64), extend_seq_lens=seq_lens.clone())
with torch.no_grad():
    logits = model(torch.cat(prompts), fb.positions, fb)
    last = torch.cumsum(seq_lens, 0) - 1
    next_ids = logits[last].argmax(-1)
    generated = [next_ids.tolist()]
    for step in range(3):
        for i in range(2):
            req_to_token_pool.req_to_token[i, seq_lens[i]] = next_free + i
        out_loc = torch.arange(next_free, next_free + 2)
        next_free += 2
        positions = seq_lens.clone()
        seq_lens = seq_lens + 1
        fb = ForwardBatch(False, req_pool_indices, seq_lens, out_loc, positions, req_to_token_pool, kv_pool)
        logits = model(next_ids, positions, fb)
        next_ids = logits.argmax(-1)
        generated.append(next_ids.tolist())

m = _make_sliding_window_mask(1, int(seq_lens[1]), model.layers[0].self_attn.attn.sliding_window_size,
                              "cpu", int(seq_lens[1]) - 1)
print("last decode step, request 1, sliding layer: keys visible =", int(m.sum()), m.int().tolist())
print("generated:", generated)
print("final logits[1][:4]:", [round(x, 4) for x in logits[1, :4].tolist()])
