"""SGLang trtllm_mla backend: chunked-prefix MHA merges rows whose chunk holds no prefix keys.

Citation: sgl-project/sglang#22688 ("Fix trtllm mla chunked-prefill zero-length bug", fixes
sgl-project/sglang#22291; the same kernel behaviour is described in flashinfer-ai/flashinfer#3047).

DeepSeek MLA prefill with a radix-cache hit runs the new tokens causally (forward_normal_chunked_kv),
then walks the cached prefix in chunks (`_chunked_prefix_attn_mha`): each chunk's latent cache is
up-projected by kv_b_proj, attended non-causally with `trtllm_ragged_attention_deepseek`
(seq_lens = prefix_chunk_seq_lens[i], cum_seq_lens_kv = prefix_chunk_cu_seq_lens[i]) and merged
into the running (output, lse) with `merge_state_v2`. The number of chunks follows the longest
prefix in the batch, so a request with a short prefix has kv_len == 0 in the later chunks.

The bug: the TRT-LLM ragged cubin does not write rows whose kv_len is 0. Their output stays as
allocated (zeros) and their LSE is read back from stale softmaxStats in the shared workspace
buffer (what the previous launch left there), a finite number. merge_state_v2 then gives a zero
output a real weight, shrinking that request's attention output in every layer.

The fix: `prefix_chunk_has_zero_kv[i]` is precomputed in prepare_chunked_prefix_cache_info, and
after the kernel `fixup_zero_kv_rows(out, lse, prefix_chunk_seq_lens[i], cum_seq_lens, ...)` sets
out = 0 and lse = -inf for zero-KV rows so merge_state ignores them.

Ported (python/sglang/srt/layers/attention/trtllm_mla_backend.py forward_extend,
python/sglang/srt/model_executor/forward_batch_info.py chunked-prefix metadata,
python/sglang/srt/models/deepseek_v2.py forward_normal_chunked_kv / _chunked_prefix_attn_mha) to
CPU at tiny sizes with random weights. The closed-source cubin is written in torch: it computes
each request's rows from its own q/kv ranges, writes softmax stats into the workspace, and skips
rows whose kv_len is 0, as the backend's comment describes. Two requests extend after prefixes of
6 and 20 cached tokens with a prefix chunk of 8, so the first request has no prefix keys in chunks
1 and 2.
"""

import math
import sys
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


# ---------------------------------------------------------------- kernels (torch stand-ins)
def trtllm_ragged_attention_deepseek(query, key, value, workspace_buffer, seq_lens, max_q_len,
                                     max_kv_len, bmm1_scale, bmm2_scale, o_sf_scale, batch_size,
                                     window_left, cum_seq_lens_q, cum_seq_lens_kv, enable_pdl,
                                     is_causal, return_lse, out=None, **kwargs):
    """Ragged MHA as the cubin runs it: rows of a request with kv_len == 0 are never visited, so
    their output keeps what `out` held and their softmax stats keep the workspace's stale value."""
    num_tokens, num_heads, _ = query.shape
    if out is None:
        out = torch.empty(num_tokens, num_heads, value.shape[-1])
    softmax_stats = workspace_buffer[: num_tokens * num_heads].view(num_tokens, num_heads)
    for b in range(batch_size):
        qs, qe = int(cum_seq_lens_q[b]), int(cum_seq_lens_q[b + 1])
        ks, ke = int(cum_seq_lens_kv[b]), int(cum_seq_lens_kv[b + 1])
        kv_len = int(seq_lens[b])
        if qe == qs or kv_len == 0:
            continue
        q = query[qs:qe].transpose(0, 1)  # h, q, d
        k = key[ks:ke].transpose(0, 1)
        v = value[ks:ke].transpose(0, 1)
        scores = torch.matmul(q, k.transpose(-1, -2)) * bmm1_scale
        if is_causal:
            q_len = qe - qs
            q_pos = torch.arange(q_len).unsqueeze(1) + (kv_len - q_len)
            k_pos = torch.arange(kv_len).unsqueeze(0)
            scores = scores.masked_fill(k_pos > q_pos, float("-inf"))
        lse = torch.logsumexp(scores, dim=-1)  # h, q
        out[qs:qe] = (torch.matmul(torch.softmax(scores, dim=-1), v) * bmm2_scale).transpose(0, 1)
        softmax_stats[qs:qe] = lse.transpose(0, 1)
    if return_lse:
        return out, softmax_stats.clone()
    return out


