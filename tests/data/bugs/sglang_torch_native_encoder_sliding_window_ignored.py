"""sglang TorchNativeAttnBackend ignores sliding windows for non-causal (encoder) layers.

Citation: sgl-project/sglang#39300 ("[Bug] Non-causal sliding-window attention is ignored in
TorchNativeAttnBackend"; also #33601/#33603), fix PR sgl-project/sglang#39298 (earlier #33600).
Written from the issue/PR text; the backend shape follows PR #26516, which added
``_make_sliding_window_mask(q_len, kv_len, sliding_window_size, device, query_offset)`` with
``mask[q, k] = (k <= q + query_offset) & (k >= q + query_offset - sliding_window_size)``.

Bug: the sliding-window mask was hard-coded causal and ``forward_extend`` only used it
``if causal``. Encoder-only layers (ModernBERT local attention, ``attn_type=ENCODER_ONLY``)
therefore ran SDPA with no mask at all: full global bidirectional attention instead of their
configured +-window band (embeddings' cosine vs HF dropped to ~0.86 on long inputs).

Fix: ``_make_sliding_window_mask(..., causal=False)`` builds
``torch.abs(q_pos - k_pos) <= sliding_window_size`` and the window is applied whatever
``causal`` is.

This program: a ragged batch of two requests (20 and 13 tokens) laid out flat as sglang does,
K/V written to a token pool and read back through req_to_token, one ModernBERT-style local
layer (local_attention=8 -> sliding_window_size=4 per side) run through the backend's per-
request SDPA loop.
"""
import sys
from enum import Enum

import torch
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


class AttentionType(Enum):
    DECODER = "decoder"
    ENCODER_ONLY = "encoder_only"


class RadixAttention:
    def __init__(self, num_heads, head_dim, layer_id, sliding_window_size=-1,
                 attn_type=AttentionType.DECODER, is_cross_attention=False):
        self.tp_q_head_num = num_heads
        self.tp_k_head_num = num_heads
        self.head_dim = head_dim
        self.layer_id = layer_id
        self.scaling = head_dim ** -0.5
        self.sliding_window_size = sliding_window_size
        self.attn_type = attn_type
        self.is_cross_attention = is_cross_attention


class ForwardBatch:
    def __init__(self, extend_seq_lens, num_heads, head_dim):
        self.extend_seq_lens = torch.tensor(extend_seq_lens)
        self.extend_prefix_lens = torch.zeros_like(self.extend_seq_lens)
        self.seq_lens = self.extend_seq_lens.clone()
        self.batch_size = len(extend_seq_lens)
        total = int(self.seq_lens.sum())
        # token pool slot of every (request, position); slot 0 is the padding slot
        self.req_to_token = torch.zeros(self.batch_size, int(self.seq_lens.max()), dtype=torch.long)
        start = 1
        for r, n in enumerate(extend_seq_lens):
            self.req_to_token[r, :n] = torch.arange(start, start + n)
            start += n
        self.req_pool_indices = torch.arange(self.batch_size)
        self.out_cache_loc = torch.arange(1, total + 1)
        self.k_buffer = torch.zeros(total + 1, num_heads, head_dim)
        self.v_buffer = torch.zeros(total + 1, num_heads, head_dim)


def _make_sliding_window_mask(q_len, kv_len, sliding_window_size, device, query_offset=0, causal=True):
    q_pos = torch.arange(q_len, device=device)[:, None] + query_offset
    k_pos = torch.arange(kv_len, device=device)[None, :]
    if not causal:
        return torch.abs(q_pos - k_pos) <= sliding_window_size
    return (k_pos <= q_pos) & (k_pos >= q_pos - sliding_window_size)


