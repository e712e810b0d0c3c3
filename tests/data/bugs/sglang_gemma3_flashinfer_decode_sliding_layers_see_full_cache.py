# sgl-project/sglang#4823: "gemma3: impl `get_attention_sliding_window_size` for attn init"
# ModelRunner sets model_runner.sliding_window_size from model.get_attention_sliding_window_size() when the model
# has it, and the flashinfer backend only builds its second (sliding-window) decode wrapper when that is not None.
# Gemma3ForCausalLM lacked the method, so the backend ran one wrapper: every decode step of a sliding layer
# attended the whole KV cache (prefill still used window_left per layer). The fix adds the method to
# Gemma3ForCausalLM (returning config.sliding_window - 1), so decode indices are clamped to the window.
import sys
from enum import Enum, auto
from typing import List, Optional

import torch
from torch import nn
from transformers import Gemma3TextConfig

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


# Aligned with HF's implementation, using sliding window inclusive with the last token
# SGLang assumes exclusive
def get_attention_sliding_window_size(config):
    return config.sliding_window - 1


# ---------------------------------------------------------------- flashinfer stand-ins (page_size = 1)
class BatchDecodeWithPagedKVCacheWrapper:
    def begin_forward(self, kv_indptr, kv_indices):
        self.kv_indptr, self.kv_indices = kv_indptr, kv_indices

    def forward(self, q, kv_buffer, sm_scale, logits_soft_cap=0.0):
        k_buf, v_buf = kv_buffer
        out = torch.empty_like(q)
        self.last_probs = []
        for i in range(q.shape[0]):
            idx = self.kv_indices[self.kv_indptr[i]: self.kv_indptr[i + 1]]
            k, v = k_buf[idx], v_buf[idx]  # [n, kv_heads, d]
            rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
            s = torch.einsum("hd,nhd->hn", q[i], k) * sm_scale
            p = s.softmax(-1)
            self.last_probs.append(p)
            out[i] = torch.einsum("hn,nhd->hd", p, v)
        return out


def prefill_with_window_left(q, k, v, sm_scale, window_left):
    """Ragged prefill of one request: causal, and window_left (exclusive) when >= 0."""
    n = q.shape[0]
    qi = torch.arange(n)[:, None]
    ki = torch.arange(n)[None, :]
    allowed = ki <= qi
    if window_left >= 0:
        allowed &= ki >= qi - window_left
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    s = torch.einsum("qhd,khd->hqk", q, k) * sm_scale
    s = s.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", s.softmax(-1), v)


class WrapperDispatch(Enum):
    SLIDING_WINDOW = auto()
    CROSS_ATTENTION = auto()


class FlashInferIndicesUpdaterDecode:
    def __init__(self, model_runner, attn_backend):
        self.sliding_window_size = model_runner.sliding_window_size
        self.attn_backend = attn_backend
        self.req_to_token = model_runner.req_to_token_pool.req_to_token
        if self.attn_backend.dispatch_reason == WrapperDispatch.SLIDING_WINDOW:
            self.update = self.update_sliding_window
        else:
            assert self.attn_backend.num_wrappers == 1
            self.update = self.update_single_wrapper

    def update_single_wrapper(self, req_pool_indices, seq_lens, seq_lens_sum, decode_wrappers):
        self.call_begin_forward(decode_wrappers[0], req_pool_indices, seq_lens, seq_lens_sum, None)

    def update_sliding_window(self, req_pool_indices, seq_lens, seq_lens_sum, decode_wrappers):
        for wrapper_id in range(2):
            if wrapper_id == 0:
                # Sliding window attention
                paged_kernel_lens_tmp = torch.minimum(seq_lens, torch.tensor(self.sliding_window_size + 1))
                paged_kernel_lens_sum_tmp = paged_kernel_lens_tmp.sum().item()
                kv_start_idx_tmp = seq_lens - paged_kernel_lens_tmp
            else:
                # Full attention
                paged_kernel_lens_tmp = seq_lens
                paged_kernel_lens_sum_tmp = seq_lens_sum
                kv_start_idx_tmp = None
            self.call_begin_forward(decode_wrappers[wrapper_id], req_pool_indices, paged_kernel_lens_tmp,
                                    paged_kernel_lens_sum_tmp, kv_start_idx_tmp)

    def call_begin_forward(self, wrapper, req_pool_indices, paged_kernel_lens, paged_kernel_lens_sum, kv_start_idx):
        kv_indptr = torch.zeros(len(req_pool_indices) + 1, dtype=torch.int64)
        kv_indptr[1:] = torch.cumsum(paged_kernel_lens, dim=0)
        kv_indices = torch.empty(paged_kernel_lens_sum, dtype=torch.int64)
        for i, req in enumerate(req_pool_indices.tolist()):  # create_flashinfer_kv_indices_triton
            start = 0 if kv_start_idx is None else int(kv_start_idx[i])
            n = int(paged_kernel_lens[i])
            kv_indices[kv_indptr[i]: kv_indptr[i] + n] = self.req_to_token[req, start: start + n]
        wrapper.begin_forward(kv_indptr, kv_indices)