def fixup_zero_kv_rows(out, lse, kv_lens, cum_seq_lens, max_seq_len):
    """For sequences with kv_lens[i] == 0, sets out[tokens_i] = 0 and lse[tokens_i] = -inf."""
    for i in range(kv_lens.shape[0]):
        if int(kv_lens[i]) > 0:
            continue
        s, e = int(cum_seq_lens[i]), int(cum_seq_lens[i + 1])
        out[s:e] = 0
        lse[s:e] = float("-inf")


def merge_state_v2(v_a, s_a, v_b, s_b, v_merged, s_merged):
    # v: [tokens, heads, dim], s: [tokens, heads] (natural log)
    s_max = torch.maximum(s_a, s_b)
    w_a = torch.exp(s_a - s_max)
    w_b = torch.exp(s_b - s_max)
    v_merged.copy_((v_a * w_a.unsqueeze(-1) + v_b * w_b.unsqueeze(-1)) / (w_a + w_b).unsqueeze(-1))
    s_merged.copy_(s_max + torch.log(w_a + w_b))


# ---------------------------------------------------------------- pools and batch metadata
class MLATokenToKVPool:
    def __init__(self, size, num_layers, kv_lora_rank, qk_rope_head_dim):
        self.kv_buffer = [torch.zeros(size, 1, kv_lora_rank + qk_rope_head_dim)
                          for _ in range(num_layers)]

    def get_key_buffer(self, layer_id):
        return self.kv_buffer[layer_id]

    def set_mla_kv_buffer(self, layer, loc, cache_k_nope, cache_k_rope):
        self.kv_buffer[layer.layer_id][loc] = torch.cat([cache_k_nope, cache_k_rope], dim=-1)


class ForwardBatch:
    def __init__(self, req_to_token, req_pool_indices, seq_lens, extend_prefix_lens, positions,
                 out_cache_loc, token_to_kv_pool, prefix_chunk_len):
        self.req_to_token = req_to_token
        self.req_pool_indices = req_pool_indices
        self.seq_lens = seq_lens
        self.batch_size = len(seq_lens)
        self.extend_prefix_lens = extend_prefix_lens
        self.extend_prefix_lens_cpu = extend_prefix_lens.tolist()
        self.extend_seq_lens = seq_lens - extend_prefix_lens
        self.positions = positions
        self.out_cache_loc = out_cache_loc
        self.token_to_kv_pool = token_to_kv_pool
        self.prefix_chunk_len = prefix_chunk_len
        self.attn_attend_prefix_cache = None
        self.prefix_chunk_idx = None
        self.mha_return_lse = max(self.extend_prefix_lens_cpu) > 0
        if self.mha_return_lse:
            self.prepare_chunked_prefix_cache_info()

    def get_prefix_chunk_seq_param(self, prefix_lens, num_prefix_chunks, prefix_chunk_len):
        prefix_chunk_starts = (
            torch.arange(num_prefix_chunks, dtype=torch.int32).unsqueeze(1).expand(-1, self.batch_size)
            * prefix_chunk_len
        )
        prefix_chunk_ends = torch.min(
            prefix_lens.unsqueeze(0), prefix_chunk_starts + prefix_chunk_len
        ).to(torch.int32)
        prefix_chunk_seq_lens = (prefix_chunk_ends - prefix_chunk_starts).clamp(min=0).to(torch.int32)
        return prefix_chunk_starts, prefix_chunk_seq_lens

    def prepare_chunked_prefix_cache_info(self):
        self.num_prefix_chunks = (
            max(self.extend_prefix_lens_cpu) + self.prefix_chunk_len - 1
        ) // self.prefix_chunk_len
        self.prefix_chunk_starts, self.prefix_chunk_seq_lens = self.get_prefix_chunk_seq_param(
            self.extend_prefix_lens, self.num_prefix_chunks, self.prefix_chunk_len
        )
        self.prefix_chunk_cu_seq_lens = torch.zeros(
            self.num_prefix_chunks, self.batch_size + 1, dtype=torch.int32
        )
        self.prefix_chunk_cu_seq_lens[:, 1:] = torch.cumsum(self.prefix_chunk_seq_lens, dim=1)
        self.prefix_chunk_max_seq_lens = self.prefix_chunk_seq_lens.max(dim=1).values.tolist()
        self.prefix_chunk_num_tokens = self.prefix_chunk_seq_lens.sum(dim=1).tolist()
        self.prefix_chunk_has_zero_kv = [
            bool((self.prefix_chunk_seq_lens[i] == 0).any()) for i in range(self.num_prefix_chunks)
        ]
        self.prefix_chunk_kv_indices = []
        for idx in range(self.num_prefix_chunks):
            rows = []
            for b in range(self.batch_size):
                start = int(self.prefix_chunk_starts[idx, b])
                n = int(self.prefix_chunk_seq_lens[idx, b])
                rows.append(self.req_to_token[self.req_pool_indices[b], start:start + n])
            self.prefix_chunk_kv_indices.append(torch.cat(rows))

    def set_prefix_chunk_idx(self, idx):
        self.prefix_chunk_idx = idx

    def set_attn_attend_prefix_cache(self, attn_attend_prefix_cache):
        self.attn_attend_prefix_cache = attn_attend_prefix_cache


