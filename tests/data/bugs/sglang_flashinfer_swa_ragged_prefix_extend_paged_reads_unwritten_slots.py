# sgl-project/sglang#26513 ("Fix FlashInfer SWA EXTEND-with-prefix correctness in merge_state path", merged).
#
# SGLang's FlashInfer backend, sliding-window model, EXTEND with a radix-cache prefix hit and use_ragged=True:
# forward_extend runs the ragged wrapper (query vs the new tokens' K/V) and the paged wrapper (query vs the
# KV pool) and merges the two with merge_state. Before the fix, FlashInferIndicesUpdaterPrefill.
# update_sliding_window planned the paged wrapper over min(seq_lens, window + extend_lens) keys ending at
# seq_len, i.e. over the extend tokens' slots too, which are written to the pool only after the paged wrapper
# has run, and neither forward_return_lse call passed window_left. The fix plans the paged wrapper over the
# prefix only (its last `window` keys, kv_start_idx = prefix_lens - window clamped at 0, with a per-query
# window mask over those keys) and passes window_left to both wrappers.
#
# The backend code follows python/sglang/srt/layers/attention/flashinfer_backend.py (fixed side read at
# 0005834c; the pre-fix side rebuilt from the PR description). flashinfer's wrappers are replaced by a plain
# torch stand-in with the same plan/run arguments (page_size 1, NHD, window_left, custom_mask, base-2 lse).
import sys
from dataclasses import dataclass
from typing import List, Optional

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv


