# Citation: sgl-project/sglang python/sglang/srt/layers/attention/torch_native_backend.py @011a615e37189e8de5076748d8d0505406b1abe1
# Extend: each request's new tokens are placed at the tail of a "redundant" query of length seq_len_kv (prefix rows
# left empty), keys/values are gathered through req_to_token from the paged pool, and SDPA runs with is_causal=True,
# so query row prefix+i sees kv 0..prefix+i; only rows prefix: are kept. Decode: one query per request, all kv of
# that request, causal=False. Requests are never padded: each gets its own slice of the pool.
import torch
from torch.nn.functional import scaled_dot_product_attention

torch.manual_seed(0)


class TorchNativeAttnBackend:
    def _run_sdpa_forward_extend(self, query, output, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens,
                                 seq_lens_cpu, extend_prefix_lens, extend_prefix_lens_cpu, extend_seq_lens,
                                 extend_seq_lens_cpu, scaling=None, enable_gqa=False, causal=False):
        assert seq_lens.shape[0] == extend_prefix_lens.shape[0]
        assert seq_lens.shape[0] == extend_seq_lens.shape[0]
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
            per_req_out_redudant = (
                scaled_dot_product_attention(per_req_query_redudant.unsqueeze(0), per_req_key.unsqueeze(0),
                                             per_req_value.unsqueeze(0), enable_gqa=enable_gqa, scale=scaling,
                                             is_causal=causal)
                .squeeze(0).movedim(query.dim() - 2, 0))
            output[start_q:end_q, :, :] = per_req_out_redudant[prefill_seq_len_q:, :, :]
            start_q, start_kv = end_q, end_kv
        return output

    def _run_sdpa_forward_decode(self, query, output, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens,
                                 seq_lens_cpu, scaling=None, enable_gqa=False, causal=False):
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
            per_req_out = (
                scaled_dot_product_attention(per_req_query.unsqueeze(0), per_req_key.unsqueeze(0),
                                             per_req_value.unsqueeze(0), enable_gqa=enable_gqa, scale=scaling,
                                             is_causal=causal)
                .squeeze(0).movedim(query.dim() - 2, 0))
            output[start_q:end_q, :, :] = per_req_out
            start_q, start_kv = end_q, end_kv
        return output


H, KVH, D = 4, 2, 8
POOL = 64
k_pool = torch.zeros(POOL, KVH, D)
v_pool = torch.zeros(POOL, KVH, D)
req_to_token = torch.zeros(4, 32, dtype=torch.int64)
backend = TorchNativeAttnBackend()
wq = torch.randn(16, H * D) * 0.3
wk = torch.randn(16, KVH * D) * 0.3
wv = torch.randn(16, KVH * D) * 0.3

# two requests: req A (pool row 2) is new, 5 tokens; req B (pool row 0) shares a 3-token cached prefix and extends by 4
full_A = torch.randn(5, 16)
full_B = torch.randn(7, 16)
free = iter(torch.randperm(POOL).tolist())  # scattered pool slots, as the allocator hands them out


def proj(x):
    return (x @ wq).view(-1, H, D), (x @ wk).view(-1, KVH, D), (x @ wv).view(-1, KVH, D)


# the cached prefix of B was written by an earlier request
_, kB, vB = proj(full_B[:3])
for i in range(3):
    slot = next(free)
    req_to_token[0, i] = slot
    k_pool[slot], v_pool[slot] = kB[i], vB[i]

# extend batch: A all 5 tokens, B tokens 3..6
req_pool_indices = torch.tensor([2, 0])
prefix = [0, 3]
ext = [5, 4]
seq = [5, 7]
x_ext = torch.cat([full_A, full_B[3:]])
q, k, v = proj(x_ext)
out_cache_loc = []
for r, (p, e) in zip([2, 0], zip(prefix, ext)):
    for i in range(p, p + e):
        slot = next(free)
        req_to_token[r, i] = slot
        out_cache_loc.append(slot)
out_cache_loc = torch.tensor(out_cache_loc)
k_pool[out_cache_loc], v_pool[out_cache_loc] = k, v  # set_kv_buffer
o = torch.empty_like(q)
backend._run_sdpa_forward_extend(q, o, k_pool, v_pool, req_to_token, req_pool_indices, torch.tensor(seq), seq,
                                 torch.tensor(prefix), prefix, torch.tensor(ext), ext, scaling=D ** -0.5,
                                 enable_gqa=True, causal=True)


def reference(x):
    qq, kk, vv = proj(x)
    return scaled_dot_product_attention(qq.transpose(0, 1), kk.transpose(0, 1), vv.transpose(0, 1), is_causal=True,
                                        enable_gqa=True).transpose(0, 1)


assert torch.allclose(o[:5], reference(full_A), atol=1e-5)
assert torch.allclose(o[5:], reference(full_B)[3:], atol=1e-5)

# decode loop: one new token per request, causal=False over that request's whole kv
for step in range(3):
    new = torch.randn(2, 16)
    full_A = torch.cat([full_A, new[:1]])
    full_B = torch.cat([full_B, new[1:]])
    q, k, v = proj(new)
    locs = []
    for j, r in enumerate([2, 0]):
        slot = next(free)
        req_to_token[r, seq[j]] = slot
        locs.append(slot)
        seq[j] += 1
    locs = torch.tensor(locs)
    k_pool[locs], v_pool[locs] = k, v
    o = torch.empty_like(q)
    backend._run_sdpa_forward_decode(q, o, k_pool, v_pool, req_to_token, req_pool_indices, torch.tensor(seq), seq,
                                     scaling=D ** -0.5, enable_gqa=True, causal=False)
    assert torch.allclose(o[0], reference(full_A)[-1], atol=1e-5)
    assert torch.allclose(o[1], reference(full_B)[-1], atol=1e-5)
print("extend + decode match full causal attention; seq_lens", seq)
