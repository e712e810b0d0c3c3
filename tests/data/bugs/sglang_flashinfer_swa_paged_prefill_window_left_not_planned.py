"""SGLang FlashInfer backend: the SWA paged prefill wrapper is planned without `window_left`.

Citation: sgl-project/sglang PR #31501, "[flashinfer] Pass window_left at plan time for the SWA paged
prefill wrapper" (merged). Description read; the sglang and FlashInfer code below is a CPU port written
from it (the wrapper's kernel is CUDA), not a copy of either file.

Bug: FlashInfer decides at `plan()` whether the prefill kernel carries the per-element left-window mask
(`use_sliding_window`); sglang planned the sliding-window paged prefill wrapper without `window_left`,
so that mask was compiled out. The `window_left` passed later to `forward()` only drives the coarse
per-CTA-tile KV-start skip, so on SWA layers a query sees every key from the start of the KV tile that
holds its tile's first window key: keys past the window leak in (paged-only prefill: deterministic
inference, multimodal Gemma3, `SGLANG_FLASHINFER_USE_PAGED=1`).

Fix: pass `window_left=layer.sliding_window_size` to `plan()` for the SWA paged wrapper (normal extend).

Reproduction: a Gemma3-like text model (sliding_window 4 -> window_left 3, every other layer global),
one 12-token request in a paged KV cache (page_size 4, `req_to_token`, `kv_indptr` / `kv_indices`),
extend in paged-only mode. The stand-in kernel works in query tiles of 4 rows and KV tiles of 4 keys.
"""
import sys
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
CTA_TILE_Q, CTA_TILE_KV = 4, 4


class BatchPrefillWithPagedKVCacheWrapper:
    """CPU stand-in: plan() fixes the kernel variant, forward() runs it per request and query tile."""

    def plan(self, qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len,
             num_qo_heads, num_kv_heads, head_dim, page_size, causal=True, window_left=-1):
        self._qo_indptr, self._kv_indptr = qo_indptr, paged_kv_indptr
        self._kv_indices, self._last_page_len = paged_kv_indices, paged_kv_last_page_len
        self._page_size, self._causal = page_size, causal
        self._use_sliding_window = window_left >= 0  # selects the compiled kernel variant

    def forward(self, q, paged_kv_cache, causal=True, sm_scale=None, window_left=-1):
        k_cache, v_cache = paged_kv_cache  # [num_pages, page_size, H, D]
        out = torch.empty_like(q)
        for r in range(self._qo_indptr.numel() - 1):
            qs, qe = int(self._qo_indptr[r]), int(self._qo_indptr[r + 1])
            pages = self._kv_indices[int(self._kv_indptr[r]):int(self._kv_indptr[r + 1])]
            kv_len = (pages.numel() - 1) * self._page_size + int(self._last_page_len[r])
            k = k_cache[pages].flatten(0, 1)[:kv_len]
            v = v_cache[pages].flatten(0, 1)[:kv_len]
            qo_len = qe - qs
            for t0 in range(0, qo_len, CTA_TILE_Q):
                t1 = min(t0 + CTA_TILE_Q, qo_len)
                q_pos = torch.arange(t0, t1).view(-1, 1) + kv_len - qo_len
                kv_pos = torch.arange(kv_len).view(1, -1)
                keep = kv_pos <= q_pos if causal else torch.ones(t1 - t0, kv_len, dtype=torch.bool)
                if window_left >= 0:
                    # Tile-level skip: whole KV tiles below the tile's first query window.
                    kv_start = max(0, int(q_pos[0]) - window_left) // CTA_TILE_KV * CTA_TILE_KV
                    keep = keep & (kv_pos >= kv_start)
                if self._use_sliding_window:
                    keep = keep & (kv_pos >= q_pos - window_left)
                o = F.scaled_dot_product_attention(
                    q[qs + t0:qs + t1].transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                    attn_mask=keep, scale=sm_scale)
                out[qs + t0:qs + t1] = o.transpose(0, 1)
        return out


@dataclass
class ForwardBatch:
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    extend_prefix_lens: torch.Tensor
    out_cache_loc: torch.Tensor