# --------------------------------------------------------------------------------------------------------------
# flashinfer stand-in (BatchPrefillWithRaggedKVCacheWrapper / BatchPrefillWithPagedKVCacheWrapper / merge_state)
# --------------------------------------------------------------------------------------------------------------
def _attend(q, k, v, sm_scale, causal, window_left, custom_mask):
    # q: (qo_len, H, D), k/v: (kv_len, H, D); flashinfer aligns the query to the bottom-right of the keys
    qo_len, kv_len = q.shape[0], k.shape[0]
    s = torch.einsum("qhd,khd->hqk", q.float(), k.float()) * sm_scale
    q_pos = torch.arange(qo_len).view(-1, 1) + (kv_len - qo_len)
    k_pos = torch.arange(kv_len).view(1, -1)
    keep = torch.ones(qo_len, kv_len, dtype=torch.bool)
    if causal:
        keep &= k_pos <= q_pos
    if window_left >= 0:
        keep &= k_pos >= q_pos - window_left
    if custom_mask is not None:
        keep &= custom_mask.view(qo_len, kv_len).bool()
    s = s.masked_fill(~keep, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # (H, qo_len); -inf where a row keeps no key
    p = torch.exp(s - lse.unsqueeze(-1)).nan_to_num(0.0)  # such a row gives o = 0, as the kernel does
    o = torch.einsum("hqk,khd->qhd", p, v.float())
    return o.to(q.dtype), (lse / torch.log(torch.tensor(2.0))).transpose(0, 1).contiguous()


class BatchPrefillWithRaggedKVCacheWrapper:
    def __init__(self, workspace_buffer, kv_layout="NHD", backend="auto"):
        self.qo_indptr = None
        self.kv_indptr = None

    def begin_forward(self, qo_indptr, kv_indptr, num_qo_heads, num_kv_heads, head_dim, q_data_type=None):
        self.qo_indptr = qo_indptr.clone()
        self.kv_indptr = kv_indptr.clone()

    def forward_return_lse(self, q, k, v, causal=False, sm_scale=None, window_left=-1, logits_soft_cap=None):
        outs, lses = [], []
        for i in range(len(self.qo_indptr) - 1):
            qs, qe = int(self.qo_indptr[i]), int(self.qo_indptr[i + 1])
            ks, ke = int(self.kv_indptr[i]), int(self.kv_indptr[i + 1])
            o, lse = _attend(q[qs:qe], k[ks:ke], v[ks:ke], sm_scale, causal, window_left, None)
            outs.append(o)
            lses.append(lse)
        return torch.cat(outs), torch.cat(lses)

    def forward(self, q, k, v, causal=False, sm_scale=None, window_left=-1, logits_soft_cap=None):
        return self.forward_return_lse(q, k, v, causal, sm_scale, window_left, logits_soft_cap)[0]


class BatchPrefillWithPagedKVCacheWrapper:
    def __init__(self, workspace_buffer, kv_layout="NHD", backend="auto"):
        self.custom_mask = None

    def begin_forward(self, qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, num_qo_heads,
                      num_kv_heads, head_dim, page_size, q_data_type=None, kv_data_type=None, custom_mask=None,
                      non_blocking=True):
        self.qo_indptr = qo_indptr.clone()
        self.kv_indptr = paged_kv_indptr.clone()
        self.kv_indices = paged_kv_indices.clone()
        self.custom_mask = None if custom_mask is None else custom_mask.clone()

    def forward_return_lse(self, q, paged_kv_cache, causal=False, sm_scale=None, window_left=-1,
                           logits_soft_cap=None):
        k_buffer, v_buffer = paged_kv_cache
        outs, lses = [], []
        mask_off = 0
        for i in range(len(self.qo_indptr) - 1):
            qs, qe = int(self.qo_indptr[i]), int(self.qo_indptr[i + 1])
            ks, ke = int(self.kv_indptr[i]), int(self.kv_indptr[i + 1])
            idx = self.kv_indices[ks:ke].long()
            m = None
            if self.custom_mask is not None:
                n = (qe - qs) * (ke - ks)
                m = self.custom_mask[mask_off:mask_off + n]
                mask_off += n
            o, lse = _attend(q[qs:qe], k_buffer[idx], v_buffer[idx], sm_scale, causal, window_left, m)
            outs.append(o)
            lses.append(lse)
        return torch.cat(outs), torch.cat(lses)

    def forward(self, q, paged_kv_cache, causal=False, sm_scale=None, window_left=-1, logits_soft_cap=None):
        return self.forward_return_lse(q, paged_kv_cache, causal, sm_scale, window_left, logits_soft_cap)[0]


def merge_state(v_a, s_a, v_b, s_b):
    s_max = torch.maximum(s_a, s_b)
    w_a = torch.exp2(s_a - s_max)
    w_b = torch.exp2(s_b - s_max)
    v = (v_a.float() * w_a.unsqueeze(-1) + v_b.float() * w_b.unsqueeze(-1)) / (w_a + w_b).unsqueeze(-1)
    return v.to(v_a.dtype), s_max + torch.log2(w_a + w_b)


def create_flashinfer_kv_indices_triton(req_to_token, req_pool_indices, page_kernel_lens, kv_indptr,
                                        kv_start_idx, kv_indices_ptr, req_to_token_ptr_stride):
    for i in range(len(req_pool_indices)):
        start = int(kv_start_idx[i]) if kv_start_idx is not None else 0
        n = int(page_kernel_lens[i])
        off = int(kv_indptr[i])
        kv_indices_ptr[off:off + n] = req_to_token[int(req_pool_indices[i]), start:start + n]


# --------------------------------------------------------------------------------------------------------------
# SGLang pieces: pools, ForwardBatch, RadixAttention, the FlashInfer backend
# --------------------------------------------------------------------------------------------------------------
class ReqToTokenPool:
    def __init__(self, size, max_context_len):
        self.req_to_token = torch.zeros((size, max_context_len), dtype=torch.int32)


class MHATokenToKVPool:
    def __init__(self, size, head_num, head_dim, layer_num):
        self.k_buffer = [torch.zeros((size + 1, head_num, head_dim)) for _ in range(layer_num)]
        self.v_buffer = [torch.zeros((size + 1, head_num, head_dim)) for _ in range(layer_num)]

    def get_kv_buffer(self, layer_id):
        return self.k_buffer[layer_id], self.v_buffer[layer_id]

    def set_kv_buffer(self, layer, loc, cache_k, cache_v):
        self.k_buffer[layer.layer_id][loc] = cache_k.view(-1, *self.k_buffer[0].shape[1:])
        self.v_buffer[layer.layer_id][loc] = cache_v.view(-1, *self.v_buffer[0].shape[1:])


@dataclass
class ForwardBatch:
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    seq_lens_sum: int
    extend_prefix_lens: torch.Tensor
    extend_prefix_lens_cpu: List[int]
    out_cache_loc: torch.Tensor
    positions: torch.Tensor
    attn_backend: "FlashInferAttnBackend" = None


@dataclass
class PrefillMetadata:
    prefill_wrappers: List[BatchPrefillWithPagedKVCacheWrapper]
    use_ragged: bool
    extend_no_prefix: bool


class RadixAttention(nn.Module):
    def __init__(self, num_heads, head_dim, scaling, num_kv_heads, layer_id, sliding_window_size=-1,
                 logit_cap=0.0):
        super().__init__()
        self.tp_q_head_num = num_heads
        self.tp_k_head_num = num_kv_heads
        self.tp_v_head_num = num_kv_heads
        self.head_dim = head_dim
        self.scaling = scaling
        self.layer_id = layer_id
        self.logit_cap = logit_cap
        # flashinfer's window_left counts the keys left of the query, so a window of W keys is W - 1
        self.sliding_window_size = sliding_window_size - 1 if sliding_window_size != -1 else -1

    def forward(self, q, k, v, forward_batch):
        return forward_batch.attn_backend.forward_extend(q, k, v, self, forward_batch)


class FlashInferIndicesUpdaterPrefill:
    def __init__(self, model_runner, attn_backend):
        self.num_qo_heads = model_runner.num_attention_heads
        self.num_kv_heads = model_runner.num_kv_heads
        self.head_dim = model_runner.head_dim
        self.sliding_window_size = model_runner.sliding_window_size
        self.attn_backend = attn_backend
        self.kv_indptr = attn_backend.kv_indptr
        self.kv_last_page_len = attn_backend.kv_last_page_len
        self.qo_indptr = attn_backend.qo_indptr
        self.req_to_token = model_runner.req_to_token_pool.req_to_token
        self.prefill_wrapper_ragged = attn_backend.prefill_wrapper_ragged
        self.update = self.update_sliding_window

    def update_sliding_window(self, req_pool_indices, seq_lens, seq_lens_sum, prefix_lens, prefill_wrappers,
                              use_ragged):
        sliding_window_size = self.sliding_window_size
        for wrapper_id in range(2):
            swa_paged_custom_mask = None
            if wrapper_id == 0:
                if FIXED and use_ragged:
                    # K for extend tokens is written after the paged wrapper runs, so
                    # the paged wrapper sees prefix-only. Trim to the last `window` tokens.
                    effective_start = torch.clamp(prefix_lens - sliding_window_size, min=0)
                    paged_kernel_lens = prefix_lens - effective_start
                    paged_kernel_lens_sum = paged_kernel_lens.sum().item()
                    kv_start_idx = effective_start
                    swa_paged_custom_mask = self._build_swa_prefix_custom_mask(
                        prefix_lens, seq_lens, effective_start
                    )
                else:
                    # window attention use paged only
                    paged_kernel_lens = torch.minimum(
                        seq_lens,
                        sliding_window_size + seq_lens - prefix_lens,
                    )
                    paged_kernel_lens_sum = paged_kernel_lens.sum().item()
                    kv_start_idx = seq_lens - paged_kernel_lens
            else:
                # full attention
                paged_kernel_lens = seq_lens
                paged_kernel_lens_sum = seq_lens_sum
                kv_start_idx = seq_lens - paged_kernel_lens

            self.call_begin_forward(
                self.prefill_wrapper_ragged,
                prefill_wrappers[wrapper_id],
                req_pool_indices,
                paged_kernel_lens,
                paged_kernel_lens_sum,
                seq_lens,
                prefix_lens,
                kv_start_idx,
                self.kv_indptr[wrapper_id],
                self.qo_indptr[wrapper_id],
                use_ragged,
                cross_attention_custom_mask=swa_paged_custom_mask,
            )

    def _build_swa_prefix_custom_mask(self, prefix_lens, seq_lens, kv_start_idx):
        window = self.sliding_window_size
        if window is None or window < 0:
            return None
        prefix_lens_cpu = prefix_lens.tolist()
        extend_lens_cpu = (seq_lens - prefix_lens).tolist()
        kv_start_cpu = kv_start_idx.tolist()
        if all(p == 0 for p in prefix_lens_cpu):
            return None
        mask_parts = []
        need_mask = False
        for prefix_len, extend_len, kv_start in zip(prefix_lens_cpu, extend_lens_cpu, kv_start_cpu):
            paged_len = int(prefix_len - kv_start)  # = min(prefix_len, window)
            if paged_len == 0 or extend_len == 0:
                continue
            q_abs = torch.arange(extend_len).view(-1, 1) + prefix_len
            k_abs = torch.arange(paged_len).view(1, -1) + kv_start
            block = (k_abs >= (q_abs - window)).to(torch.uint8)
            if not bool(block.all()):
                need_mask = True
            mask_parts.append(block.view(-1))
        if not need_mask or not mask_parts:
            return None
        return torch.cat(mask_parts)

    def call_begin_forward(self, wrapper_ragged, wrapper_paged, req_pool_indices, paged_kernel_lens,
                           paged_kernel_lens_sum, seq_lens, prefix_lens, kv_start_idx, kv_indptr, qo_indptr,
                           use_ragged, cross_attention_custom_mask=None):
        bs = len(seq_lens)
        kv_indptr[1: bs + 1] = torch.cumsum(paged_kernel_lens, dim=0)
        kv_indptr = kv_indptr[: bs + 1]
        kv_indices = torch.empty(paged_kernel_lens_sum + 256, dtype=torch.int32)
        create_flashinfer_kv_indices_triton(
            self.req_to_token,
            req_pool_indices,
            paged_kernel_lens,
            kv_indptr,
            kv_start_idx,
            kv_indices,
            self.req_to_token.shape[1],
        )
        qo_indptr[1: bs + 1] = torch.cumsum(seq_lens - prefix_lens, dim=0)
        qo_indptr = qo_indptr[: bs + 1]
        custom_mask = cross_attention_custom_mask

        # extend part
        if use_ragged:
            wrapper_ragged.begin_forward(qo_indptr, qo_indptr, self.num_qo_heads, self.num_kv_heads,
                                         self.head_dim)
        # cached part
        wrapper_paged.begin_forward(
            qo_indptr,
            kv_indptr,
            kv_indices,
            self.kv_last_page_len[:bs],
            self.num_qo_heads,
            self.num_kv_heads,
            self.head_dim,
            1,
            custom_mask=custom_mask,
            non_blocking=True,
        )


class FlashInferAttnBackend:
    def __init__(self, model_runner):
        self.token_to_kv_pool = model_runner.token_to_kv_pool
        self.num_wrappers = 2  # model_runner.sliding_window_size is not None
        max_bs = 8
        self.kv_indptr = [torch.zeros((max_bs + 1,), dtype=torch.int32) for _ in range(self.num_wrappers)]
        self.kv_last_page_len = torch.ones((max_bs,), dtype=torch.int32)
        self.qo_indptr = [torch.zeros((max_bs + 1,), dtype=torch.int32) for _ in range(self.num_wrappers)]
        self.prefill_wrapper_ragged = BatchPrefillWithRaggedKVCacheWrapper(None, "NHD")
        self.prefill_wrappers_paged = [BatchPrefillWithPagedKVCacheWrapper(None, "NHD") for _ in range(2)]
        self.indices_updater_prefill = FlashInferIndicesUpdaterPrefill(model_runner, self)
        self.forward_metadata = None

    def init_forward_metadata(self, forward_batch):
        prefix_lens = forward_batch.extend_prefix_lens
        use_ragged = True
        extend_no_prefix = not any(forward_batch.extend_prefix_lens_cpu)
        self.indices_updater_prefill.update(
            forward_batch.req_pool_indices,
            forward_batch.seq_lens,
            forward_batch.seq_lens_sum,
            prefix_lens,
            prefill_wrappers=self.prefill_wrappers_paged,
            use_ragged=use_ragged,
        )
        self.forward_metadata = PrefillMetadata(self.prefill_wrappers_paged, use_ragged, extend_no_prefix)

    def _get_wrapper_idx(self, layer):
        return layer.sliding_window_size == -1

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        prefill_wrapper_paged = self.forward_metadata.prefill_wrappers[self._get_wrapper_idx(layer)]
        cache_loc = forward_batch.out_cache_loc
        logits_soft_cap = layer.logit_cap
        q = q.contiguous()
        causal = True
        if self.forward_metadata.extend_no_prefix:
            o = self.prefill_wrapper_ragged.forward(
                q.view(-1, layer.tp_q_head_num, layer.head_dim),
                k.view(-1, layer.tp_k_head_num, layer.head_dim),
                v.view(-1, layer.tp_v_head_num, layer.head_dim),
                causal=causal,
                sm_scale=layer.scaling,
                logits_soft_cap=logits_soft_cap,
            )
        elif FIXED:
            swa_window_left = layer.sliding_window_size
            o1, s1 = self.prefill_wrapper_ragged.forward_return_lse(
                q.view(-1, layer.tp_q_head_num, layer.head_dim),
                k.view(-1, layer.tp_k_head_num, layer.head_dim),
                v.view(-1, layer.tp_v_head_num, layer.head_dim),
                causal=causal,
                sm_scale=layer.scaling,
                window_left=swa_window_left,
                logits_soft_cap=logits_soft_cap,
            )
            o2, s2 = prefill_wrapper_paged.forward_return_lse(
                q.view(-1, layer.tp_q_head_num, layer.head_dim),
                self.token_to_kv_pool.get_kv_buffer(layer.layer_id),
                causal=False,
                sm_scale=layer.scaling,
                window_left=swa_window_left,
                logits_soft_cap=logits_soft_cap,
            )
            o, _ = merge_state(o1, s1, o2, s2)
        else:
            o1, s1 = self.prefill_wrapper_ragged.forward_return_lse(
                q.view(-1, layer.tp_q_head_num, layer.head_dim),
                k.view(-1, layer.tp_k_head_num, layer.head_dim),
                v.view(-1, layer.tp_v_head_num, layer.head_dim),
                causal=causal,
                sm_scale=layer.scaling,
                logits_soft_cap=logits_soft_cap,
            )
            o2, s2 = prefill_wrapper_paged.forward_return_lse(
                q.view(-1, layer.tp_q_head_num, layer.head_dim),
                self.token_to_kv_pool.get_kv_buffer(layer.layer_id),
                causal=False,
                sm_scale=layer.scaling,
                logits_soft_cap=logits_soft_cap,
            )
            o, _ = merge_state(o1, s1, o2, s2)

        if save_kv_cache:
            self.token_to_kv_pool.set_kv_buffer(layer, cache_loc, k, v)
        return o.view(-1, layer.tp_q_head_num * layer.head_dim)


# --------------------------------------------------------------------------------------------------------------
# A tiny Mistral-style model (every layer sliding-window), SGLang layout
# --------------------------------------------------------------------------------------------------------------
class Config:
    vocab_size = 64
    hidden_size = 32
    num_attention_heads = 4
    num_key_value_heads = 4
    num_hidden_layers = 2
    intermediate_size = 64
    sliding_window = 4
    rope_theta = 10000.0
    rms_norm_eps = 1e-6


def apply_rotary(x, positions, head_dim, theta):
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2).float() / head_dim))
    freqs = positions.float().view(-1, 1) * inv_freq.view(1, -1)
    cos, sin = freqs.cos().unsqueeze(1), freqs.sin().unsqueeze(1)
    x1, x2 = x[..., : head_dim // 2], x[..., head_dim // 2:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class MistralAttention(nn.Module):
    def __init__(self, config, layer_id):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.rope_theta = config.rope_theta
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)
        self.attn = RadixAttention(self.num_heads, self.head_dim, self.head_dim ** -0.5, self.num_kv_heads,
                                   layer_id, sliding_window_size=config.sliding_window)

    def forward(self, positions, hidden_states, forward_batch):
        q = self.q_proj(hidden_states).view(-1, self.num_heads, self.head_dim)
        k = self.k_proj(hidden_states).view(-1, self.num_kv_heads, self.head_dim)
        v = self.v_proj(hidden_states).view(-1, self.num_kv_heads, self.head_dim)
        q = apply_rotary(q, positions, self.head_dim, self.rope_theta)
        k = apply_rotary(k, positions, self.head_dim, self.rope_theta)
        attn_output = self.attn(q, k, v, forward_batch)
        return self.o_proj(attn_output)


