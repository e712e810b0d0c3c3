# Paged KV cache + speculative verification step, ported from foundation-model-stack/fms-extras
# @026fa4dfd4d9a09b83fd48accf5edbe959efc1f6: fms_extras/utils/cache/paged.py (PagedAttentionCacheDataLayer.store /
# attend / is_filled, PagedAttentionCacheData.apply_batch_expansion) and fms_extras/modules/attention.py
# (PagedMultiHeadAttention.forward: prompt -> SDPA with the bs x q_len x kv_len mask, generation -> paged attend).
# vLLM's ops.reshape_and_cache and ops.paged_attention_v1 are replaced by plain-torch stand-ins taking the same
# arguments (slot_mapping; block_mapping, context_lengths, block_size). The speculative step sends n candidate
# tokens per sequence; apply_batch_expansion moves them into the batch, each row with its own context length
# (ctx - n + 1 .. ctx), so candidate i reads its prompt and candidates 0..i. Blocks are assigned out of order.
import dataclasses
from typing import Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)


# ---------------------------------------------------------------- stand-ins for fms_extras._custom_ops (vLLM)


def reshape_and_cache(key, value, key_cache, value_cache, slot_mapping):
    # key: [num_tokens, kv_heads, head_size]; cache: [num_blocks, block_size, kv_heads, head_size]
    block_size = key_cache.shape[1]
    for t in range(key.shape[0]):
        slot = int(slot_mapping[t])
        if slot < 0:
            continue
        key_cache[slot // block_size, slot % block_size] = key[t]
        value_cache[slot // block_size, slot % block_size] = value[t]


def paged_attention_v1(out, query, key_cache, value_cache, num_kv_heads, scale, block_tables, context_lens,
                       block_size, max_context_len, alibi_slopes):
    # one query token per row; row s reads tokens 0 .. context_lens[s]-1 through block_tables[s]
    num_seqs, num_heads, head_size = query.shape
    rep = num_heads // num_kv_heads
    for s in range(num_seqs):
        n = int(context_lens[s])
        ks, vs = [], []
        for tok in range(n):
            blk = int(block_tables[s, tok // block_size])
            ks.append(key_cache[blk, tok % block_size])
            vs.append(value_cache[blk, tok % block_size])
        k = torch.stack(ks).repeat_interleave(rep, dim=1)  # [n, H, D]
        v = torch.stack(vs).repeat_interleave(rep, dim=1)
        w = torch.softmax(torch.einsum("hd,nhd->hn", query[s], k) * scale, dim=-1)
        out[s] = torch.einsum("hn,nhd->hd", w, v)


# ---------------------------------------------------------------- fms_extras/utils/cache/paged.py


@dataclasses.dataclass
class PagedAttentionCacheDataLayer:
    data_layer: Tuple[torch.Tensor, torch.Tensor]
    max_sequence_length: int
    context_lengths: Optional[torch.Tensor]
    slot_mapping: torch.Tensor
    position_ids: torch.Tensor
    block_mapping: torch.Tensor
    block_size: int
    scale: float
    num_heads: int
    kv_heads: int
    head_size: int
    is_generating: bool
    query_length: int

    def store(self, keys, values):
        key_to_cache = keys.view(-1, self.kv_heads, self.head_size)
        value_to_cache = values.view(-1, self.kv_heads, self.head_size)
        reshape_and_cache(key_to_cache, value_to_cache, self.data_layer[0], self.data_layer[1], self.slot_mapping)
        return keys, values

    def attend(self, query):
        query = query.view(-1, self.num_heads, self.head_size)
        attn = torch.empty_like(query)
        paged_attention_v1(attn, query, self.data_layer[0], self.data_layer[1], self.kv_heads, self.scale,
                           self.block_mapping, self.context_lengths, self.block_size, self.max_sequence_length, None)
        return attn

    def is_filled(self):
        return self.is_generating


@dataclasses.dataclass
class PagedAttentionCacheData:
    data: list
    max_sequence_length: int
    context_lengths: Optional[torch.Tensor]
    position_ids: torch.Tensor
    slot_mapping: torch.Tensor
    block_mapping: torch.Tensor
    block_size: int
    scale: float
    num_heads: int
    kv_heads: int
    head_size: int
    is_generating: bool
    query_length: int

    def get_layer(self, layer_index):
        return PagedAttentionCacheDataLayer(
            data_layer=self.data[layer_index], max_sequence_length=self.max_sequence_length,
            context_lengths=self.context_lengths, position_ids=self.position_ids, slot_mapping=self.slot_mapping,
            block_mapping=self.block_mapping, block_size=self.block_size, scale=self.scale,
            num_heads=self.num_heads, kv_heads=self.kv_heads, head_size=self.head_size,
            is_generating=self.is_generating, query_length=self.query_length)

    def apply_batch_expansion(self):
        context_lengths = self.context_lengths  # bk
        inflate_factor = self.query_length
        context_lengths = context_lengths.unsqueeze(1).expand(-1, inflate_factor)  # bk n
        # subtract arange(inp_len) to get lengths for each token in candidates
        self.context_lengths = (
            context_lengths.sub(context_lengths.sign().cumsum(1).flip([1]).sub(1)).int().view(-1)
        )  # bkn
        self.block_mapping = self.block_mapping.repeat_interleave(inflate_factor, dim=0)  # bkn n_blocks


# ---------------------------------------------------------------- fms_extras/modules/attention.py (no rotary)


class PagedMultiHeadAttention(nn.Module):
    def __init__(self, emb_dim, emb_kq, emb_v, nheads, kvheads):
        super().__init__()
        self.nheads = nheads
        self.kvheads = kvheads
        self.emb_dim = emb_dim
        self.emb_kq_per_head = emb_kq
        self.emb_v_per_head = emb_v
        self.dense = nn.Linear(self.nheads * self.emb_v_per_head, self.emb_dim, bias=False)
        self.splits = [self.nheads * self.emb_kq_per_head, self.kvheads * self.emb_kq_per_head,
                       self.kvheads * self.emb_v_per_head]
        self.qkv_fused = nn.Linear(self.emb_dim, sum(self.splits), bias=False)

    def forward(self, q, k, v, mask=None, cache_data_layer=None, use_cache=False, is_causal_mask=False):
        batch_size, q_len, _ = q.size()
        queries, keys, values = self.qkv_fused(q).split(self.splits, dim=-1)
        queries = queries.view(batch_size, q_len, self.nheads, self.emb_kq_per_head)
        keys = keys.view(batch_size, q_len, self.kvheads, self.emb_kq_per_head)
        values = values.view(batch_size, q_len, self.kvheads, self.emb_v_per_head)

        if use_cache and cache_data_layer:
            keys, values = cache_data_layer.store(keys, values)

        if use_cache and cache_data_layer and cache_data_layer.is_filled():
            attn = cache_data_layer.attend(queries)
        else:
            queries = queries.transpose(2, 1)
            keys = keys.transpose(2, 1)
            values = values.transpose(2, 1)
            if mask is not None:
                while len(mask.size()) != 4:  # expects bs (x nheads) x q_len x kv_len
                    mask = mask.unsqueeze(1)
            attn_mask = mask
            expansion = self.nheads // self.kvheads
            if expansion != 1:
                keys_e = keys.unsqueeze(2).expand(-1, -1, expansion, -1, -1).flatten(1, 2)
                values_e = values.unsqueeze(2).expand(-1, -1, expansion, -1, -1).flatten(1, 2)
            else:
                keys_e, values_e = keys, values
            attn = F.scaled_dot_product_attention(queries, keys_e, values_e, attn_mask=attn_mask,
                                                  is_causal=is_causal_mask)
            attn = attn.transpose(2, 1).contiguous()

        attn = attn.view(batch_size, q_len, self.nheads * self.emb_v_per_head)
        return self.dense(attn)


# ---------------------------------------------------------------- a small engine around it

EMB, NH, KVH, HD, BS = 32, 4, 2, 8, 4
N_SPEC = 3
attn_mod = PagedMultiHeadAttention(EMB, HD, HD, NH, KVH).eval()
num_blocks = 16
key_cache = torch.zeros(num_blocks, BS, KVH, HD)
value_cache = torch.zeros(num_blocks, BS, KVH, HD)

prompt_lens = [5, 9, 2]
max_total = max(prompt_lens) + N_SPEC
blocks_needed = [(L + N_SPEC + BS - 1) // BS for L in prompt_lens]
free = [11, 3, 7, 0, 14, 5, 9, 2, 12]  # handed out out of order
block_tables = [[free.pop(0) for _ in range(nb)] for nb in blocks_needed]
n_blocks_max = max(blocks_needed)
block_mapping = torch.tensor([bt + [0] * (n_blocks_max - len(bt)) for bt in block_tables])


def slots(seq, positions):
    return [block_tables[seq][p // BS] * BS + p % BS for p in positions]


prompts = [torch.randn(1, L, EMB) for L in prompt_lens]
cands = [torch.randn(1, N_SPEC, EMB) for _ in prompt_lens]

with torch.no_grad():
    # prefill: right-padded prompt batch, one SDPA call with a bs x q_len x kv_len causal & key-padding mask
    Lmax = max(prompt_lens)
    x = torch.zeros(len(prompt_lens), Lmax, EMB)
    for i, p in enumerate(prompts):
        x[i, : p.shape[1]] = p[0]
    is_pad = torch.arange(Lmax)[None, :] >= torch.tensor(prompt_lens)[:, None]
    causal = torch.ones(Lmax, Lmax, dtype=torch.bool).tril()
    mask = causal[None] & ~is_pad[:, None, :]
    mask = mask | torch.eye(Lmax, dtype=torch.bool)[None]  # padded query rows keep their own slot (discarded)
    slot_mapping = torch.tensor([s for i, L in enumerate(prompt_lens)
                                 for s in slots(i, range(L)) + [-1] * (Lmax - L)])
    prefill_cache = PagedAttentionCacheData(
        data=[(key_cache, value_cache)], max_sequence_length=max_total, context_lengths=None,
        position_ids=torch.arange(Lmax).expand(len(prompt_lens), -1), slot_mapping=slot_mapping,
        block_mapping=block_mapping, block_size=BS, scale=HD ** -0.5, num_heads=NH, kv_heads=KVH, head_size=HD,
        is_generating=False, query_length=Lmax)
    prefill_out = attn_mod(x, x, x, mask=mask, cache_data_layer=prefill_cache.get_layer(0), use_cache=True)

    # speculative verification: N_SPEC candidate tokens per sequence, expanded into the batch
    xs = torch.cat(cands, dim=0)  # [b, n, emb]
    slot_mapping = torch.tensor([s for i, L in enumerate(prompt_lens) for s in slots(i, range(L, L + N_SPEC))])
    context_lengths = torch.tensor([L + N_SPEC for L in prompt_lens], dtype=torch.int32)
    gen_cache = PagedAttentionCacheData(
        data=[(key_cache, value_cache)], max_sequence_length=max_total, context_lengths=context_lengths,
        position_ids=(torch.tensor(prompt_lens)[:, None] + torch.arange(N_SPEC)[None]), slot_mapping=slot_mapping,
        block_mapping=block_mapping, block_size=BS, scale=HD ** -0.5, num_heads=NH, kv_heads=KVH, head_size=HD,
        is_generating=True, query_length=N_SPEC)
    gen_cache.apply_batch_expansion()
    spec_out = attn_mod(xs, xs, xs, cache_data_layer=gen_cache.get_layer(0), use_cache=True)

    # reference: each sequence alone, prompt + candidates, plain causal attention, no cache, no padding
    worst = 0.0
    for i, L in enumerate(prompt_lens):
        full = torch.cat([prompts[i], cands[i]], dim=1)
        ref = attn_mod(full, full, full, is_causal_mask=True)
        d1 = (prefill_out[i, :L] - ref[0, :L]).abs().max().item()
        d2 = (spec_out[i] - ref[0, L:]).abs().max().item()
        worst = max(worst, d1, d2)
    print("expanded context_lengths:", gen_cache.context_lengths.tolist())
    print(f"paged prefill + speculative batch expansion match per-sequence causal attention: max diff {worst:.2e}")
    assert worst < 1e-5
