"""vllm-project/vllm#30974 ("[Bugfix] Fix incorrect tiles creation for mm prefix triton attention").

vLLM's Triton unified attention backend gained PrefixLM support in #30386: for Gemma 3 style models the
tokens of one image attend each other both ways (``mm_prefix_range`` per request, inclusive [start, end]),
everything else is causal. The mask inside a KV tile was extended with the image ranges, but the number of
KV tiles a query block walks (``max_seq_prefix_len`` -> ``num_tiles``, and ``tile_mask``) was still cut at the
causal prefix of the block, so an image token never reached the image keys that lie in later tiles.
The fix widens ``max_seq_prefix_len`` to ``seq_len`` when ``USE_MM_PREFIX`` is set.

Ported to torch as the 2-D kernel (``kernel_unified_attention_2d``) walks it: one program per (query block,
kv head), a paged KV cache read through ``block_tables``, an online softmax over KV tiles. The tile-bound line
is the one #30974 changed (post-fix code read; pre-fix line reconstructed from the PR description).
"""
import sys
import math

import torch

FIXED = "--fixed" in sys.argv

torch.manual_seed(0)

BLOCK_SIZE = 4  # paged KV cache block size
TILE_SIZE = 4
BLOCK_Q = 2
NUM_QUERY_HEADS = 4
NUM_KV_HEADS = 2
HEAD_SIZE = 8
NUM_QUERIES_PER_KV = NUM_QUERY_HEADS // NUM_KV_HEADS
BLOCK_M = BLOCK_Q * NUM_QUERIES_PER_KV


def cdiv_fn(x, y):
    return (x + y - 1) // y


class TritonAttentionMetadata:
    def __init__(self, query_start_loc, seq_lens, block_table, mm_prefix_range):
        self.query_start_loc = query_start_loc
        self.seq_lens = seq_lens
        self.block_table = block_table
        self.mm_prefix_range = mm_prefix_range  # dict: request index -> list of (start, end)

    @property
    def mm_prefix_range_tensor(self):
        if self.mm_prefix_range is None:
            return None
        num_seqs = self.seq_lens.shape[0]
        max_ranges = max(len(r) for r in self.mm_prefix_range.values())
        t = torch.zeros(num_seqs, max_ranges, 2, dtype=torch.int32)
        for i in range(num_seqs):
            for j, (s, e) in enumerate(self.mm_prefix_range.get(i, [])):
                t[i, j, 0] = s
                t[i, j, 1] = e
        return t


