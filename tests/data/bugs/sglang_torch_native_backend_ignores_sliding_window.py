"""SGLang TorchNativeAttnBackend ignored the layer's sliding window (extend and decode).

Citation: sgl-project/sglang#26516 "Add sliding-window mask support to TorchNativeAttnBackend"
(merged 2026-05-27). The PR text: `_run_sdpa_forward_extend` and `_run_sdpa_forward_decode`
"previously ignored `layer.sliding_window_size` and always passed `is_causal=True` to
`scaled_dot_product_attention`. Models that require sliding-window attention (e.g. Mistral, Gemma) on
the `torch_native` backend therefore produced incorrect outputs -- every query attended to the full
prefix regardless of the requested window."

Bug: the per-request SDPA loop (the pre-fix code of torch_native_backend.py, read from upstream) uses
`is_causal=causal` for extend and `is_causal=False` for decode, whatever `layer.sliding_window_size`.
Fix (per the PR description): a `_make_sliding_window_mask(q_len, kv_len, sliding_window_size, device,
query_offset)` boolean mask `(k <= q + query_offset) & (k >= q + query_offset - sliding_window_size)`
is passed as `attn_mask=` with `is_causal=False` when `sliding_window_size > -1`. I could read the PR
description but not its full diff; the helper below follows the formula it states.

This program: a Gemma-2-like layer stack (one sliding layer, `sliding_window_size=3`, one global
layer) served by the backend over a token pool. A batch extends two requests (one fresh 9-token
prompt, one with a 6-token cached prefix plus 4 new tokens), then runs one decode step for both.
"""
import sys
from dataclasses import dataclass
from typing import List

import torch
from torch.nn.functional import scaled_dot_product_attention

FIXED = "--fixed" in sys.argv

torch.manual_seed(0)


@dataclass
class ModelConfig:
    hidden_size: int = 32
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 8
    sliding_window: int = 4  # HF convention: window includes the token itself
    layer_types: tuple = ("sliding_attention", "full_attention")


class RadixAttention:
    """Per-layer attention metadata, as SGLang's RadixAttention carries it."""

    def __init__(self, layer_id, num_heads, num_kv_heads, head_dim, sliding_window_size=-1):
        self.layer_id = layer_id
        self.tp_q_head_num = num_heads
        self.tp_k_head_num = num_kv_heads
        self.qk_head_dim = head_dim
        self.v_head_dim = head_dim
        self.scaling = head_dim ** -0.5
        # SGLang stores window-1: the number of previous tokens a query may see
        self.sliding_window_size = sliding_window_size
        self.is_cross_attention = False


class TokenToKVPool:
    def __init__(self, size, num_layers, num_kv_heads, head_dim):
        self.k_buffer = [torch.zeros(size, num_kv_heads, head_dim) for _ in range(num_layers)]
        self.v_buffer = [torch.zeros(size, num_kv_heads, head_dim) for _ in range(num_layers)]

    def set_kv_buffer(self, layer, loc, k, v):
        self.k_buffer[layer.layer_id][loc] = k
        self.v_buffer[layer.layer_id][loc] = v

    def get_key_buffer(self, layer_id):
        return self.k_buffer[layer_id]

    def get_value_buffer(self, layer_id):
        return self.v_buffer[layer_id]


@dataclass
class ReqToTokenPool:
    req_to_token: torch.Tensor


@dataclass
class ForwardBatch:
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    seq_lens_cpu: List[int]
    out_cache_loc: torch.Tensor
    token_to_kv_pool: TokenToKVPool
    req_to_token_pool: ReqToTokenPool
    extend_prefix_lens: torch.Tensor = None
    extend_prefix_lens_cpu: List[int] = None
    extend_seq_lens: torch.Tensor = None
    extend_seq_lens_cpu: List[int] = None


def _make_sliding_window_mask(q_len, kv_len, sliding_window_size, device, query_offset):
    q = torch.arange(q_len, device=device)[:, None] + query_offset
    k = torch.arange(kv_len, device=device)[None, :]
    return (k <= q) & (k >= q - sliding_window_size)