class TorchNativeAttnBackend:
    def _run_sdpa_forward_extend(self, query, output, k_cache, v_cache, req_to_token, req_pool_indices,
                                 seq_lens, extend_prefix_lens, extend_seq_lens, scaling=None,
                                 enable_gqa=False, causal=False, sliding_window_size=None):
        # query: [num_tokens, num_heads, head_size] -> [num_heads, num_tokens, head_size]
        query = query.movedim(0, query.dim() - 2)
        start_q, start_kv = 0, 0
        for seq_idx in range(seq_lens.shape[0]):
            extend_seq_len_q = int(extend_seq_lens[seq_idx])
            prefill_seq_len_q = int(extend_prefix_lens[seq_idx])
            seq_len_kv = int(seq_lens[seq_idx])
            end_q = start_q + extend_seq_len_q
            end_kv = start_kv + seq_len_kv
            per_req_query = query[:, start_q:end_q, :]
            per_req_query_redudant = torch.empty(
                (per_req_query.shape[0], seq_len_kv, per_req_query.shape[2]), dtype=per_req_query.dtype)
            per_req_query_redudant[:, prefill_seq_len_q:, :] = per_req_query
            req_pool_idx = req_pool_indices[seq_idx]
            per_req_tokens = req_to_token[req_pool_idx, :seq_len_kv]
            per_req_key = k_cache[per_req_tokens].movedim(0, query.dim() - 2)
            per_req_value = v_cache[per_req_tokens].movedim(0, query.dim() - 2)
            if sliding_window_size is not None and sliding_window_size > -1:
                attn_mask = _make_sliding_window_mask(
                    seq_len_kv, seq_len_kv, sliding_window_size, query.device, causal=causal
                ) if FIXED else _make_sliding_window_mask(seq_len_kv, seq_len_kv, sliding_window_size, query.device)
                per_req_out_redudant = F.scaled_dot_product_attention(
                    per_req_query_redudant.unsqueeze(0), per_req_key.unsqueeze(0), per_req_value.unsqueeze(0),
                    attn_mask=attn_mask, enable_gqa=enable_gqa, scale=scaling, is_causal=False,
                ).squeeze(0).movedim(query.dim() - 2, 0)
            else:
                per_req_out_redudant = F.scaled_dot_product_attention(
                    per_req_query_redudant.unsqueeze(0), per_req_key.unsqueeze(0), per_req_value.unsqueeze(0),
                    enable_gqa=enable_gqa, scale=scaling, is_causal=causal,
                ).squeeze(0).movedim(query.dim() - 2, 0)
            output[start_q:end_q, :, :] = per_req_out_redudant[prefill_seq_len_q:, :, :]
            start_q, start_kv = end_q, end_kv
        return output

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        o = torch.empty_like(q).view(-1, layer.tp_q_head_num, layer.head_dim)
        if save_kv_cache:
            forward_batch.k_buffer[forward_batch.out_cache_loc] = k.view(-1, layer.tp_k_head_num, layer.head_dim)
            forward_batch.v_buffer[forward_batch.out_cache_loc] = v.view(-1, layer.tp_k_head_num, layer.head_dim)
        causal = True
        if layer.is_cross_attention or layer.attn_type == AttentionType.ENCODER_ONLY:
            causal = False
        if FIXED:
            sliding_window_size = layer.sliding_window_size
        else:
            sliding_window_size = layer.sliding_window_size if causal else None
        q_ = q.view(-1, layer.tp_q_head_num, layer.head_dim)
        self._run_sdpa_forward_extend(
            q_, o, forward_batch.k_buffer, forward_batch.v_buffer, forward_batch.req_to_token,
            forward_batch.req_pool_indices, forward_batch.seq_lens, forward_batch.extend_prefix_lens,
            forward_batch.extend_seq_lens, scaling=layer.scaling, causal=causal,
            sliding_window_size=sliding_window_size,
        )
        return o.view(-1, layer.tp_q_head_num * layer.head_dim)


def main():
    torch.manual_seed(0)
    num_heads, head_dim = 2, 8
    local_attention = 8  # ModernBERT config.local_attention; each side sees local_attention // 2
    layer = RadixAttention(num_heads, head_dim, layer_id=0, sliding_window_size=local_attention // 2,
                           attn_type=AttentionType.ENCODER_ONLY)
    forward_batch = ForwardBatch([20, 13], num_heads, head_dim)
    n = int(forward_batch.extend_seq_lens.sum())
    q, k, v = (torch.randn(n, num_heads * head_dim) for _ in range(3))
    out = TorchNativeAttnBackend().forward_extend(q, k, v, layer, forward_batch)
    print(f"encoder local layer output norm {out.norm():.4f}")


if __name__ == "__main__":
    main()