class TRTLLMMLABackend:
    def __init__(self, workspace_size):
        self.workspace_buffer = torch.zeros(workspace_size)  # shared across layers and launches
        self.forward_prefill_metadata = None

    def init_forward_metadata(self, forward_batch):
        seq_lens_q = forward_batch.extend_seq_lens.to(torch.int32)
        cum_seq_lens = torch.zeros(forward_batch.batch_size + 1, dtype=torch.int32)
        cum_seq_lens[1:] = torch.cumsum(seq_lens_q, dim=0)
        cum_seq_lens_kv = torch.zeros(forward_batch.batch_size + 1, dtype=torch.int32)
        cum_seq_lens_kv[1:] = torch.cumsum(seq_lens_q, dim=0)
        self.forward_prefill_metadata = SimpleNamespace(
            max_seq_len=int(seq_lens_q.max()), cum_seq_lens=cum_seq_lens, seq_lens=seq_lens_q,
        )

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=False):
        q = q.view(-1, layer.tp_q_head_num, layer.head_dim)
        k = k.view(-1, layer.tp_k_head_num, layer.head_dim)
        v = v.view(-1, layer.tp_k_head_num, layer.v_head_dim)
        common_trtllm_args = {
            "query": q,
            "key": k,
            "value": v,
            "workspace_buffer": self.workspace_buffer,
            "batch_size": forward_batch.batch_size,
            "window_left": -1,
            "enable_pdl": False,
            "max_q_len": self.forward_prefill_metadata.max_seq_len,
            "bmm1_scale": layer.scaling,
            "bmm2_scale": 1.0,
            "cum_seq_lens_q": self.forward_prefill_metadata.cum_seq_lens,
        }
        if forward_batch.attn_attend_prefix_cache:
            chunk_idx = forward_batch.prefix_chunk_idx
            out = torch.zeros(q.shape[0], layer.tp_q_head_num, layer.v_head_dim)
            result = trtllm_ragged_attention_deepseek(
                **common_trtllm_args,
                seq_lens=forward_batch.prefix_chunk_seq_lens[chunk_idx],
                max_kv_len=forward_batch.prefix_chunk_max_seq_lens[chunk_idx],
                o_sf_scale=-1.0,
                cum_seq_lens_kv=forward_batch.prefix_chunk_cu_seq_lens[chunk_idx],
                is_causal=False,
                return_lse=True,
                out=out,
            )
            if FIXED and forward_batch.prefix_chunk_has_zero_kv[chunk_idx]:
                out_tensor, lse_tensor = result
                fixup_zero_kv_rows(
                    out_tensor,
                    lse_tensor,
                    forward_batch.prefix_chunk_seq_lens[chunk_idx],
                    self.forward_prefill_metadata.cum_seq_lens,
                    self.forward_prefill_metadata.max_seq_len,
                )
            return result
        else:
            out = torch.zeros(q.shape[0], q.shape[1], v.shape[2])
            return trtllm_ragged_attention_deepseek(
                **common_trtllm_args,
                seq_lens=self.forward_prefill_metadata.seq_lens,
                max_kv_len=self.forward_prefill_metadata.max_seq_len,
                o_sf_scale=1.0,
                cum_seq_lens_kv=self.forward_prefill_metadata.cum_seq_lens,
                is_causal=True,
                return_lse=forward_batch.mha_return_lse,
                out=out,
            )


# ---------------------------------------------------------------- model
def apply_rope(x, positions, rope_dim, base=10000.0):
    inv_freq = 1.0 / (base ** (torch.arange(0, rope_dim, 2).float() / rope_dim))
    freqs = positions.float().unsqueeze(-1) * inv_freq
    cos, sin = freqs.cos().unsqueeze(1), freqs.sin().unsqueeze(1)
    x1, x2 = x[..., ::2], x[..., 1::2]
    out = torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)
    return out.flatten(-2)