class FlashInferAttnBackend:
    def __init__(self, model_runner):
        if model_runner.sliding_window_size is not None:
            self.num_wrappers = 2
            self.dispatch_reason = WrapperDispatch.SLIDING_WINDOW
        else:
            self.num_wrappers = 1
            self.dispatch_reason = None
        self.decode_wrappers = [BatchDecodeWithPagedKVCacheWrapper() for _ in range(self.num_wrappers)]
        self.indices_updater_decode = FlashInferIndicesUpdaterDecode(model_runner, self)

    def init_forward_metadata(self, forward_batch):
        if forward_batch.is_decode:
            self.indices_updater_decode.update(forward_batch.req_pool_indices, forward_batch.seq_lens,
                                               int(forward_batch.seq_lens.sum()), self.decode_wrappers)

    def _get_wrapper_idx(self, layer):
        if self.num_wrappers == 1:
            return 0
        if self.dispatch_reason == WrapperDispatch.SLIDING_WINDOW:
            return int(layer.sliding_window_size == -1)
        raise ValueError

    def forward_extend(self, q, k, v, layer, forward_batch):
        forward_batch.token_to_kv_pool.set_kv_buffer(layer, forward_batch.out_cache_loc, k, v)
        o = torch.empty_like(q)
        start = 0
        for n in forward_batch.seq_lens.tolist():
            o[start:start + n] = prefill_with_window_left(q[start:start + n], k[start:start + n],
                                                          v[start:start + n], layer.scaling,
                                                          window_left=layer.sliding_window_size)
            start += n
        return o

    def forward_decode(self, q, k, v, layer, forward_batch):
        decode_wrapper = self.decode_wrappers[self._get_wrapper_idx(layer)]
        forward_batch.token_to_kv_pool.set_kv_buffer(layer, forward_batch.out_cache_loc, k, v)
        o = decode_wrapper.forward(q, forward_batch.token_to_kv_pool.get_kv_buffer(layer.layer_id),
                                   sm_scale=layer.scaling)
        layer.last_probs = decode_wrapper.last_probs
        return o


# ---------------------------------------------------------------- pools, batch, runner
class ReqToTokenPool:
    def __init__(self, size, max_context_len):
        self.req_to_token = torch.zeros((size, max_context_len), dtype=torch.int64)


class MHATokenToKVPool:
    def __init__(self, size, head_num, head_dim, layer_num):
        self.k_buffer = [torch.zeros(size, head_num, head_dim) for _ in range(layer_num)]
        self.v_buffer = [torch.zeros(size, head_num, head_dim) for _ in range(layer_num)]

    def get_kv_buffer(self, layer_id):
        return self.k_buffer[layer_id], self.v_buffer[layer_id]

    def set_kv_buffer(self, layer, loc, cache_k, cache_v):
        self.k_buffer[layer.layer_id][loc] = cache_k
        self.v_buffer[layer.layer_id][loc] = cache_v


class ForwardBatch:
    def __init__(self, is_decode, req_pool_indices, seq_lens, out_cache_loc, positions, token_to_kv_pool):
        self.is_decode = is_decode
        self.req_pool_indices = req_pool_indices
        self.seq_lens = seq_lens
        self.out_cache_loc = out_cache_loc
        self.positions = positions
        self.token_to_kv_pool = token_to_kv_pool


class RadixAttention(nn.Module):
    def __init__(self, num_heads, head_dim, scaling, num_kv_heads, layer_id, sliding_window_size=-1):
        super().__init__()
        self.tp_q_head_num, self.tp_k_head_num, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scaling = scaling
        self.layer_id = layer_id
        self.sliding_window_size = sliding_window_size or -1

    def forward(self, q, k, v, forward_batch):
        q = q.view(-1, self.tp_q_head_num, self.head_dim)
        k = k.view(-1, self.tp_k_head_num, self.head_dim)
        v = v.view(-1, self.tp_k_head_num, self.head_dim)
        if forward_batch.is_decode:
            o = ATTN_BACKEND.forward_decode(q, k, v, self, forward_batch)
        else:
            o = ATTN_BACKEND.forward_extend(q, k, v, self, forward_batch)
        return o.reshape(-1, self.tp_q_head_num * self.head_dim)