class TorchNativeAttnBackend:
    def _run_sdpa_forward_extend(self, query, output, k_cache, v_cache, req_to_token, req_pool_indices,
                                 seq_lens, seq_lens_cpu, extend_prefix_lens, extend_prefix_lens_cpu,
                                 extend_seq_lens, extend_seq_lens_cpu, scaling=None, enable_gqa=False,
                                 causal=False, sliding_window_size=None):
        # [num_tokens, num_heads, head_size] -> [num_heads, num_tokens, head_size]
        query = query.movedim(0, query.dim() - 2)
        start_q, start_kv = 0, 0
        for seq_idx in range(seq_lens.shape[0]):
            extend_seq_len_q = extend_seq_lens_cpu[seq_idx]
            prefill_seq_len_q = extend_prefix_lens_cpu[seq_idx]
            seq_len_kv = seq_lens_cpu[seq_idx]
            end_q = start_q + extend_seq_len_q
            end_kv = start_kv + seq_len_kv

            per_req_query = query[:, start_q:end_q, :]
            per_req_query_redudant = torch.empty(
                (per_req_query.shape[0], seq_len_kv, per_req_query.shape[2]),
                dtype=per_req_query.dtype, device=per_req_query.device)
            per_req_query_redudant[:, prefill_seq_len_q:, :] = per_req_query

            req_pool_idx = req_pool_indices[seq_idx]
            curr_req_to_tokens = torch.index_select(req_to_token, 0, req_pool_idx).squeeze(0)
            per_req_tokens = curr_req_to_tokens[:seq_len_kv]
            per_req_key = k_cache[per_req_tokens].movedim(0, query.dim() - 2)
            per_req_value = v_cache[per_req_tokens].movedim(0, query.dim() - 2)

            attn_mask, is_causal = None, causal
            if FIXED and sliding_window_size is not None and sliding_window_size > -1:
                attn_mask = _make_sliding_window_mask(seq_len_kv, seq_len_kv, sliding_window_size,
                                                      query.device, 0)
                is_causal = False
            per_req_out_redudant = (
                scaled_dot_product_attention(
                    per_req_query_redudant.unsqueeze(0), per_req_key.unsqueeze(0),
                    per_req_value.unsqueeze(0), attn_mask=attn_mask, enable_gqa=enable_gqa,
                    scale=scaling, is_causal=is_causal)
                .squeeze(0).movedim(query.dim() - 2, 0))
            output[start_q:end_q, :, :] = per_req_out_redudant[prefill_seq_len_q:, :, :]
            start_q, start_kv = end_q, end_kv
        return output

    def _run_sdpa_forward_decode(self, query, output, k_cache, v_cache, req_to_token, req_pool_indices,
                                 seq_lens, seq_lens_cpu, scaling=None, enable_gqa=False, causal=False,
                                 sliding_window_size=None):
        query = query.movedim(0, query.dim() - 2)
        start_q, start_kv = 0, 0
        for seq_idx in range(seq_lens.shape[0]):
            seq_len_q = 1
            seq_len_kv = seq_lens_cpu[seq_idx]
            end_q = start_q + seq_len_q
            end_kv = start_kv + seq_len_kv
            per_req_query = query[:, start_q:end_q, :]
            req_pool_idx = req_pool_indices[seq_idx]
            curr_req_to_tokens = torch.index_select(req_to_token, 0, req_pool_idx).squeeze(0)
            per_req_tokens = curr_req_to_tokens[:seq_len_kv]
            per_req_key = k_cache[per_req_tokens].movedim(0, query.dim() - 2)
            per_req_value = v_cache[per_req_tokens].movedim(0, query.dim() - 2)

            attn_mask, is_causal = None, causal
            if FIXED and sliding_window_size is not None and sliding_window_size > -1:
                attn_mask = _make_sliding_window_mask(seq_len_q, seq_len_kv, sliding_window_size,
                                                      query.device, seq_len_kv - seq_len_q)
                is_causal = False
            per_req_out = (
                scaled_dot_product_attention(
                    per_req_query.unsqueeze(0), per_req_key.unsqueeze(0), per_req_value.unsqueeze(0),
                    attn_mask=attn_mask, enable_gqa=enable_gqa, scale=scaling, is_causal=is_causal)
                .squeeze(0).movedim(query.dim() - 2, 0))
            output[start_q:end_q, :, :] = per_req_out
            start_q, start_kv = end_q, end_kv
        return output

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        o = torch.empty_like(q)
        if save_kv_cache:
            forward_batch.token_to_kv_pool.set_kv_buffer(layer, forward_batch.out_cache_loc, k, v)
        use_gqa = layer.tp_q_head_num != layer.tp_k_head_num
        q_ = q.view(-1, layer.tp_q_head_num, layer.qk_head_dim)
        o_ = o.view(-1, layer.tp_q_head_num, layer.v_head_dim)
        causal = not layer.is_cross_attention
        self._run_sdpa_forward_extend(
            q_, o_, forward_batch.token_to_kv_pool.get_key_buffer(layer.layer_id),
            forward_batch.token_to_kv_pool.get_value_buffer(layer.layer_id),
            forward_batch.req_to_token_pool.req_to_token, forward_batch.req_pool_indices,
            forward_batch.seq_lens, forward_batch.seq_lens_cpu, forward_batch.extend_prefix_lens,
            forward_batch.extend_prefix_lens_cpu, forward_batch.extend_seq_lens,
            forward_batch.extend_seq_lens_cpu, scaling=layer.scaling, enable_gqa=use_gqa, causal=causal,
            sliding_window_size=layer.sliding_window_size)
        return o

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        q = q.reshape(-1, layer.tp_q_head_num * layer.qk_head_dim)
        o = torch.empty_like(q)
        if save_kv_cache:
            forward_batch.token_to_kv_pool.set_kv_buffer(layer, forward_batch.out_cache_loc, k, v)
        use_gqa = layer.tp_q_head_num != layer.tp_k_head_num
        q_ = q.view(-1, layer.tp_q_head_num, layer.qk_head_dim)
        o_ = o.view(-1, layer.tp_q_head_num, layer.v_head_dim)
        self._run_sdpa_forward_decode(
            q_, o_, forward_batch.token_to_kv_pool.get_key_buffer(layer.layer_id),
            forward_batch.token_to_kv_pool.get_value_buffer(layer.layer_id),
            forward_batch.req_to_token_pool.req_to_token, forward_batch.req_pool_indices,
            forward_batch.seq_lens, forward_batch.seq_lens_cpu, scaling=layer.scaling,
            enable_gqa=use_gqa, causal=False, sliding_window_size=layer.sliding_window_size)
        return o


