"""SGLang Triton backend: the sliding-window decode buffer keeps one key too few.

Citation: sgl-project/sglang PR #32087 ("Fix Triton SWA decode window dropping the oldest in-window
key"; description read, PR closed without merge, so `--fixed` applies the PR's proposed change). The
same inconsistency is raised in sgl-project/sglang issue #34354 (prefill vs decode window semantics).
The torch code below is a reference port of the named functions (`update_sliding_window_buffer`, the
decode kernel's per-request gather-and-softmax); their bodies are reconstructed from the description.

Bug: models store `sliding_window_size = config.sliding_window - 1` (a radius; gemma2.py), so a query at
position p should attend keys [p - sliding_window_size, p], i.e. `sliding_window_size + 1` keys, as the
FlashInfer (`clamp(seq_lens, max=sliding_window_size + 1)`) and FlashAttention (`(sliding_window_size, 0)`)
backends do. Triton's `update_sliding_window_buffer` caps the decode window at `sliding_window_size`
keys, and the decode kernel consumes the gathered indices with no per-query mask, so every decode step
past the window silently drops the oldest in-window key.

Fix (proposed): gather `min(seq_lens, sliding_window_size + 1)` keys for decode.

Reproduction: Gemma2-style config (`sliding_window = 6` -> radius 5), a paged token pool with
`req_to_token`, a batch of two decoding requests (sequence lengths 11 and 4), GQA 4/2 heads; the decode
attention is a manual softmax over the gathered keys.
"""
import sys
from types import SimpleNamespace

import torch

FIXED = "--fixed" in sys.argv


def create_flashinfer_kv_indices(req_to_token, req_pool_indices, kv_lens, kv_indptr, kv_start_idx):
    """Torch version of the Triton helper: flatten each request's token slots [start, start + len)."""
    out = torch.empty(int(kv_indptr[-1]), dtype=torch.int64)
    for i in range(req_pool_indices.numel()):
        s, n = int(kv_start_idx[i]), int(kv_lens[i])
        out[int(kv_indptr[i]):int(kv_indptr[i]) + n] = req_to_token[req_pool_indices[i], s:s + n]
    return out


def update_sliding_window_buffer(window_kv_indptr, req_to_token, sliding_window_size, seq_lens,
                                 req_pool_indices, bs):
    window_len = sliding_window_size + 1 if FIXED else sliding_window_size
    window_kv_lens = torch.minimum(seq_lens, torch.tensor(window_len))
    window_kv_indptr[1:bs + 1] = torch.cumsum(window_kv_lens, dim=0)
    window_kv_indptr = window_kv_indptr[:bs + 1]
    window_kv_start_idx = seq_lens - window_kv_lens
    window_kv_indices = create_flashinfer_kv_indices(req_to_token, req_pool_indices, window_kv_lens,
                                                     window_kv_indptr, window_kv_start_idx)
    return window_kv_indptr, window_kv_indices, window_kv_lens


def decode_attention_fwd(q, k_buffer, v_buffer, kv_indptr, kv_indices, sm_scale):
    """Reference of the decode kernel: each request attends exactly the gathered keys (no mask)."""
    bs, H, D = q.shape
    kv_group_num = H // k_buffer.shape[1]
    o = torch.empty_like(q)
    for b in range(bs):
        idx = kv_indices[int(kv_indptr[b]):int(kv_indptr[b + 1])]
        k = k_buffer[idx].repeat_interleave(kv_group_num, dim=1)  # [n, H, D]
        v = v_buffer[idx].repeat_interleave(kv_group_num, dim=1)
        qk = torch.einsum("hd,nhd->hn", q[b], k) * sm_scale
        p = torch.softmax(qk, dim=-1)
        o[b] = torch.einsum("hn,nhd->hd", p, v)
    return o


class Gemma2Attention:
    def __init__(self, config, layer_id):
        # sliding_window_size is a radius: the window holds it plus the current token
        is_sliding = layer_id % 2 == 0
        self.sliding_window_size = config.sliding_window - 1 if is_sliding else -1
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        self.scaling = config.query_pre_attn_scalar ** -0.5


def main():
    torch.manual_seed(0)
    config = SimpleNamespace(sliding_window=6, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                             query_pre_attn_scalar=8)
    attn = Gemma2Attention(config, layer_id=0)
    pool_size, max_ctx = 64, 16
    req_to_token = torch.randperm(pool_size)[: 2 * max_ctx].view(2, max_ctx)
    k_buffer = torch.randn(pool_size, config.num_key_value_heads, config.head_dim)
    v_buffer = torch.randn(pool_size, config.num_key_value_heads, config.head_dim)
    seq_lens = torch.tensor([11, 4])  # includes the token being decoded
    req_pool_indices = torch.tensor([0, 1])
    window_kv_indptr = torch.zeros(3, dtype=torch.int64)
    window_kv_indptr, window_kv_indices, window_kv_lens = update_sliding_window_buffer(
        window_kv_indptr, req_to_token, attn.sliding_window_size, seq_lens, req_pool_indices, 2)
    q = torch.randn(2, config.num_attention_heads, config.head_dim)
    o = decode_attention_fwd(q, k_buffer, v_buffer, window_kv_indptr, window_kv_indices, attn.scaling)
    print("window_kv_lens", window_kv_lens.tolist(), "output sums", [round(x, 4) for x in o.sum(dim=(1, 2)).tolist()])


if __name__ == "__main__":
    main()
