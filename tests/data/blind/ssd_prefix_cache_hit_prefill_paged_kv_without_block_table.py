"""ssd (nano-vllm based engine): a prefix-cache-hit prefill reads the paged K/V cache without its block table.

Citation: tanishqkumar/ssd#23 (issue) and tanishqkumar/ssd#22 (the fix PR, open, not merged), "[Bug]
prefix-cache-hit prefill reads wrong KV rows". I read the issue and PR descriptions, not the diff;
the layer below follows nano-vllm's Attention.forward (store_kvcache with slot_mapping, then on a
prefix-cache hit `k, v = k_cache, v_cache` for flash_attn_varlen_func), with torch references for
the two flash-attn entry points (varlen over ragged rows; with_kvcache over a block table).

Bug: when a prefill batch contains a prefix-cache hit, the layer substitutes the whole per-layer
paged K/V cache tensors for the fresh k/v but does not pass the block table to the kernel, which
then treats the paged cache as contiguous memory indexed by cu_seqlens_k and reads the wrong
physical rows: every prefill query attends to other blocks' keys.

Fix (the PR): call flash_attn_with_kvcache with block_table and cache_seqlens so the kernel reads
each sequence's own pages.

Reproduction: block size 4; sequence 0 reuses an 8-token cached prefix (physical blocks 5, 2) and
prefills 3 new tokens (block 7); sequence 1 prefills 5 tokens (blocks 0, 3). Both kernels' causal
mask is bottom-right aligned; attention is F.scaled_dot_product_attention per sequence.
"""
import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


@dataclass
class Context:
    is_prefill: bool
    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int
    slot_mapping: torch.Tensor
    context_lens: torch.Tensor
    block_tables: torch.Tensor | None


def _causal_bottom_right(q_len, k_len):
    q_pos = torch.arange(k_len - q_len, k_len)[:, None]
    return torch.arange(k_len)[None, :] <= q_pos


def flash_attn_varlen_func(q, k, v, max_seqlen_q, cu_seqlens_q, max_seqlen_k, cu_seqlens_k,
                           softmax_scale=None, causal=False, block_table=None):
    """Reference: ragged q/k/v rows; k and v are read as contiguous rows unless a block_table is given."""
    k_rows = k.reshape(-1, *k.shape[-2:])
    v_rows = v.reshape(-1, *v.shape[-2:])
    outs = []
    for i in range(cu_seqlens_q.numel() - 1):
        q_i = q[cu_seqlens_q[i]:cu_seqlens_q[i + 1]]
        if block_table is None:
            k_i = k_rows[cu_seqlens_k[i]:cu_seqlens_k[i + 1]]
            v_i = v_rows[cu_seqlens_k[i]:cu_seqlens_k[i + 1]]
        else:
            block_size = k.shape[1]
            pos = torch.arange(int(cu_seqlens_k[i + 1] - cu_seqlens_k[i]))
            slots = block_table[i, pos // block_size] * block_size + pos % block_size
            k_i, v_i = k_rows[slots], v_rows[slots]
        mask = _causal_bottom_right(q_i.shape[0], k_i.shape[0]) if causal else None
        o = F.scaled_dot_product_attention(q_i.transpose(0, 1), k_i.transpose(0, 1), v_i.transpose(0, 1),
                                           attn_mask=mask, scale=softmax_scale)
        outs.append(o.transpose(0, 1))
    return torch.cat(outs)


def flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens, block_table, cu_seqlens_q,
                            softmax_scale=None, causal=False):
    """Reference: queries of each sequence attend to its own pages of the cache."""
    cu_k = torch.nn.functional.pad(torch.cumsum(cache_seqlens, 0), (1, 0))
    return flash_attn_varlen_func(q, k_cache, v_cache, 0, cu_seqlens_q, 0, cu_k,
                                  softmax_scale=softmax_scale, causal=causal, block_table=block_table)


def store_kvcache(key, value, k_cache, v_cache, slot_mapping):
    k_cache.view(-1, *k_cache.shape[-2:])[slot_mapping] = key
    v_cache.view(-1, *v_cache.shape[-2:])[slot_mapping] = value


class Attention(torch.nn.Module):
    def __init__(self, num_heads, head_dim, scale, k_cache, v_cache):
        super().__init__()
        self.num_heads, self.head_dim, self.scale = num_heads, head_dim, scale
        self.k_cache, self.v_cache = k_cache, v_cache

    def forward(self, q, k, v, context):
        k_cache, v_cache = self.k_cache, self.v_cache
        store_kvcache(k, v, k_cache, v_cache, context.slot_mapping)
        if context.block_tables is not None:  # prefix cache hit
            if FIXED:
                return flash_attn_with_kvcache(q, k_cache, v_cache, context.context_lens, context.block_tables,
                                               context.cu_seqlens_q, softmax_scale=self.scale, causal=True)
            k, v = k_cache, v_cache
        return flash_attn_varlen_func(q, k, v, max_seqlen_q=context.max_seqlen_q, cu_seqlens_q=context.cu_seqlens_q,
                                      max_seqlen_k=context.max_seqlen_k, cu_seqlens_k=context.cu_seqlens_k,
                                      softmax_scale=self.scale, causal=True)


def main():
    torch.manual_seed(0)
    H, D, block_size, num_blocks = 2, 8, 4, 8
    k_cache = torch.randn(num_blocks, block_size, H, D)
    v_cache = torch.randn(num_blocks, block_size, H, D)
    block_tables = torch.tensor([[5, 2, 7], [0, 3, -1]])
    # sequence 0: 8 cached tokens + 3 new (positions 8..10); sequence 1: 5 new tokens
    new_pos = [torch.arange(8, 11), torch.arange(0, 5)]
    slot_mapping = torch.cat([block_tables[i, p // block_size] * block_size + p % block_size for i, p in enumerate(new_pos)])
    context = Context(
        is_prefill=True,
        cu_seqlens_q=torch.tensor([0, 3, 8]),
        cu_seqlens_k=torch.tensor([0, 11, 16]),
        max_seqlen_q=5,
        max_seqlen_k=11,
        slot_mapping=slot_mapping,
        context_lens=torch.tensor([11, 5]),
        block_tables=block_tables,
    )
    attn = Attention(H, D, D ** -0.5, k_cache, v_cache)
    q, k, v = torch.randn(8, H, D), torch.randn(8, H, D), torch.randn(8, H, D)
    out = attn(q, k, v, context)
    print("prefill output norms:", [round(x, 3) for x in out.flatten(1).norm(dim=1).tolist()])


if __name__ == "__main__":
    main()