# ---------------------------------------------------------------- gemma3_causal.py (trimmed)
def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Gemma3Attention(nn.Module):
    def __init__(self, layer_id, config):
        super().__init__()
        self.head_dim = config.head_dim
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.is_sliding = config.layer_types[layer_id] == "sliding_attention"
        if self.is_sliding:
            # Local attention. Override the values in config.json.
            self.rope_theta = 10000.0
            self.sliding_window = get_attention_sliding_window_size(config)
        else:
            self.rope_theta = 1000000.0
            self.sliding_window = None
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=False)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=False)
        self.inv_freq = 1.0 / (self.rope_theta ** (torch.arange(0, self.head_dim, 2).float() / self.head_dim))
        self.attn = RadixAttention(self.num_heads, self.head_dim, config.query_pre_attn_scalar ** -0.5,
                                   num_kv_heads=self.num_kv_heads, layer_id=layer_id,
                                   sliding_window_size=self.sliding_window)

    def forward(self, positions, hidden_states, forward_batch):
        q, k, v = self.qkv_proj(hidden_states).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.unflatten(-1, (self.num_heads, self.head_dim))
        k = k.unflatten(-1, (self.num_kv_heads, self.head_dim))
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), -1)
        cos, sin = emb.cos()[:, None], emb.sin()[:, None]
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        return self.o_proj(self.attn(q.flatten(-2), k.flatten(-2), v, forward_batch))


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, layer_id, config):
        super().__init__()
        self.self_attn = Gemma3Attention(layer_id, config)
        self.input_layernorm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = nn.Sequential(nn.Linear(config.hidden_size, config.intermediate_size), nn.GELU(),
                                 nn.Linear(config.intermediate_size, config.hidden_size))

    def forward(self, positions, h, forward_batch):
        h = h + self.self_attn(positions, self.input_layernorm(h), forward_batch)
        return h + self.mlp(h)


class Gemma3ForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([Gemma3DecoderLayer(i, config) for i in range(config.num_hidden_layers)])
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids, positions, forward_batch):
        h = self.embed_tokens(input_ids) * (self.config.hidden_size ** 0.5)
        for layer in self.layers:
            h = layer(positions, h, forward_batch)
        return self.lm_head(h)


if FIXED:
    def _get_attention_sliding_window_size(self):
        return get_attention_sliding_window_size(self.config)

    Gemma3ForCausalLM.get_attention_sliding_window_size = _get_attention_sliding_window_size


class ModelRunner:
    def __init__(self, model, req_to_token_pool):
        self.model = model
        self.req_to_token_pool = req_to_token_pool
        self.sliding_window_size = (
            self.model.get_attention_sliding_window_size()
            if hasattr(self.model, "get_attention_sliding_window_size")
            else None
        )


# ---------------------------------------------------------------- serve two requests: prefill, then decode
config = Gemma3TextConfig(
    vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
    num_key_value_heads=1, head_dim=16, sliding_window=4, query_pre_attn_scalar=16,
    layer_types=["sliding_attention", "full_attention"],
)
model = Gemma3ForCausalLM(config).eval()
req_to_token_pool = ReqToTokenPool(4, 32)
runner = ModelRunner(model, req_to_token_pool)
ATTN_BACKEND = FlashInferAttnBackend(runner)
print("model_runner.sliding_window_size =", runner.sliding_window_size, "| decode wrappers:", ATTN_BACKEND.num_wrappers)

kv_pool = MHATokenToKVPool(128, config.num_key_value_heads, config.head_dim, config.num_hidden_layers)
prompts = [torch.randint(0, 64, (6,)), torch.randint(0, 64, (9,))]
req_pool_indices = torch.tensor([0, 1])
next_free = 0
for i, p in enumerate(prompts):
    req_to_token_pool.req_to_token[i, :len(p)] = torch.arange(next_free, next_free + len(p))
    next_free += len(p)
seq_lens = torch.tensor([len(p) for p in prompts])

with torch.no_grad():
    fb = ForwardBatch(False, req_pool_indices, seq_lens, torch.arange(next_free),
                      torch.cat([torch.arange(len(p)) for p in prompts]), kv_pool)
    logits = model(torch.cat(prompts), fb.positions, fb)
    next_ids = logits[torch.cumsum(seq_lens, 0) - 1].argmax(-1)
    generated = [next_ids.tolist()]
    for step in range(3):
        for i in range(2):
            req_to_token_pool.req_to_token[i, seq_lens[i]] = next_free + i
        out_loc = torch.arange(next_free, next_free + 2)
        next_free += 2
        positions = seq_lens.clone()
        seq_lens = seq_lens + 1
        fb = ForwardBatch(True, req_pool_indices, seq_lens, out_loc, positions, kv_pool)
        ATTN_BACKEND.init_forward_metadata(fb)
        logits = model(next_ids, positions, fb)
        next_ids = logits.argmax(-1)
        generated.append(next_ids.tolist())

probs = model.layers[0].self_attn.attn.last_probs
print("last decode step, sliding layer: keys attended per request =", [p.shape[-1] for p in probs],
      "| seq_lens =", seq_lens.tolist(), "| window (incl. current) =", config.sliding_window)
print("generated:", generated)
print("final logits[1][:4]:", [round(x, 4) for x in logits[1, :4].tolist()])