class FlashInferAttnBackend:
    def __init__(self, req_to_token, page_size, num_heads, head_dim, sliding_window_size):
        self.req_to_token = req_to_token
        self.page_size = page_size
        self.num_heads, self.head_dim = num_heads, head_dim
        self.sliding_window_size = sliding_window_size
        # wrapper 0: sliding-window layers, wrapper 1: full-attention layers
        self.prefill_wrappers_paged = [BatchPrefillWithPagedKVCacheWrapper(),
                                       BatchPrefillWithPagedKVCacheWrapper()]

    def init_forward_metadata(self, forward_batch: ForwardBatch):
        seq_lens = forward_batch.seq_lens
        extend_lens = seq_lens - forward_batch.extend_prefix_lens
        qo_indptr = F.pad(torch.cumsum(extend_lens, 0), (1, 0))
        num_pages = (seq_lens + self.page_size - 1) // self.page_size
        kv_indptr = F.pad(torch.cumsum(num_pages, 0), (1, 0))
        kv_indices = torch.cat([
            self.req_to_token[int(r), :int(n) * self.page_size:self.page_size] // self.page_size
            for r, n in zip(forward_batch.req_pool_indices, num_pages)])
        last_page_len = (seq_lens - 1) % self.page_size + 1
        for wrapper_id, wrapper in enumerate(self.prefill_wrappers_paged):
            kwargs = {}
            if FIXED and wrapper_id == 0:
                kwargs["window_left"] = self.sliding_window_size
            wrapper.plan(qo_indptr, kv_indptr, kv_indices, last_page_len, self.num_heads,
                         self.num_heads, self.head_dim, self.page_size, causal=True, **kwargs)

    def forward_extend(self, q, k, v, layer, forward_batch, kv_pool):
        kv_pool.set_kv_buffer(layer.layer_id, forward_batch.out_cache_loc, k, v)
        wrapper = self.prefill_wrappers_paged[0 if layer.sliding_window_size >= 0 else 1]
        return wrapper.forward(q, kv_pool.get_kv_buffer(layer.layer_id, self.page_size),
                               causal=True, sm_scale=layer.scaling,
                               window_left=layer.sliding_window_size)


class MHATokenToKVPool:
    def __init__(self, size, num_layers, num_heads, head_dim):
        self.k_buffer = [torch.zeros(size, num_heads, head_dim) for _ in range(num_layers)]
        self.v_buffer = [torch.zeros(size, num_heads, head_dim) for _ in range(num_layers)]

    def set_kv_buffer(self, layer_id, loc, k, v):
        self.k_buffer[layer_id][loc] = k
        self.v_buffer[layer_id][loc] = v

    def get_kv_buffer(self, layer_id, page_size):
        k, v = self.k_buffer[layer_id], self.v_buffer[layer_id]
        return k.view(-1, page_size, *k.shape[1:]), v.view(-1, page_size, *v.shape[1:])


class Gemma3Attention(nn.Module):
    def __init__(self, layer_id, hidden, num_heads, sliding_window):
        super().__init__()
        self.layer_id, self.num_heads, self.head_dim = layer_id, num_heads, hidden // num_heads
        self.scaling = self.head_dim ** -0.5
        is_sliding = layer_id % 2 == 0
        # sglang stores the window as a radius: the current token plus sliding_window - 1 before it.
        self.sliding_window_size = sliding_window - 1 if is_sliding else -1
        self.qkv_proj = nn.Linear(hidden, 3 * hidden)
        self.o_proj = nn.Linear(hidden, hidden)

    def forward(self, h, forward_batch, backend, kv_pool):
        q, k, v = self.qkv_proj(h).view(-1, 3, self.num_heads, self.head_dim).unbind(1)
        o = backend.forward_extend(q, k, v, self, forward_batch, kv_pool)
        return self.o_proj(o.reshape(h.shape[0], -1))


def main():
    torch.manual_seed(0)
    hidden, heads, page_size, sliding_window, num_layers = 16, 2, 4, 4, 2
    req_to_token = torch.zeros(2, 16, dtype=torch.long)
    req_to_token[1, :12] = torch.arange(20, 32)  # pages 5, 6, 7
    kv_pool = MHATokenToKVPool(64, num_layers, heads, hidden // heads)
    backend = FlashInferAttnBackend(req_to_token, page_size, heads, hidden // heads,
                                    sliding_window - 1)
    forward_batch = ForwardBatch(req_pool_indices=torch.tensor([1]), seq_lens=torch.tensor([12]),
                                 extend_prefix_lens=torch.tensor([0]),
                                 out_cache_loc=req_to_token[1, :12])
    embed = nn.Embedding(40, hidden)
    layers = nn.ModuleList(Gemma3Attention(i, hidden, heads, sliding_window) for i in range(num_layers))
    input_ids = torch.randint(0, 40, (12,))
    with torch.no_grad():
        backend.init_forward_metadata(forward_batch)
        h = embed(input_ids)
        for layer in layers:
            h = h + layer(h, forward_batch, backend, kv_pool)
    print("hidden", tuple(h.shape), "sum %.4f" % h.sum().item())


if __name__ == "__main__":
    main()
