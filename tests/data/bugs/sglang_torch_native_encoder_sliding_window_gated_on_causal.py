"""SGLang TorchNativeAttnBackend: an encoder-only layer's sliding window is dropped (gated on causal).

Citation: sgl-project/sglang issue #33601 ("[Bug] backend ignores bidirectional sliding window attention
for encoder models", closed; duplicate #33603) and PR #33600 ("Fix: support bidirectional sliding window
attention in torch native backend", closed without merge, so `--fixed` applies that PR's proposed
change). Descriptions read; the backend code below is a port of torch_native_backend.py's
`forward_extend` / `_run_sdpa_forward_extend` as written after PR #26516, not re-read line by line.

Bug: `forward_extend` sets `causal = False` for ENCODER_ONLY layers, but only hands the layer's
`sliding_window_size` to the SDPA loop `if causal`, and `_make_sliding_window_mask` is causal-only
(`k_pos <= q_pos`). ModernBERT-style encoders (local layers with a +-64 window) therefore ran their
local layers as full bidirectional attention on the CPU / torch_native backend.

Fix (proposed): pass the window for encoder layers too and build a bidirectional band when not causal:
`abs(q_pos - k_pos) <= sliding_window_size`.

Reproduction: a ModernBERT-like config (local_attention = 4, so sliding_window_size = 2; every 3rd
layer global), two requests of 7 and 5 tokens in a paged token pool (`req_to_token`), an extend batch
described by `ForwardBatch` (seq_lens, extend_prefix_lens, extend_seq_lens).
"""
import sys
from dataclasses import dataclass
from enum import Enum
from typing import Optional

import torch
import torch.nn as nn
from torch.nn.functional import scaled_dot_product_attention

FIXED = "--fixed" in sys.argv


class AttentionType(Enum):
    DECODER = "decoder"
    ENCODER_ONLY = "encoder_only"


@dataclass
class ModernBertConfig:
    vocab_size: int = 50
    hidden_size: int = 16
    num_attention_heads: int = 2
    num_hidden_layers: int = 3
    global_attn_every_n_layers: int = 3
    local_attention: int = 4


@dataclass
class ForwardBatch:
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    extend_prefix_lens: torch.Tensor
    extend_seq_lens: torch.Tensor
    out_cache_loc: torch.Tensor
    req_to_token: torch.Tensor


class TokenToKVPool:
    def __init__(self, size, num_layers, num_heads, head_dim):
        self.k_buffer = [torch.zeros(size, num_heads, head_dim) for _ in range(num_layers)]
        self.v_buffer = [torch.zeros(size, num_heads, head_dim) for _ in range(num_layers)]

    def set_kv_buffer(self, layer_id, loc, k, v):
        self.k_buffer[layer_id][loc] = k
        self.v_buffer[layer_id][loc] = v


class RadixAttention(nn.Module):
    def __init__(self, num_heads, head_dim, scaling, layer_id, sliding_window_size=-1,
                 attn_type=AttentionType.DECODER):
        super().__init__()
        self.tp_q_head_num = num_heads
        self.head_dim = head_dim
        self.scaling = scaling
        self.layer_id = layer_id
        self.sliding_window_size = sliding_window_size
        self.attn_type = attn_type
        self.is_cross_attention = False

    def forward(self, q, k, v, forward_batch, backend):
        return backend.forward_extend(q, k, v, self, forward_batch)