class DeepseekV2AttentionMLA(nn.Module):
    def __init__(self, cfg, layer_id, attn_backend):
        super().__init__()
        self.num_local_heads = cfg.num_heads
        self.qk_nope_head_dim = cfg.qk_nope_head_dim
        self.qk_rope_head_dim = cfg.qk_rope_head_dim
        self.qk_head_dim = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
        self.v_head_dim = cfg.v_head_dim
        self.kv_lora_rank = cfg.kv_lora_rank
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_heads * self.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(cfg.hidden_size, cfg.kv_lora_rank + cfg.qk_rope_head_dim,
                                            bias=False)
        self.kv_a_layernorm = nn.RMSNorm(cfg.kv_lora_rank, eps=1e-6)
        self.kv_b_proj = nn.Linear(cfg.kv_lora_rank,
                                   cfg.num_heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.v_head_dim, cfg.hidden_size, bias=False)
        self.attn_mha = SimpleNamespace(
            layer_id=layer_id, tp_q_head_num=cfg.num_heads, tp_k_head_num=cfg.num_heads,
            head_dim=self.qk_head_dim, v_head_dim=cfg.v_head_dim,
            scaling=self.qk_head_dim ** -0.5,
        )
        self.attn_backend = attn_backend

    def _attn_mha(self, q, k, v, forward_batch):
        return self.attn_backend.forward_extend(q, k, v, self.attn_mha, forward_batch)

    def _chunked_prefix_attn_mha(self, q, accum_output, accum_lse, forward_batch):
        for i in range(forward_batch.num_prefix_chunks):
            forward_batch.set_prefix_chunk_idx(i)
            latent_cache_buf = forward_batch.token_to_kv_pool.get_key_buffer(self.attn_mha.layer_id)
            latent_cache = latent_cache_buf[forward_batch.prefix_chunk_kv_indices[i]].contiguous()
            kv_a_normed, k_pe = latent_cache.split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
            kv_a_normed = kv_a_normed.squeeze(1).contiguous()
            kv = self.kv_b_proj(kv_a_normed)
            kv = kv.view(-1, self.num_local_heads, self.qk_nope_head_dim + self.v_head_dim)
            v = kv[..., self.qk_nope_head_dim:]
            k_nope = kv[..., : self.qk_nope_head_dim]
            k = torch.empty(k_nope.shape[0], self.num_local_heads, self.qk_head_dim)
            k[..., : self.qk_nope_head_dim] = k_nope
            k[..., self.qk_nope_head_dim:] = k_pe
            output, lse = self._attn_mha(q, k, v, forward_batch)
            tmp_output = torch.empty_like(accum_output)
            tmp_lse = torch.empty_like(accum_lse)
            merge_state_v2(output, lse, accum_output, accum_lse, tmp_output, tmp_lse)
            accum_output, accum_lse = tmp_output, tmp_lse
        return accum_output

    def forward(self, positions, hidden_states, forward_batch):
        q = self.q_proj(hidden_states).view(-1, self.num_local_heads, self.qk_head_dim)
        q_nope, q_pe = q.split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        latent_cache = self.kv_a_proj_with_mqa(hidden_states)
        kv_a, k_pe = latent_cache.split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        kv_a = self.kv_a_layernorm(kv_a)
        k_pe = k_pe.unsqueeze(1)
        q_pe = apply_rope(q_pe, positions, self.qk_rope_head_dim)
        k_pe = apply_rope(k_pe, positions, self.qk_rope_head_dim)
        q = torch.cat([q_nope, q_pe], dim=-1)
        kv = self.kv_b_proj(kv_a).view(-1, self.num_local_heads, self.qk_nope_head_dim + self.v_head_dim)
        k_nope, v = kv[..., : self.qk_nope_head_dim], kv[..., self.qk_nope_head_dim:]
        k = torch.cat([k_nope, k_pe.expand(-1, self.num_local_heads, -1)], dim=-1)
        forward_batch.token_to_kv_pool.set_mla_kv_buffer(
            self.attn_mha, forward_batch.out_cache_loc, kv_a.unsqueeze(1), k_pe
        )
        # forward_normal_chunked_kv_core: new tokens causally, then the cached prefix in chunks
        forward_batch.set_attn_attend_prefix_cache(False)
        result = self._attn_mha(q, k, v, forward_batch)
        if forward_batch.mha_return_lse:
            attn_output, lse = result
            forward_batch.set_attn_attend_prefix_cache(True)
            attn_output = self._chunked_prefix_attn_mha(q, attn_output, lse, forward_batch)
        else:
            attn_output = result
        return self.o_proj(attn_output.reshape(-1, self.num_local_heads * self.v_head_dim))


