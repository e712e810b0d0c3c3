# Citation: vllm-project/vllm tests/kernels/attention/test_attention.py (ref_masked_attention,
#   ref_single_query_cached_kv_attention, ref_multi_query_kv_attention; commit 00df0753b8617dcb45e43f9b209c9c5a08b05fa8)
# Prefill: per-sequence causal mask as an additive float (triu * finfo(dtype).min) over cu_seq_lens-delimited packed tokens.
# Decode: a single query per sequence gathers exactly seq_len keys from a paged KV cache through its block table
# (j // block_size, j % block_size), with an ALiBi bias (position - seq_len + 1); unused slots/blocks are never read.
# Adaptation: reshape_and_cache (CUDA op) is written in Python to fill the cache from the prefill/decode K/V.
import random
import torch


def ref_masked_attention(query, key, value, scale, attn_mask=None):
    attn_weights = scale * torch.einsum("qhd,khd->hqk", query, key).float()
    if attn_mask is not None:
        attn_weights = attn_weights + attn_mask.float()
    attn_weights = torch.softmax(attn_weights, dim=-1).to(value.dtype)
    out = torch.einsum("hqk,khd->qhd", attn_weights, value)
    return out


def ref_single_query_cached_kv_attention(output, query, num_queries_per_kv, key_cache, value_cache, block_tables, seq_lens,
                                         scale, alibi_slopes):
    num_query_heads = query.shape[1]
    num_kv_heads = value_cache.shape[1]
    head_size = value_cache.shape[2]
    block_size = value_cache.shape[3]
    num_seqs = query.shape[0]
    block_tables_lst = block_tables.cpu().tolist()
    seq_lens_lst = seq_lens.cpu().tolist()
    for i in range(num_seqs):
        q = query[i].unsqueeze(0)
        block_table = block_tables_lst[i]
        seq_len = int(seq_lens_lst[i])
        keys_lst, values_lst = [], []
        for j in range(seq_len):
            block_number = int(block_table[j // block_size])
            block_offset = j % block_size
            k = key_cache[block_number, :, :, block_offset, :]
            k = k.reshape(num_kv_heads, head_size)
            keys_lst.append(k)
            v = value_cache[block_number, :, :, block_offset]
            values_lst.append(v)
        keys = torch.stack(keys_lst, dim=0)
        values = torch.stack(values_lst, dim=0)
        if num_queries_per_kv > 1:
            keys = torch.repeat_interleave(keys, num_queries_per_kv, dim=1)
            values = torch.repeat_interleave(values, num_queries_per_kv, dim=1)
        alibi_bias = None
        if alibi_slopes is not None:
            position_ids = torch.arange(seq_len).int()
            alibi_bias = (position_ids - seq_len + 1).float()
            alibi_bias = alibi_slopes.view(-1, 1, 1) * alibi_bias.view(1, 1, -1)
        out = ref_masked_attention(q, keys, values, scale, alibi_bias)
        out = out.view(num_query_heads, head_size)
        output[i].copy_(out, non_blocking=True)


def ref_multi_query_kv_attention(cu_seq_lens, query, key, value, scale, alibi_bias, dtype):
    num_seqs = len(cu_seq_lens) - 1
    ref_outputs = []
    for i in range(num_seqs):
        start_idx = cu_seq_lens[i]
        end_idx = cu_seq_lens[i + 1]
        seq_len = end_idx - start_idx
        if alibi_bias:
            attn_mask = alibi_bias[i]
        else:
            attn_mask = torch.triu(torch.ones(seq_len, seq_len, dtype=dtype), diagonal=1)
            attn_mask = attn_mask * torch.finfo(dtype).min
            attn_mask = attn_mask.to(dtype=dtype)
        ref_output = ref_masked_attention(query[start_idx:end_idx], key[start_idx:end_idx], value[start_idx:end_idx], scale,
                                          attn_mask=attn_mask)
        ref_outputs.append(ref_output)
    return torch.cat(ref_outputs, dim=0)


def reshape_and_cache(key, value, key_cache, value_cache, slot_mapping):
    # python form of the reshape_and_cache op: key [T, Hkv, D] -> key_cache[block, Hkv, D // x, offset, x]
    block_size = value_cache.shape[3]
    x = key_cache.shape[-1]
    for t, slot in enumerate(slot_mapping.tolist()):
        block, off = slot // block_size, slot % block_size
        key_cache[block, :, :, off, :] = key[t].view(key.shape[1], -1, x)
        value_cache[block, :, :, off] = value[t]


if __name__ == "__main__":
    torch.manual_seed(0)
    random.seed(0)
    dtype = torch.float32
    num_query_heads, num_kv_heads, head_size, block_size, num_blocks, x = 4, 2, 16, 4, 32, 4
    scale = float(1.0 / (head_size ** 0.5))
    num_queries_per_kv = num_query_heads // num_kv_heads
    key_cache = torch.randn(num_blocks, num_kv_heads, head_size // x, block_size, x) * 100  # garbage in unused slots
    value_cache = torch.randn(num_blocks, num_kv_heads, head_size, block_size) * 100
    Wq, Wk, Wv = (torch.randn(32, n * head_size) * 0.2 for n in (num_query_heads, num_kv_heads, num_kv_heads))

    prompt_lens = [5, 3, 9]
    max_new = 4
    max_blocks_per_seq = (max(prompt_lens) + max_new + block_size - 1) // block_size
    free = random.sample(range(num_blocks), len(prompt_lens) * max_blocks_per_seq)
    block_tables = torch.tensor([free[i * max_blocks_per_seq:(i + 1) * max_blocks_per_seq] for i in range(len(prompt_lens))],
                                dtype=torch.int)

    def slot(i, pos):
        return int(block_tables[i, pos // block_size]) * block_size + pos % block_size

    # prefill (packed prompts)
    cu_seq_lens = [0]
    for l in prompt_lens:
        cu_seq_lens.append(cu_seq_lens[-1] + l)
    h = torch.randn(cu_seq_lens[-1], 32)
    q = (h @ Wq).view(-1, num_query_heads, head_size)
    k = (h @ Wk).view(-1, num_kv_heads, head_size)
    v = (h @ Wv).view(-1, num_kv_heads, head_size)
    slots = torch.tensor([slot(i, p) for i, l in enumerate(prompt_lens) for p in range(l)])
    reshape_and_cache(k, v, key_cache, value_cache, slots)
    out = ref_multi_query_kv_attention(cu_seq_lens, q, k.repeat_interleave(num_queries_per_kv, 1),
                                       v.repeat_interleave(num_queries_per_kv, 1), scale, None, dtype)
    last = torch.stack([out[cu_seq_lens[i + 1] - 1] for i in range(len(prompt_lens))]).flatten(1)[:, :32]

    # decode loop over the paged cache
    alibi_slopes = torch.tensor([2 ** (-8 * (i + 1) / num_query_heads) for i in range(num_query_heads)])
    seq_lens = torch.tensor(prompt_lens, dtype=torch.int)
    for step in range(max_new):
        hq = torch.tanh(last)
        q = (hq @ Wq).view(-1, num_query_heads, head_size)
        k = (hq @ Wk).view(-1, num_kv_heads, head_size)
        v = (hq @ Wv).view(-1, num_kv_heads, head_size)
        slots = torch.tensor([slot(i, int(seq_lens[i])) for i in range(len(prompt_lens))])
        reshape_and_cache(k, v, key_cache, value_cache, slots)
        seq_lens = seq_lens + 1
        output = torch.empty_like(q)
        ref_single_query_cached_kv_attention(output, q, num_queries_per_kv, key_cache, value_cache, block_tables, seq_lens,
                                             scale, alibi_slopes)
        last = output.flatten(1)[:, :32]
    print("decode output norm %.4f" % output.norm().item())
