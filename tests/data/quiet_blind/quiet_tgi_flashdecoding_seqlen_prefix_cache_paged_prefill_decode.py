# Correct program (quiet batch quiet-r98a).
# Citation: huggingface/text-generation-inference server/text_generation_server/layers/attention/common.py
#   @14e8ca523602d0025c285063b3232100675b933e (Seqlen: cu_seqlen_k = cumsum(input_lengths + cache_lengths),
#   cu_seqlen_q = arange for decode) and layers/attention/cuda.py @058162685f0531edb4c566151eb68c490ebe8267
#   (reshape_and_cache for flashdecoding: key_cache.view(-1, H, D)[slots] = key; attention(): flash varlen_fwd over
#   the paged cache with cu_seqlen_q / cu_seqlen_k / block_tables, causal; paged_attention() under
#   ATTENTION == "flashdecoding": the same kernel with max_q = 1).
# TGI's flash models with prefix caching: a prefill batch holds each request's new tokens packed (cu_seqlen_prefill),
# its cached prefix counted in cache_lengths and reached through block_tables; the kernel's key count per request is
# cache_length + input_length and causal is aligned bottom-right, so the new tokens see the whole cached prefix.
# Adaptation: flash_attn_2_cuda.varlen_fwd written in torch (paged K/V through block_table, bottom-right causal);
# BLOCK_SIZE 4 instead of 256; a toy two-layer GQA model; the radix allocator replaced by handing request B the
# pages that hold A's first 8 tokens (a prefix hit of two full blocks). Self-check: every new token's output equals
# its request run alone, unpadded, with a loop over query positions slicing keys [0, t].
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn

torch.manual_seed(0)
ATTENTION = "flashdecoding"
BLOCK_SIZE = 4
HIDDEN, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, VOCAB, NUM_BLOCKS = 32, 4, 2, 8, 64, 24


@dataclass
class Seqlen:
    input_lengths: torch.Tensor
    cache_lengths: torch.Tensor
    cu_seqlen_q: Optional[torch.Tensor]
    cu_seqlen_k: Optional[torch.Tensor]
    max_q: int
    max_k: int

    def __init__(self, input_lengths, cache_lengths, cu_seqlen_q=None, max_q=None, max_k=None):
        self.input_lengths = input_lengths
        self.cache_lengths = cache_lengths
        device = self.input_lengths.device
        shape = self.input_lengths.shape
        if cu_seqlen_q is None:
            cu_seqlen_q = torch.arange(shape[0] + 1, device=device, dtype=torch.int32)
            max_q = 1
        else:
            assert max_q is not None
        assert max_k is not None
        cu_seqlen_k = torch.zeros(shape[-1] + 1, device=device, dtype=torch.int32)
        total = self.input_lengths + self.cache_lengths
        torch.cumsum(total, -1, out=cu_seqlen_k[1:])
        self.cu_seqlen_q = cu_seqlen_q
        self.cu_seqlen_k = cu_seqlen_k
        self.max_q = max_q
        self.max_k = max_k


def reshape_and_cache(key, value, key_cache, value_cache, slots):
    if ATTENTION in {"flashdecoding", "flashinfer"}:
        shape = key_cache.shape
        key_cache.view(-1, shape[-2], shape[-1])[slots] = key
        value_cache.view(-1, shape[-2], shape[-1])[slots] = value