class DeepseekV2DecoderLayer(nn.Module):
    def __init__(self, cfg, layer_id, attn_backend):
        super().__init__()
        self.input_layernorm = nn.RMSNorm(cfg.hidden_size, eps=1e-6)
        self.self_attn = DeepseekV2AttentionMLA(cfg, layer_id, attn_backend)
        self.post_attention_layernorm = nn.RMSNorm(cfg.hidden_size, eps=1e-6)
        self.mlp = nn.Sequential(nn.Linear(cfg.hidden_size, 4 * cfg.hidden_size), nn.SiLU(),
                                 nn.Linear(4 * cfg.hidden_size, cfg.hidden_size))

    def forward(self, positions, hidden_states, forward_batch):
        h = hidden_states + self.self_attn(positions, self.input_layernorm(hidden_states), forward_batch)
        return h + self.mlp(self.post_attention_layernorm(h))


class DeepseekV2ForCausalLM(nn.Module):
    def __init__(self, cfg, attn_backend):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            [DeepseekV2DecoderLayer(cfg, i, attn_backend) for i in range(cfg.num_hidden_layers)]
        )
        self.norm = nn.RMSNorm(cfg.hidden_size, eps=1e-6)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.attn_backend = attn_backend

    @torch.no_grad()
    def forward(self, input_ids, positions, forward_batch):
        self.attn_backend.init_forward_metadata(forward_batch)
        h = self.embed_tokens(input_ids)
        for layer in self.layers:
            h = layer(positions, h, forward_batch)
        return self.lm_head(self.norm(h))


# ---------------------------------------------------------------- scheduler-side driver
cfg = SimpleNamespace(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_heads=2,
                      qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, kv_lora_rank=16)
backend = TRTLLMMLABackend(workspace_size=4096)
model = DeepseekV2ForCausalLM(cfg, backend).eval()
pool = MLATokenToKVPool(256, cfg.num_hidden_layers, cfg.kv_lora_rank, cfg.qk_rope_head_dim)
req_to_token = torch.zeros(4, 64, dtype=torch.long)
next_free = [1]


def alloc(n):
    loc = torch.arange(next_free[0], next_free[0] + n)
    next_free[0] += n
    return loc


def run_extend(req_ids, token_lists, prefix_lens):
    input_ids, positions, out_cache_loc, seq_lens = [], [], [], []
    for rid, toks, pre in zip(req_ids, token_lists, prefix_lens):
        loc = alloc(len(toks))
        req_to_token[rid, pre:pre + len(toks)] = loc
        input_ids.append(torch.tensor(toks))
        positions.append(torch.arange(pre, pre + len(toks)))
        out_cache_loc.append(loc)
        seq_lens.append(pre + len(toks))
    fb = ForwardBatch(req_to_token, torch.tensor(req_ids), torch.tensor(seq_lens, dtype=torch.int32),
                      torch.tensor(prefix_lens, dtype=torch.int32), torch.cat(positions),
                      torch.cat(out_cache_loc), pool, prefix_chunk_len=8)
    return model(torch.cat(input_ids), torch.cat(positions), fb), fb


g = torch.Generator().manual_seed(1)
prompt_a = torch.randint(0, cfg.vocab_size, (10,), generator=g).tolist()
prompt_b = torch.randint(0, cfg.vocab_size, (25,), generator=g).tolist()
prefix_a, prefix_b = 6, 20

# Earlier requests left their prefixes in the radix cache (req_to_token rows 0 and 1).
run_extend([0], [prompt_a[:prefix_a]], [0])
run_extend([1], [prompt_b[:prefix_b]], [0])

# A batch that hits the cache: new tokens only, the prefix read back chunk by chunk.
logits, fb = run_extend([0, 1], [prompt_a[prefix_a:], prompt_b[prefix_b:]], [prefix_a, prefix_b])
print("prefix_chunk_seq_lens:", fb.prefix_chunk_seq_lens.tolist())
n_a = len(prompt_a) - prefix_a
print("request A last-token logits[:6]:", [round(x, 4) for x in logits[n_a - 1, :6].tolist()])
print("request B last-token logits[:6]:", [round(x, 4) for x in logits[-1, :6].tolist()])
print("request A next token:", int(logits[n_a - 1].argmax()), "request B next token:", int(logits[-1].argmax()))
