"""transformers continuous batching: sliding-window ring buffer read/write start index off by one.

Citation: huggingface/transformers#47708, "Fix sliding window cache index off-by-one on wraparound"
(merged). I read the PR description and the fixed
transformers/generation/continuous_batching/cache_allocators/sliding_attention.py (installed
5.24); the pre-fix start indices are the ones the PR description quotes. This is a plain-torch
program written after that allocator (block_table of pages, `position % sliding_window` ring slots,
read indices with sentinels for the new tokens, write indices) feeding F.scaled_dot_product_attention.

Bug: SlidingAttentionCacheAllocator used `past_length % sliding_window` as the start of the range it
reads from (and writes to) the rolling buffer. That is the slot of the oldest kept token only once
the buffer holds a full window; right after a short prefill it points at slots that were never
written, and after wrap-around it includes the token that just slid out of the window and drops
the newest cached one. The keys a decode query attends to are therefore the wrong tokens.

Fix: read from `(past_length - cache_length) % sliding_window` (i.e. 0 before the window fills and
`(past_length + 1) % sliding_window` after) and write from `(past_length + padding_length) %
sliding_window`.

Reproduction: sliding_window 8, page size 4, one request: a 5-token prefill, then decode steps up
to past_length 10 (past the wrap-around). Each step gathers K/V through the read indices and runs
SDPA with the bottom-right causal window mask over [cached tokens, new tokens].
"""
import sys

import torch
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


class SlidingAttentionCacheAllocator:
    def __init__(self, sliding_window, tokens_per_page, num_blocks):
        self.sliding_window = sliding_window
        self.tokens_per_page = tokens_per_page
        self.block_physical_stride = tokens_per_page
        self.block_table = {}
        self.free_blocks = list(range(num_blocks))
        self.sentinel_index = num_blocks * tokens_per_page
        self.write_trash_index = num_blocks * tokens_per_page + 1

    def allocate_blocks(self, request_id, past_length, query_length):
        total_length = min(past_length + query_length, self.sliding_window)
        total_blocks = (total_length + self.tokens_per_page - 1) // self.tokens_per_page
        table = self.block_table.setdefault(request_id, [])
        while len(table) < total_blocks:
            table.append(self.free_blocks.pop(0))

    def get_seqlen_k(self, past_length, query_length):
        return query_length + min(past_length, self.sliding_window - 1)

    def _token_indices_to_physical_indices(self, request_id, start_index, length):
        block_table = self.block_table[request_id]
        physical_indices = []
        for token_idx in range(start_index, start_index + length):
            ring_idx = token_idx % self.sliding_window
            page_idx, page_offset = divmod(ring_idx, self.tokens_per_page)
            physical_indices.append(block_table[page_idx] * self.block_physical_stride + page_offset)
        return physical_indices

    def get_read_indices(self, request_id, past_length, query_length):
        cache_length = min(past_length, self.sliding_window - 1)
        if FIXED:
            start_index = (past_length - cache_length) % self.sliding_window
        else:
            start_index = past_length % self.sliding_window
        physical_indices = self._token_indices_to_physical_indices(request_id, start_index, cache_length)
        return physical_indices + [self.sentinel_index] * query_length

    def get_write_indices(self, request_id, past_length, query_length):
        cache_length = min(query_length, self.sliding_window)
        padding_length = query_length - cache_length
        if FIXED:
            start_index = (past_length + padding_length) % self.sliding_window
        else:
            start_index = past_length % self.sliding_window
        physical_indices = self._token_indices_to_physical_indices(request_id, start_index, cache_length)
        return [self.write_trash_index] * padding_length + physical_indices


class PagedAttentionCache:
    def __init__(self, allocator, num_heads, head_dim):
        n_slots = allocator.write_trash_index + 1
        self.allocator = allocator
        self.key_cache = torch.zeros(n_slots, num_heads, head_dim)
        self.value_cache = torch.zeros(n_slots, num_heads, head_dim)

    def update(self, key_states, value_states, read_index, write_index):
        # read the old KV first: the new KV may overwrite it in the ring
        keys = self.key_cache.index_select(0, read_index).clone()
        values = self.value_cache.index_select(0, read_index).clone()
        new = read_index == self.allocator.sentinel_index
        keys[new], values[new] = key_states, value_states
        self.key_cache[write_index] = key_states
        self.value_cache[write_index] = value_states
        return keys, values


def build_attention_mask(seqlen_q, seqlen_k, sliding_window):
    q_pos = torch.arange(seqlen_k - seqlen_q, seqlen_k)[:, None]
    k_pos = torch.arange(seqlen_k)[None, :]
    return (k_pos <= q_pos) & (q_pos - k_pos < sliding_window)


def attention_step(cache, request_id, past_length, hidden, wq, wk, wv, num_heads, sliding_window):
    alloc = cache.allocator
    q_len = hidden.shape[0]
    alloc.allocate_blocks(request_id, past_length, q_len)
    read_index = torch.tensor(alloc.get_read_indices(request_id, past_length, q_len))
    write_index = torch.tensor(alloc.get_write_indices(request_id, past_length, q_len))
    q = (hidden @ wq).view(q_len, num_heads, -1)
    k = (hidden @ wk).view(q_len, num_heads, -1)
    v = (hidden @ wv).view(q_len, num_heads, -1)
    keys, values = cache.update(k, v, read_index, write_index)
    seqlen_k = alloc.get_seqlen_k(past_length, q_len)
    mask = build_attention_mask(q_len, seqlen_k, sliding_window)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1), attn_mask=mask
    )
    return out.transpose(0, 1).reshape(q_len, -1)


def main():
    torch.manual_seed(0)
    sliding_window, page_size, num_heads, hidden_size = 8, 4, 2, 16
    alloc = SlidingAttentionCacheAllocator(sliding_window, page_size, num_blocks=4)
    cache = PagedAttentionCache(alloc, num_heads, hidden_size // num_heads)
    wq, wk, wv = (torch.randn(hidden_size, hidden_size) for _ in range(3))
    tokens = torch.randn(11, hidden_size)
    outs = [attention_step(cache, "req_0", 0, tokens[:5], wq, wk, wv, num_heads, sliding_window)]
    for past_length in range(5, 11):
        outs.append(attention_step(cache, "req_0", past_length, tokens[past_length:past_length + 1], wq, wk, wv, num_heads, sliding_window))
    print("decode output norms:", [round(o.norm().item(), 2) for o in outs[1:]])


if __name__ == "__main__":
    main()