def varlen_fwd(q, k_cache, v_cache, out, cu_seqlens_q, cu_seqlens_k, block_table, max_q, max_k, softmax_scale,
               causal):
    # flash_attn_2_cuda.varlen_fwd with a paged K/V (block_table): request b owns queries
    # cu_seqlens_q[b]:cu_seqlens_q[b+1] and keys 0 .. cu_seqlens_k[b+1]-cu_seqlens_k[b]-1 read page by page;
    # causal aligned bottom-right.
    page = k_cache.shape[1]
    groups = q.shape[1] // k_cache.shape[2]
    for b in range(len(cu_seqlens_q) - 1):
        qs, qe = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1])
        lq, lk = qe - qs, int(cu_seqlens_k[b + 1] - cu_seqlens_k[b])
        pages = block_table[b, :-(-lk // page)].long()
        kb = k_cache[pages].flatten(0, 1)[:lk].repeat_interleave(groups, dim=1)
        vb = v_cache[pages].flatten(0, 1)[:lk].repeat_interleave(groups, dim=1)
        s = torch.einsum("qhd,khd->hqk", q[qs:qe], kb) * softmax_scale
        if causal:
            keep = torch.arange(lk)[None, :] <= torch.arange(lq)[:, None] + (lk - lq)
            s = s.masked_fill(~keep, float("-inf"))
        out[qs:qe] = torch.einsum("hqk,khd->qhd", s.softmax(-1), vb)
    return [out]


def attention(q, key_cache, value_cache, seqlen: Seqlen, block_tables, softmax_scale, window_size_left=-1,
              causal=True, softcap=0.0):
    out = torch.empty_like(q)
    if window_size_left <= 0 and window_size_left != -1:
        raise ValueError("`window_size_left` must be > 0 or -1")
    return varlen_fwd(q, key_cache, value_cache, out, seqlen.cu_seqlen_q, seqlen.cu_seqlen_k, block_tables,
                      seqlen.max_q, seqlen.max_k, softmax_scale, causal)[0]


def paged_attention(query, key_cache, value_cache, kv_head_mapping, softmax_scale, block_tables, seqlen: Seqlen,
                    max_s, num_kv_heads, softcap=None):
    if ATTENTION == "flashdecoding":
        max_q = 1
        max_k = max_s
        out = torch.empty_like(query)
        return varlen_fwd(query, key_cache, value_cache, out, seqlen.cu_seqlen_q, seqlen.cu_seqlen_k, block_tables,
                          max_q, max_k, softmax_scale, True)[0]
    raise NotImplementedError


class FlashLlamaAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.softmax_scale = HEAD_DIM ** -0.5
        self.query_key_value = nn.Linear(HIDDEN, (NUM_HEADS + 2 * NUM_KV_HEADS) * HEAD_DIM, bias=False)
        self.o_proj = nn.Linear(NUM_HEADS * HEAD_DIM, HIDDEN, bias=False)
        self.kv_head_mapping = torch.arange(NUM_KV_HEADS).repeat_interleave(NUM_HEADS // NUM_KV_HEADS)

    def qkv(self, hidden_states):
        qkv = self.query_key_value(hidden_states)
        query, kv = qkv.split([NUM_HEADS * HEAD_DIM, 2 * NUM_KV_HEADS * HEAD_DIM], dim=1)
        return query.view(-1, NUM_HEADS, HEAD_DIM), kv.view(-1, 2, NUM_KV_HEADS, HEAD_DIM)

    def forward(self, hidden_states, cu_seqlen_prefill, kv_cache, block_tables, slots, seqlen, max_s):
        query, kv = self.qkv(hidden_states)
        reshape_and_cache(kv[:, 0], kv[:, 1], kv_cache[0], kv_cache[1], slots)
        if cu_seqlen_prefill is not None:
            attn_output = attention(query, kv_cache[0], kv_cache[1], seqlen, block_tables, self.softmax_scale)
        else:
            attn_output = paged_attention(query, kv_cache[0], kv_cache[1], self.kv_head_mapping, self.softmax_scale,
                                          block_tables, seqlen, max_s, NUM_KV_HEADS)
        return self.o_proj(attn_output.view(-1, NUM_HEADS * HEAD_DIM))


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed_tokens = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.ModuleList([FlashLlamaAttention() for _ in range(2)])

    def forward(self, input_ids, cu_seqlen_prefill, kv_cache, block_tables, slots, seqlen, max_s):
        h = self.embed_tokens(input_ids)
        for layer, cache in zip(self.layers, kv_cache):
            h = h + layer(h, cu_seqlen_prefill, cache, block_tables, slots, seqlen, max_s)
        return h


@torch.no_grad()
def reference(model, tokens):
    h = model.embed_tokens(torch.tensor(tokens))
    for layer in model.layers:
        q, kv = layer.qkv(h)
        k = kv[:, 0].repeat_interleave(NUM_HEADS // NUM_KV_HEADS, dim=1)
        v = kv[:, 1].repeat_interleave(NUM_HEADS // NUM_KV_HEADS, dim=1)
        o = torch.empty_like(q)
        for t in range(len(tokens)):
            s = torch.einsum("hd,khd->hk", q[t], k[:t + 1]) * layer.softmax_scale
            o[t] = torch.einsum("hk,khd->hd", s.softmax(-1), v[:t + 1])
        h = h + layer.o_proj(o.reshape(-1, NUM_HEADS * HEAD_DIM))
    return h


@torch.no_grad()
def run_batch(model, kv_cache, reqs, streams, prefill):
    # reqs: list of (rid, blocks, cache_length, input_length)
    input_ids, slots = [], []
    for rid, blocks, cache_len, in_len in reqs:
        pos = torch.arange(cache_len, cache_len + in_len)
        input_ids.append(torch.tensor(streams[rid][cache_len:cache_len + in_len]))
        slots.append(torch.tensor(blocks)[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE)
    max_blocks = max(len(r[1]) for r in reqs)
    block_tables = torch.zeros(len(reqs), max_blocks, dtype=torch.int32)
    for i, r in enumerate(reqs):
        block_tables[i, :len(r[1])] = torch.tensor(r[1])
    input_lengths = torch.tensor([r[3] for r in reqs], dtype=torch.int32)
    cache_lengths = torch.tensor([r[2] for r in reqs], dtype=torch.int32)
    max_s = int((input_lengths + cache_lengths).max())
    if prefill:
        cu_seqlen_prefill = torch.nn.functional.pad(torch.cumsum(input_lengths, 0, dtype=torch.int32), (1, 0))
        seqlen = Seqlen(input_lengths, cache_lengths, cu_seqlen_q=cu_seqlen_prefill,
                        max_q=int(input_lengths.max()), max_k=max_s)
    else:
        cu_seqlen_prefill = None
        seqlen = Seqlen(input_lengths, cache_lengths, cu_seqlen_q=None, max_k=max_s)
    h = model(torch.cat(input_ids), cu_seqlen_prefill, kv_cache, block_tables, torch.cat(slots), seqlen, max_s)
    offsets = torch.nn.functional.pad(torch.cumsum(input_lengths, 0), (1, 0))
    return {r[0]: h[int(offsets[i]):int(offsets[i + 1])] for i, r in enumerate(reqs)}


def main():
    model = Model().eval()
    kv_cache = [(torch.zeros(NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM),
                 torch.zeros(NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)) for _ in model.layers]
    g = torch.Generator().manual_seed(3)
    a = torch.randint(0, VOCAB, (15,), generator=g).tolist()        # prompt 11, then 4 decodes
    c = torch.randint(0, VOCAB, (9,), generator=g).tolist()         # prompt 5, then 4 decodes
    b = a[:8] + torch.randint(0, VOCAB, (10,), generator=g).tolist()  # shares A's first 8 tokens; prompt 14
    streams = {"A": a, "B": b, "C": c}
    blocks = {"A": [7, 2, 19, 11], "C": [5, 14, 1], "B": [7, 2, 9, 16, 3]}  # B's first two pages are A's
    refs = {rid: reference(model, s) for rid, s in streams.items()}
    checks = []
    # prefill batch 1: A (11 tokens) and C (5 tokens), nothing cached
    checks.append(run_batch(model, kv_cache, [("A", blocks["A"], 0, 11), ("C", blocks["C"], 0, 5)], streams, True))
    checks[-1] = {k: (v, 0) for k, v in checks[-1].items()}
    # prefill batch 2: B with a prefix-cache hit of 8 tokens (two full pages of A), 6 new tokens
    out = run_batch(model, kv_cache, [("B", blocks["B"], 8, 6)], streams, True)
    checks.append({"B": (out["B"], 8)})
    # decode batches: every request one token at a time
    past = {"A": 11, "C": 5, "B": 14}
    for _ in range(4):
        reqs = [(rid, blocks[rid], past[rid], 1) for rid in ("A", "C", "B")]
        out = run_batch(model, kv_cache, reqs, streams, False)
        checks.append({rid: (out[rid], past[rid]) for rid in out})
        for rid in past:
            past[rid] += 1
    worst = 0.0
    for step in checks:
        for rid, (o, start) in step.items():
            ref = refs[rid][start:start + o.shape[0]]
            worst = max(worst, (o - ref).abs().max().item())
            assert torch.allclose(o, ref, atol=1e-5), (rid, start)
    print(f"TGI paged prefill with prefix cache + flashdecoding decode match the per-request reference "
          f"(max err {worst:.2e})")


if __name__ == "__main__":
    main()