class MistralDecoderLayer(nn.Module):
    def __init__(self, config, layer_id):
        super().__init__()
        self.self_attn = MistralAttention(config, layer_id)
        self.input_layernorm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, positions, hidden_states, forward_batch):
        h = hidden_states + self.self_attn(positions, self.input_layernorm(hidden_states), forward_batch)
        gate, up = self.gate_up_proj(self.post_attention_layernorm(h)).chunk(2, dim=-1)
        return h + self.down_proj(nn.functional.silu(gate) * up)


class MistralForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([MistralDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids, positions, forward_batch):
        h = self.embed_tokens(input_ids)
        for layer in self.layers:
            h = layer(positions, h, forward_batch)
        return self.lm_head(self.norm(h))


class ModelRunner:
    def __init__(self, config):
        self.num_attention_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.hidden_size // config.num_attention_heads
        # get_attention_sliding_window_size(): the window in flashinfer's window_left convention
        self.sliding_window_size = config.sliding_window - 1
        self.req_to_token_pool = ReqToTokenPool(8, 64)
        self.token_to_kv_pool = MHATokenToKVPool(256, config.num_key_value_heads, self.head_dim,
                                                 config.num_hidden_layers)
        self.attn_backend = FlashInferAttnBackend(self)
        self.free_slots = list(range(1, 257))

    def alloc(self, n):
        out, self.free_slots = self.free_slots[:n], self.free_slots[n:]
        return torch.tensor(out, dtype=torch.int64)


def run_extend(model, runner, reqs):
    """reqs: list of (req_pool_idx, token_ids, prefix_len); the prefix's slots are already in req_to_token."""
    input_ids, positions, out_cache_loc, seq_lens, prefix_lens = [], [], [], [], []
    for req_pool_idx, token_ids, prefix_len in reqs:
        extend = token_ids[prefix_len:]
        loc = runner.alloc(len(extend))
        runner.req_to_token_pool.req_to_token[req_pool_idx, prefix_len:len(token_ids)] = loc.to(torch.int32)
        input_ids.append(torch.tensor(extend))
        positions.append(torch.arange(prefix_len, len(token_ids)))
        out_cache_loc.append(loc)
        seq_lens.append(len(token_ids))
        prefix_lens.append(prefix_len)
    fb = ForwardBatch(
        req_pool_indices=torch.tensor([r[0] for r in reqs]),
        seq_lens=torch.tensor(seq_lens),
        seq_lens_sum=sum(seq_lens),
        extend_prefix_lens=torch.tensor(prefix_lens),
        extend_prefix_lens_cpu=prefix_lens,
        out_cache_loc=torch.cat(out_cache_loc),
        positions=torch.cat(positions),
        attn_backend=runner.attn_backend,
    )
    runner.attn_backend.init_forward_metadata(fb)
    return model(torch.cat(input_ids), fb.positions, fb)


def main():
    torch.manual_seed(0)
    config = Config()
    model = MistralForCausalLM(config).eval()
    runner = ModelRunner(config)

    system = [5, 17, 33, 2]
    with torch.no_grad():
        # request 0: the shared system prompt, no prefix in the radix cache
        run_extend(model, runner, [(0, system, 0)])
        # requests 1 and 2 hit the radix cache for the system prompt and extend it
        prefix_slots = runner.req_to_token_pool.req_to_token[0, : len(system)].clone()
        runner.req_to_token_pool.req_to_token[1, : len(system)] = prefix_slots
        runner.req_to_token_pool.req_to_token[2, : len(system)] = prefix_slots
        user1 = system + [9, 14, 22, 50, 7, 31]
        user2 = system + [44, 1, 19]
        logits = run_extend(model, runner, [(1, user1, len(system)), (2, user2, len(system))])

    last = torch.tensor([len(user1) - len(system) - 1, len(user1) - len(system) + len(user2) - len(system) - 1])
    next_tokens = logits[last].argmax(-1)
    print("next tokens:", next_tokens.tolist())
    for i in range(2):
        print(f"request {i + 1} last-token logits[:6]:", [round(x, 4) for x in logits[last[i], :6].tolist()])


if __name__ == "__main__":
    main()
