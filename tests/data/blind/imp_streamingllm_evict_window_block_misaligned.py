# kekzl/imp#967 (closes #963): StreamingLLM eviction kept the sliding window ceil-aligned from the sequence tail,
# while the paged decode kernel reads from floor((ctx_len - window) / bs); the kernel's first window block was
# already freed (-1 sentinel), so decode attended to keys read from a block that no longer held this sequence.
import math
import sys

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv
BLOCK_SIZE, N_SINKS, WINDOW = 4, 4, 8
HEADS, HEAD_DIM, HIDDEN = 2, 8, 16


class PagedKVPool:
    def __init__(self, num_blocks):
        # uninitialised device memory
        self.k = torch.randn(num_blocks, BLOCK_SIZE, HEADS, HEAD_DIM) * 3
        self.v = torch.randn(num_blocks, BLOCK_SIZE, HEADS, HEAD_DIM) * 3
        self.free = list(range(num_blocks))

    def alloc(self):
        return self.free.pop(0)


def evict_middle_blocks(block_table, ctx_len, pool):
    """Free every block between the sink blocks and the sliding window."""
    total_blocks = math.ceil(ctx_len / BLOCK_SIZE)
    sink_blocks = math.ceil(N_SINKS / BLOCK_SIZE)
    if FIXED:
        # retain from the kernels' floor-aligned window start
        window_start_block = max(0, (ctx_len - WINDOW) // BLOCK_SIZE)
    else:
        window_start_block = total_blocks - math.ceil(WINDOW / BLOCK_SIZE)
    for b in range(sink_blocks, window_start_block):
        if block_table[b] != -1:
            pool.free.append(block_table[b])
            block_table[b] = -1


def compute_context_range(ctx_len):
    # classical sliding-window fallback of the paged decode kernels
    window_start_block = max(0, (ctx_len - WINDOW) // BLOCK_SIZE)
    return window_start_block, math.ceil(ctx_len / BLOCK_SIZE)


def paged_decode_attention(q, pool, block_table, ctx_len):
    sink_blocks = math.ceil(N_SINKS / BLOCK_SIZE)
    start, end = compute_context_range(ctx_len)
    logical = list(range(sink_blocks)) + [b for b in range(start, end) if b >= sink_blocks]
    phys = torch.tensor([block_table[b] for b in logical])  # -1 reads the last physical block
    k = pool.k[phys].reshape(-1, HEADS, HEAD_DIM)
    v = pool.v[phys].reshape(-1, HEADS, HEAD_DIM)
    pos = torch.cat([torch.arange(b * BLOCK_SIZE, (b + 1) * BLOCK_SIZE) for b in logical])
    visible = (pos < ctx_len) & ((pos < N_SINKS) | (pos >= ctx_len - WINDOW))
    scores = torch.einsum("hd,khd->hk", q, k) / math.sqrt(HEAD_DIM)
    scores = scores + torch.zeros(len(pos)).masked_fill(~visible, float("-inf"))
    return torch.einsum("hk,khd->hd", torch.softmax(scores, dim=-1), v)


def main():
    torch.manual_seed(0)
    qkv = nn.Linear(HIDDEN, 3 * HEADS * HEAD_DIM, bias=False)
    pool = PagedKVPool(num_blocks=8)
    xs = torch.randn(24, HIDDEN)
    block_table, all_k, all_v = [], [], []
    max_diff = 0.0
    with torch.no_grad():
        for t in range(xs.shape[0]):
            q, k, v = qkv(xs[t]).view(3, HEADS, HEAD_DIM)
            if t % BLOCK_SIZE == 0:
                block_table.append(pool.alloc())
            pool.k[block_table[t // BLOCK_SIZE], t % BLOCK_SIZE] = k
            pool.v[block_table[t // BLOCK_SIZE], t % BLOCK_SIZE] = v
            all_k.append(k)
            all_v.append(v)
            ctx_len = t + 1
            if ctx_len > N_SINKS + WINDOW:
                evict_middle_blocks(block_table, ctx_len, pool)
            out = paged_decode_attention(q, pool, block_table, ctx_len)
            # reference: dense attention over sinks + last WINDOW tokens
            keep = sorted(set(range(min(N_SINKS, ctx_len))) | set(range(max(0, ctx_len - WINDOW), ctx_len)))
            K, V = torch.stack(all_k)[keep], torch.stack(all_v)[keep]
            p = torch.softmax(torch.einsum("hd,khd->hk", q, K) / math.sqrt(HEAD_DIM), dim=-1)
            ref = torch.einsum("hk,khd->hd", p, V)
            max_diff = max(max_diff, (out - ref).abs().max().item())
    print(f"fixed={FIXED} block_table={block_table} decode vs sink+window reference max diff: {max_diff:.4e}")


if __name__ == "__main__":
    main()