class Gemma2Attention(torch.nn.Module):
    def __init__(self, config, layer_id, backend):
        super().__init__()
        nh, nkv, hd = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        self.qkv_proj = torch.nn.Linear(config.hidden_size, (nh + 2 * nkv) * hd, bias=False)
        self.o_proj = torch.nn.Linear(nh * hd, config.hidden_size, bias=False)
        self.q_size, self.kv_size, self.nkv, self.hd = nh * hd, nkv * hd, nkv, hd
        is_sliding = config.layer_types[layer_id] == "sliding_attention"
        self.attn = RadixAttention(layer_id, nh, nkv, hd,
                                   sliding_window_size=config.sliding_window - 1 if is_sliding else -1)
        self.backend = backend

    def forward(self, hidden_states, forward_batch, is_decode):
        q, k, v = self.qkv_proj(hidden_states).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        k = k.view(-1, self.nkv, self.hd)
        v = v.view(-1, self.nkv, self.hd)
        fwd = self.backend.forward_decode if is_decode else self.backend.forward_extend
        return self.o_proj(fwd(q, k, v, self.attn, forward_batch))


def main():
    config = ModelConfig()
    backend = TorchNativeAttnBackend()
    layers = [Gemma2Attention(config, i, backend) for i in range(len(config.layer_types))]
    pool = TokenToKVPool(64, len(layers), config.num_key_value_heads, config.head_dim)
    req_to_token = torch.zeros(2, 32, dtype=torch.long)
    req_to_token[0, :16] = torch.arange(0, 16)
    req_to_token[1, :16] = torch.arange(16, 32)
    rtp = ReqToTokenPool(req_to_token)

    # request 1 already has a 6-token prefix in the pool (a radix-cache hit)
    for layer in layers:
        pool.k_buffer[layer.attn.layer_id][16:22] = torch.randn(6, config.num_key_value_heads, config.head_dim)
        pool.v_buffer[layer.attn.layer_id][16:22] = torch.randn(6, config.num_key_value_heads, config.head_dim)

    prefix, extend = [0, 6], [9, 4]
    seq_lens = [p + e for p, e in zip(prefix, extend)]
    out_cache_loc = torch.cat([req_to_token[0, 0:9], req_to_token[1, 6:10]])
    fb = ForwardBatch(
        req_pool_indices=torch.tensor([0, 1]), seq_lens=torch.tensor(seq_lens), seq_lens_cpu=seq_lens,
        out_cache_loc=out_cache_loc, token_to_kv_pool=pool, req_to_token_pool=rtp,
        extend_prefix_lens=torch.tensor(prefix), extend_prefix_lens_cpu=prefix,
        extend_seq_lens=torch.tensor(extend), extend_seq_lens_cpu=extend)
    h = torch.randn(sum(extend), config.hidden_size)
    with torch.no_grad():
        for layer in layers:
            h = h + layer(h, fb, is_decode=False)
        last = torch.stack([h[8], h[12]])

        seq_lens = [s + 1 for s in seq_lens]
        fb_dec = ForwardBatch(
            req_pool_indices=torch.tensor([0, 1]), seq_lens=torch.tensor(seq_lens), seq_lens_cpu=seq_lens,
            out_cache_loc=torch.stack([req_to_token[0, 9], req_to_token[1, 10]]),
            token_to_kv_pool=pool, req_to_token_pool=rtp)
        for layer in layers:
            last = last + layer(last, fb_dec, is_decode=True)
    print("decode hidden norm per request:", [round(x, 4) for x in last.norm(dim=-1).tolist()])


if __name__ == "__main__":
    main()