def kernel_unified_attention_2d(
    output, query, key_cache, value_cache, block_tables, seq_lens, scale,
    query_start_len, num_seqs, USE_MM_PREFIX, MAX_MM_RANGES, mm_prefix_range,
    q_block_local_idx, seq_idx, kv_head_idx,
):
    cur_batch_in_all_start_index = int(query_start_len[seq_idx])
    cur_batch_in_all_stop_index = int(query_start_len[seq_idx + 1])
    cur_batch_query_len = cur_batch_in_all_stop_index - cur_batch_in_all_start_index
    if q_block_local_idx * BLOCK_Q >= cur_batch_query_len:
        return

    offs_m = torch.arange(BLOCK_M)
    offs_t = torch.arange(TILE_SIZE)
    query_pos = q_block_local_idx * BLOCK_Q + offs_m // NUM_QUERIES_PER_KV
    query_offset_0 = cur_batch_in_all_start_index + query_pos
    query_offset_1 = kv_head_idx * NUM_QUERIES_PER_KV + offs_m % NUM_QUERIES_PER_KV
    query_mask_0 = query_pos < cur_batch_query_len
    query_mask_1 = query_offset_1 < NUM_QUERY_HEADS

    Q = torch.zeros(BLOCK_M, HEAD_SIZE)
    ok = query_mask_0 & query_mask_1
    Q[ok] = query[query_offset_0[ok], query_offset_1[ok]]

    M = torch.full((BLOCK_M,), float("-inf"))
    L = torch.ones(BLOCK_M)
    acc = torch.zeros(BLOCK_M, HEAD_SIZE)

    seq_len = int(seq_lens[seq_idx])
    context_len = seq_len - cur_batch_query_len

    # compute the length of the longest sequence prefix spanned by any
    # query token in the current q_block (q_block_local_idx)
    max_seq_prefix_len = (
        context_len + q_block_local_idx * BLOCK_Q + (BLOCK_M - 1) // NUM_QUERIES_PER_KV + 1
    )
    if FIXED and USE_MM_PREFIX:
        # image bidirectional attention ranges require a full range
        max_seq_prefix_len = max(max_seq_prefix_len, seq_len)
    else:
        # adjust for potential padding in the last q_block
        max_seq_prefix_len = min(max_seq_prefix_len, seq_len)

    # tiles beyond this prefix are skipped (causal masking)
    num_tiles = cdiv_fn(max_seq_prefix_len, TILE_SIZE)

    for j in range(0, num_tiles):
        seq_offset = j * TILE_SIZE + offs_t
        tile_mask = seq_offset < max_seq_prefix_len
        safe = torch.where(seq_offset < block_tables.shape[1] * BLOCK_SIZE, seq_offset, 0)
        physical_block_idx = block_tables[seq_idx, safe // BLOCK_SIZE].long()
        K = key_cache[physical_block_idx, safe % BLOCK_SIZE, kv_head_idx]  # (TILE, D)
        V = value_cache[physical_block_idx, safe % BLOCK_SIZE, kv_head_idx]
        K = torch.where(tile_mask[:, None], K, torch.zeros_like(K))
        V = torch.where(tile_mask[:, None], V, torch.zeros_like(V))

        query_abs_pos = context_len + query_pos[:, None]
        seq_mask = seq_offset[None, :] <= query_abs_pos

        if USE_MM_PREFIX:
            for i in range(MAX_MM_RANGES):
                range_start = int(mm_prefix_range[seq_idx, i, 0])
                range_end = int(mm_prefix_range[seq_idx, i, 1])
                is_valid = range_start < range_end
                q_in_range = (query_abs_pos >= range_start) & (query_abs_pos <= range_end) & is_valid
                k_in_range = (seq_offset[None, :] >= range_start) & (seq_offset[None, :] <= range_end) & is_valid
                seq_mask = seq_mask | (q_in_range & k_in_range)

        S = scale * (Q @ K.T)
        S = torch.where(query_mask_1[:, None] & query_mask_0[:, None] & seq_mask, S, float("-inf"))

        m_j = torch.maximum(M, S.max(dim=1).values)
        m_j = torch.where(m_j > float("-inf"), m_j, torch.zeros_like(m_j))
        P = torch.exp(S - m_j[:, None])
        l_j = P.sum(dim=1)
        alpha = torch.exp(M - m_j)
        acc = acc * alpha[:, None]
        L = L * alpha + l_j
        M = m_j
        acc = acc + P @ V

    acc = acc / L[:, None]
    output[query_offset_0[ok], query_offset_1[ok]] = acc[ok]


def unified_attention(q, k_cache, v_cache, out, metadata, softmax_scale):
    mm_prefix_range_tensor = metadata.mm_prefix_range_tensor
    use_mm_prefix = mm_prefix_range_tensor is not None
    max_mm_ranges = mm_prefix_range_tensor.shape[1] if use_mm_prefix else 0
    num_seqs = metadata.seq_lens.shape[0]
    for seq_idx in range(num_seqs):
        qlen = int(metadata.query_start_loc[seq_idx + 1] - metadata.query_start_loc[seq_idx])
        for q_block_local_idx in range(cdiv_fn(qlen, BLOCK_Q)):
            for kv_head_idx in range(NUM_KV_HEADS):
                kernel_unified_attention_2d(
                    out, q, k_cache, v_cache, metadata.block_table, metadata.seq_lens, softmax_scale,
                    metadata.query_start_loc, num_seqs, use_mm_prefix, max_mm_ranges,
                    mm_prefix_range_tensor, q_block_local_idx, seq_idx, kv_head_idx,
                )
    return out


# Two Gemma-3-style prompts prefilled together: <bos> text, then image soft tokens, then text.
seq_lens = torch.tensor([12, 10], dtype=torch.int32)
query_start_loc = torch.tensor([0, 12, 22], dtype=torch.int32)
mm_prefix_range = {0: [(2, 8)], 1: [(1, 6)]}  # inclusive image spans

num_blocks = 8
block_table = torch.tensor([[3, 0, 5], [1, 6, 2]], dtype=torch.int32)
key_cache = torch.zeros(num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE)
value_cache = torch.zeros(num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE)

num_tokens = int(query_start_loc[-1])
query = torch.randn(num_tokens, NUM_QUERY_HEADS, HEAD_SIZE)
key = torch.randn(num_tokens, NUM_KV_HEADS, HEAD_SIZE)
value = torch.randn(num_tokens, NUM_KV_HEADS, HEAD_SIZE)

# reshape_and_cache: write the new keys/values into their slots
slot_mapping = []
for s in range(2):
    for pos in range(int(seq_lens[s])):
        slot_mapping.append(int(block_table[s, pos // BLOCK_SIZE]) * BLOCK_SIZE + pos % BLOCK_SIZE)
slot_mapping = torch.tensor(slot_mapping)
key_cache.view(-1, NUM_KV_HEADS, HEAD_SIZE)[slot_mapping] = key
value_cache.view(-1, NUM_KV_HEADS, HEAD_SIZE)[slot_mapping] = value

metadata = TritonAttentionMetadata(query_start_loc, seq_lens, block_table, mm_prefix_range)
out = torch.zeros_like(query)
unified_attention(query, key_cache, value_cache, out, metadata, 1.0 / math.sqrt(HEAD_SIZE))

for s in range(2):
    a, b = int(query_start_loc[s]), int(query_start_loc[s + 1])
    print(f"request {s}: attention output norm per token", [round(x, 4) for x in out[a:b].norm(dim=(1, 2)).tolist()])
