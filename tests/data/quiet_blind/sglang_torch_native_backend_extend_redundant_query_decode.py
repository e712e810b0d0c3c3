"""SGLang torch-native attention backend: extend (prefix-cache hit + new tokens) and decode over a token pool.

Follows sgl-project/sglang python/sglang/srt/layers/attention/torch_native_backend.py@011a615e37189e8de5076748d8d0505406b1abe1
(TorchNativeAttnBackend.forward_extend / forward_decode, _run_sdpa_forward_extend: the request's new queries are
written into the tail of a "redundant" query buffer as long as the whole sequence, SDPA runs square with
is_causal=True and only rows [prefix_len:] are kept; _run_sdpa_forward_decode: one query per request, SDPA with
is_causal=False over all of that request's cached tokens), with ForwardBatch fields (req_pool_indices, seq_lens,
extend_prefix_lens, extend_seq_lens, out_cache_loc) and req_to_token / token_to_kv_pool indirection as in
sglang's mem_cache. One attention layer, random weights, slots handed out from a shuffled free list.
Mask meant: causal attention inside each request over its absolute positions (cached prefix + new tokens);
a decode token sees every cached token of its own request and none of the other request.
"""
from dataclasses import dataclass
from typing import List

import torch
import torch.nn as nn
from torch.nn.functional import scaled_dot_product_attention


@dataclass
class ForwardBatch:
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    seq_lens_cpu: List[int]
    out_cache_loc: torch.Tensor
    extend_prefix_lens: torch.Tensor = None
    extend_prefix_lens_cpu: List[int] = None
    extend_seq_lens: torch.Tensor = None
    extend_seq_lens_cpu: List[int] = None


class TokenToKVPool:
    def __init__(self, size, head_num, head_dim):
        self.k_buffer = torch.zeros(size, head_num, head_dim)
        self.v_buffer = torch.zeros(size, head_num, head_dim)
        self.free_slots = torch.randperm(size)  # slots are not contiguous per request

    def alloc(self, n):
        out, self.free_slots = self.free_slots[:n], self.free_slots[n:]
        return out

    def set_kv_buffer(self, loc, k, v):
        self.k_buffer[loc] = k
        self.v_buffer[loc] = v


class TorchNativeAttnBackend:
    def _run_sdpa_forward_extend(self, query, output, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens,
                                 seq_lens_cpu, extend_prefix_lens_cpu, extend_seq_lens_cpu, scaling=None, causal=False):
        query = query.movedim(0, query.dim() - 2)  # [num_heads, num_tokens, head_size]
        start_q = 0
        for seq_idx in range(seq_lens.shape[0]):  # one iteration per request
            extend_seq_len_q = extend_seq_lens_cpu[seq_idx]
            prefill_seq_len_q = extend_prefix_lens_cpu[seq_idx]
            seq_len_kv = seq_lens_cpu[seq_idx]
            end_q = start_q + extend_seq_len_q
            per_req_query = query[:, start_q:end_q, :]
            # rows [:prefix] are never read back; SDPA's square causal mask then lines up with absolute positions
            per_req_query_redudant = torch.empty((per_req_query.shape[0], seq_len_kv, per_req_query.shape[2]),
                                                 dtype=per_req_query.dtype)
            per_req_query_redudant[:, prefill_seq_len_q:, :] = per_req_query
            per_req_tokens = req_to_token[req_pool_indices[seq_idx], :seq_len_kv]
            per_req_key = k_cache[per_req_tokens].movedim(0, query.dim() - 2)
            per_req_value = v_cache[per_req_tokens].movedim(0, query.dim() - 2)
            per_req_out_redudant = scaled_dot_product_attention(
                per_req_query_redudant.unsqueeze(0), per_req_key.unsqueeze(0), per_req_value.unsqueeze(0),
                scale=scaling, is_causal=causal).squeeze(0).movedim(query.dim() - 2, 0)
            output[start_q:end_q] = per_req_out_redudant[prefill_seq_len_q:, :, :]
            start_q = end_q
        return output

    def _run_sdpa_forward_decode(self, query, output, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens,
                                 seq_lens_cpu, scaling=None, causal=False):
        query = query.movedim(0, query.dim() - 2)
        start_q = 0
        for seq_idx in range(seq_lens.shape[0]):
            end_q = start_q + 1
            per_req_query = query[:, start_q:end_q, :]
            per_req_tokens = req_to_token[req_pool_indices[seq_idx], :seq_lens_cpu[seq_idx]]
            per_req_key = k_cache[per_req_tokens].movedim(0, query.dim() - 2)
            per_req_value = v_cache[per_req_tokens].movedim(0, query.dim() - 2)
            per_req_out = scaled_dot_product_attention(
                per_req_query.unsqueeze(0), per_req_key.unsqueeze(0), per_req_value.unsqueeze(0),
                scale=scaling, is_causal=causal).squeeze(0).movedim(query.dim() - 2, 0)
            output[start_q:end_q] = per_req_out
            start_q = end_q
        return output

    def forward_extend(self, q, k, v, layer, forward_batch, pool, req_to_token):
        o = torch.empty_like(q)
        pool.set_kv_buffer(forward_batch.out_cache_loc, k, v)
        causal = not layer.is_cross_attention
        return self._run_sdpa_forward_extend(
            q, o, pool.k_buffer, pool.v_buffer, req_to_token, forward_batch.req_pool_indices,
            forward_batch.seq_lens, forward_batch.seq_lens_cpu, forward_batch.extend_prefix_lens_cpu,
            forward_batch.extend_seq_lens_cpu, scaling=layer.scaling, causal=causal)

    def forward_decode(self, q, k, v, layer, forward_batch, pool, req_to_token):
        o = torch.empty_like(q)
        pool.set_kv_buffer(forward_batch.out_cache_loc, k, v)
        return self._run_sdpa_forward_decode(
            q, o, pool.k_buffer, pool.v_buffer, req_to_token, forward_batch.req_pool_indices,
            forward_batch.seq_lens, forward_batch.seq_lens_cpu, scaling=layer.scaling, causal=False)