class TorchNativeAttnBackend:
    def __init__(self, token_to_kv_pool):
        self.token_to_kv_pool = token_to_kv_pool

    @staticmethod
    def _make_sliding_window_mask(q_len, kv_len, sliding_window_size, device, query_offset,
                                  causal=True):
        q_pos = torch.arange(q_len, device=device).unsqueeze(1) + query_offset
        k_pos = torch.arange(kv_len, device=device).unsqueeze(0)
        if causal:
            return (k_pos <= q_pos) & (k_pos >= q_pos - sliding_window_size)
        return torch.abs(q_pos - k_pos) <= sliding_window_size

    def _run_sdpa_forward_extend(self, query, output, k_cache, v_cache, req_to_token,
                                 req_pool_indices, seq_lens, extend_prefix_lens, extend_seq_lens,
                                 scaling=None, causal=False,
                                 sliding_window_size: Optional[int] = None):
        query = query.movedim(0, query.dim() - 2)
        start_q = 0
        for seq_idx in range(seq_lens.shape[0]):
            extend_seq_len_q = int(extend_seq_lens[seq_idx])
            prefill_seq_len_q = int(extend_prefix_lens[seq_idx])
            seq_len_kv = int(seq_lens[seq_idx])
            end_q = start_q + extend_seq_len_q
            per_req_query = query[:, start_q:end_q, :]
            per_req_query_redudant = torch.empty(
                (per_req_query.shape[0], seq_len_kv, per_req_query.shape[2]), dtype=query.dtype)
            per_req_query_redudant[:, prefill_seq_len_q:, :] = per_req_query
            per_req_tokens = req_to_token[req_pool_indices[seq_idx], :seq_len_kv]
            per_req_key = k_cache[per_req_tokens].movedim(0, query.dim() - 2)
            per_req_value = v_cache[per_req_tokens].movedim(0, query.dim() - 2)
            if sliding_window_size is not None and sliding_window_size > -1:
                attn_mask = self._make_sliding_window_mask(seq_len_kv, seq_len_kv,
                                                           sliding_window_size, query.device, 0,
                                                           causal=causal)
                out = scaled_dot_product_attention(
                    per_req_query_redudant.unsqueeze(0), per_req_key.unsqueeze(0),
                    per_req_value.unsqueeze(0), attn_mask=attn_mask, scale=scaling,
                    is_causal=False)
            else:
                out = scaled_dot_product_attention(
                    per_req_query_redudant.unsqueeze(0), per_req_key.unsqueeze(0),
                    per_req_value.unsqueeze(0), scale=scaling, is_causal=causal)
            out = out.squeeze(0).movedim(query.dim() - 2, 0)
            output[start_q:end_q, :, :] = out[prefill_seq_len_q:, :, :]
            start_q = end_q
        return output

    def forward_extend(self, q, k, v, layer: RadixAttention, forward_batch: ForwardBatch):
        o = torch.empty_like(q).view(-1, layer.tp_q_head_num, layer.head_dim)
        self.token_to_kv_pool.set_kv_buffer(layer.layer_id, forward_batch.out_cache_loc, k, v)
        causal = True
        if layer.is_cross_attention or layer.attn_type == AttentionType.ENCODER_ONLY:
            causal = False
        sliding_window_size = None
        if FIXED or causal:
            sliding_window_size = layer.sliding_window_size
        self._run_sdpa_forward_extend(
            q.view(-1, layer.tp_q_head_num, layer.head_dim), o,
            self.token_to_kv_pool.k_buffer[layer.layer_id],
            self.token_to_kv_pool.v_buffer[layer.layer_id],
            forward_batch.req_to_token, forward_batch.req_pool_indices, forward_batch.seq_lens,
            forward_batch.extend_prefix_lens, forward_batch.extend_seq_lens,
            scaling=layer.scaling, causal=causal, sliding_window_size=sliding_window_size)
        return o.view(-1, layer.tp_q_head_num * layer.head_dim)


class ModernBertAttention(nn.Module):
    def __init__(self, config: ModernBertConfig, layer_id: int):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.head_dim = config.hidden_size // self.num_heads
        self.Wqkv = nn.Linear(config.hidden_size, 3 * config.hidden_size, bias=False)
        self.Wo = nn.Linear(config.hidden_size, config.hidden_size, bias=False)
        if layer_id % config.global_attn_every_n_layers != 0:
            sliding_window_size = config.local_attention // 2
        else:
            sliding_window_size = -1
        self.attn = RadixAttention(self.num_heads, self.head_dim, self.head_dim ** -0.5, layer_id,
                                   sliding_window_size=sliding_window_size,
                                   attn_type=AttentionType.ENCODER_ONLY)

    def forward(self, hidden_states, forward_batch, backend):
        q, k, v = self.Wqkv(hidden_states).chunk(3, dim=-1)
        k = k.view(-1, self.num_heads, self.head_dim)
        v = v.view(-1, self.num_heads, self.head_dim)
        return self.Wo(self.attn(q, k, v, forward_batch, backend))


class ModernBertModel(nn.Module):
    def __init__(self, config: ModernBertConfig):
        super().__init__()
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(ModernBertAttention(config, i)
                                    for i in range(config.num_hidden_layers))

    def forward(self, input_ids, forward_batch, backend):
        h = self.tok_embeddings(input_ids)
        for layer in self.layers:
            h = h + layer(h, forward_batch, backend)
        return h


def main():
    torch.manual_seed(0)
    config = ModernBertConfig()
    model = ModernBertModel(config).eval()
    pool = TokenToKVPool(64, config.num_hidden_layers, config.num_attention_heads,
                         config.hidden_size // config.num_attention_heads)
    backend = TorchNativeAttnBackend(pool)
    seq_lens = torch.tensor([7, 5])
    req_to_token = torch.zeros(4, 16, dtype=torch.long)
    req_pool_indices = torch.tensor([2, 0])
    req_to_token[2, :7] = torch.arange(10, 17)
    req_to_token[0, :5] = torch.arange(30, 35)
    out_cache_loc = torch.cat([req_to_token[2, :7], req_to_token[0, :5]])
    forward_batch = ForwardBatch(req_pool_indices=req_pool_indices, seq_lens=seq_lens,
                                 extend_prefix_lens=torch.zeros(2, dtype=torch.long),
                                 extend_seq_lens=seq_lens.clone(), out_cache_loc=out_cache_loc,
                                 req_to_token=req_to_token)
    input_ids = torch.randint(0, config.vocab_size, (int(seq_lens.sum()),))
    with torch.no_grad():
        h = model(input_ids, forward_batch, backend)
    print("hidden", tuple(h.shape), "sum %.4f" % h.sum().item())


if __name__ == "__main__":
    main()
