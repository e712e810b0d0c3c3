"""Paged KV cache serving step mixing a chunked-prefill sequence and a decoding sequence (varlen batch).

Follows GeeeekExplorer/nano-vllm nanovllm/layers/attention.py (store_kvcache via slot_mapping into a paged
k_cache/v_cache; prefill with cu_seqlens_q / cu_seqlens_k / block_tables, flash_attn_varlen_func(causal=True),
which aligns the causal mask to the bottom-right when seqlen_k > seqlen_q) and nanovllm/engine/block_manager.py
(block_size, block_table of physical block ids, not contiguous). Written with F.scaled_dot_product_attention
per sequence instead of the flash-attn kernel. Mask meant: sequence A's 6-token chunk at context offset 10
sees its 10 cached tokens plus its own chunk causally; sequence B's single decode query sees all its 7
tokens; no sequence ever sees the other's blocks.
"""
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class Context:
    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor


def store_kvcache(key, value, k_cache, v_cache, slot_mapping):
    """key: (N, heads, d); caches: (num_blocks * block_size, heads, d) flattened slots."""
    k_cache[slot_mapping] = key
    v_cache[slot_mapping] = value


def gather_kv(cache, block_table, seqlen_k, block_size):
    slots = (block_table[:, None] * block_size + torch.arange(block_size)[None, :]).flatten()[:seqlen_k]
    return cache[slots]


def varlen_attention(q, k_cache, v_cache, context: Context, block_size):
    outs = []
    for i in range(len(context.cu_seqlens_q) - 1):          # one iteration per sequence in the batch
        q_i = q[context.cu_seqlens_q[i]:context.cu_seqlens_q[i + 1]]
        seqlen_q = q_i.shape[0]
        seqlen_k = int(context.cu_seqlens_k[i + 1] - context.cu_seqlens_k[i])
        k_i = gather_kv(k_cache, context.block_tables[i], seqlen_k, block_size)
        v_i = gather_kv(v_cache, context.block_tables[i], seqlen_k, block_size)
        # causal aligned to the bottom-right corner, as flash_attn_varlen_func(causal=True)
        qpos = torch.arange(seqlen_q)[:, None] + (seqlen_k - seqlen_q)
        mask = torch.arange(seqlen_k)[None, :] <= qpos
        o = F.scaled_dot_product_attention(q_i.transpose(0, 1), k_i.transpose(0, 1), v_i.transpose(0, 1),
                                           attn_mask=mask)
        outs.append(o.transpose(0, 1))
    return torch.cat(outs)


def main():
    torch.manual_seed(0)
    num_heads, head_dim, block_size, num_blocks = 2, 8, 4, 8
    k_cache = torch.zeros(num_blocks * block_size, num_heads, head_dim)
    v_cache = torch.zeros_like(k_cache)
    # earlier steps already filled: A's first 10 tokens in blocks [5, 2, 7]; B's first 6 tokens in blocks [0, 3]
    block_tables = torch.tensor([[5, 2, 7, 1], [0, 3, -1, -1]])

    def slots(table, positions):
        return table[positions // block_size] * block_size + positions % block_size

    prev = [(0, torch.arange(10)), (1, torch.arange(6))]
    for seq, pos in prev:
        store_kvcache(torch.randn(len(pos), num_heads, head_dim), torch.randn(len(pos), num_heads, head_dim),
                      k_cache, v_cache, slots(block_tables[seq], pos))

    # this step: A prefills positions 10..15 (chunk of 6), B decodes position 6
    new_positions = [torch.arange(10, 16), torch.tensor([6])]
    context = Context(
        cu_seqlens_q=torch.tensor([0, 6, 7]),
        cu_seqlens_k=torch.tensor([0, 16, 23]),
        slot_mapping=torch.cat([slots(block_tables[s], p) for s, p in enumerate(new_positions)]),
        block_tables=block_tables,
    )
    q = torch.randn(7, num_heads, head_dim)
    k, v = torch.randn(7, num_heads, head_dim), torch.randn(7, num_heads, head_dim)
    store_kvcache(k, v, k_cache, v_cache, context.slot_mapping)
    o = varlen_attention(q, k_cache, v_cache, context, block_size)
    print("o", tuple(o.shape))


if __name__ == "__main__":
    main()