class RadixAttentionLayer(nn.Module):
    def __init__(self, hidden=32, heads=4):
        super().__init__()
        self.heads, self.head_dim = heads, hidden // heads
        self.scaling = self.head_dim ** -0.5
        self.is_cross_attention = False
        self.embed = nn.Embedding(50, hidden)
        self.qkv_proj = nn.Linear(hidden, 3 * hidden)

    def qkv(self, token_ids):
        q, k, v = self.qkv_proj(self.embed(token_ids)).chunk(3, -1)
        return (t.view(-1, self.heads, self.head_dim) for t in (q, k, v))


def main():
    torch.manual_seed(0)
    layer, backend = RadixAttentionLayer().eval(), TorchNativeAttnBackend()
    pool = TokenToKVPool(64, layer.heads, layer.head_dim)
    req_to_token = torch.zeros(4, 32, dtype=torch.long)
    full = {0: torch.randint(0, 50, (10,)), 3: torch.randint(0, 50, (6,))}  # req_pool_idx -> all its tokens
    with torch.no_grad():
        # request 0 had its first 5 tokens prefilled earlier (a radix-cache hit)
        loc = pool.alloc(5)
        req_to_token[0, :5] = loc
        _, k, v = layer.qkv(full[0][:5])
        pool.set_kv_buffer(loc, k, v)
        # extend batch: req 0 adds tokens 5..7 on top of its prefix, req 3 prefills 4 tokens from scratch
        prefix, ext = [5, 0], [3, 4]
        locs = []
        for r, p, e in zip([0, 3], prefix, ext):
            l = pool.alloc(e)
            req_to_token[r, p:p + e] = l
            locs.append(l)
        new_tokens = torch.cat([full[0][5:8], full[3][:4]])
        fb = ForwardBatch(torch.tensor([0, 3]), torch.tensor([8, 4]), [8, 4], torch.cat(locs),
                          torch.tensor(prefix), prefix, torch.tensor(ext), ext)
        outs = {0: {}, 3: {}}
        o = backend.forward_extend(*layer.qkv(new_tokens), layer, fb, pool, req_to_token)
        for i, pos in enumerate(range(5, 8)):
            outs[0][pos] = o[i]
        for i in range(4):
            outs[3][i] = o[3 + i]
        # two decode steps, one token per request
        lens = {0: 8, 3: 4}
        for _ in range(2):
            l = pool.alloc(2)
            req_to_token[0, lens[0]], req_to_token[3, lens[3]] = l[0], l[1]
            tokens = torch.stack([full[0][lens[0]], full[3][lens[3]]])
            lens = {0: lens[0] + 1, 3: lens[3] + 1}
            fb = ForwardBatch(torch.tensor([0, 3]), torch.tensor([lens[0], lens[3]]), [lens[0], lens[3]], l)
            o = backend.forward_decode(*layer.qkv(tokens), layer, fb, pool, req_to_token)
            outs[0][lens[0] - 1], outs[3][lens[3] - 1] = o[0], o[1]
        # reference: each request alone, full causal attention with an explicit tril mask
        for r, toks in full.items():
            n = lens[r]
            q, k, v = (t.transpose(0, 1) for t in layer.qkv(toks[:n]))
            ref = scaled_dot_product_attention(q, k, v, attn_mask=torch.ones(n, n, dtype=torch.bool).tril(),
                                               scale=layer.scaling).transpose(0, 1)
            for pos, got in outs[r].items():
                assert torch.allclose(got, ref[pos], atol=1e-5), (r, pos)
    print("sglang torch native backend ok", {r: sorted(v) for r, v in outs.items()})


if __name__ == "__main__":
    main()
