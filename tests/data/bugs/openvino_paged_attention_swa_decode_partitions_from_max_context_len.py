"""OpenVINO GPU paged_attention_opt: sliding-window decode partitions counted from max_context_len.

Citation: openvinotoolkit/openvino#38034, "[GPU] Fix under-counted SDPA partitions for sliding window
decode" (merged). I read the PR description (the host code is update_rt_params() in
intel_gpu/src/graph/impls/ocl_v2/sdpa/paged_attention_opt.cpp, the per-sequence formula in
paged_attention_opt.cl); I did not read the C++/OpenCL diff. This is a torch port of the decode
path as the PR describes it: a batch of sequences in a paged KV cache (block size B = 16), a
sliding window W, one partition per in-window block, partitions beyond num_of_partitions not run.

Bug: num_of_partitions is shared by the whole decode batch but was computed from max_context_len
alone. A sequence's window spans ceil(W/B) blocks when its length is a multiple of B and
ceil(W/B)+1 when it is not, so when the longest sequence is aligned and a shorter one is not, the
shorter one loses its last partition: up to B-1 of its NEWEST tokens drop out of attention.

Fix: use an alignment-independent bound, min(total_blocks, ceil(W/B) + 1).

Reproduction: W = 32, B = 16, two sequences decoding together with context lengths 64 (aligned,
the max) and 41 (window [9, 40] spans 3 blocks). Attention is F.scaled_dot_product_attention over
the K/V gathered from the partitions that run, with the window / valid-length mask.
"""
import math
import sys

import torch
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv

PAGED_ATTENTION_BLOCK_SIZE = 16


def update_rt_params(past_lens, sliding_window):
    """Host side: how many partitions the decode kernel launches for every sequence of the batch."""
    max_context_len = int(past_lens.max()) + 1
    blocks_in_window = math.ceil(sliding_window / PAGED_ATTENTION_BLOCK_SIZE)
    if FIXED:
        total_blocks = math.ceil(max_context_len / PAGED_ATTENTION_BLOCK_SIZE)
        return min(total_blocks, blocks_in_window + 1)
    # per-sequence formula of the kernel, but with max_context_len in place of the sequence's own length
    return blocks_in_window + (1 if max_context_len % PAGED_ATTENTION_BLOCK_SIZE else 0)


def paged_attention_decode(query, key_cache, value_cache, block_indices, block_indices_begins,
                           past_lens, sliding_window, num_of_partitions, scale):
    """Kernel side: one partition per block, starting at the first block that holds an in-window key."""
    outs = []
    for seq in range(query.shape[0]):
        seq_len = int(past_lens[seq]) + 1
        blocks = block_indices[block_indices_begins[seq]:block_indices_begins[seq + 1]]
        window_start = max(0, seq_len - sliding_window)
        first_block = window_start // PAGED_ATTENTION_BLOCK_SIZE
        last_block = (seq_len - 1) // PAGED_ATTENTION_BLOCK_SIZE
        run_blocks = range(first_block, min(last_block + 1, first_block + num_of_partitions))
        keys, values, pos = [], [], []
        for b in run_blocks:
            keys.append(key_cache[blocks[b]])
            values.append(value_cache[blocks[b]])
            pos.append(torch.arange(b * PAGED_ATTENTION_BLOCK_SIZE, (b + 1) * PAGED_ATTENTION_BLOCK_SIZE))
        k = torch.cat(keys)  # [tokens, H, D]
        v = torch.cat(values)
        pos = torch.cat(pos)
        mask = (pos >= window_start) & (pos < seq_len)
        o = F.scaled_dot_product_attention(
            query[seq][:, None], k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask[None, None, :], scale=scale
        )
        outs.append(o[:, 0])
    return torch.stack(outs)


def main():
    torch.manual_seed(0)
    H, D, num_blocks, sliding_window = 2, 8, 12, 32
    key_cache = torch.randn(num_blocks, PAGED_ATTENTION_BLOCK_SIZE, H, D)
    value_cache = torch.randn(num_blocks, PAGED_ATTENTION_BLOCK_SIZE, H, D)
    past_lens = torch.tensor([63, 40])  # context lengths 64 and 41 after this step's token
    block_indices = torch.tensor([3, 7, 0, 9, 5, 1, 11])
    block_indices_begins = torch.tensor([0, 4, 7])
    query = torch.randn(2, H, D)
    num_of_partitions = update_rt_params(past_lens, sliding_window)
    out = paged_attention_decode(query, key_cache, value_cache, block_indices, block_indices_begins,
                                 past_lens, sliding_window, num_of_partitions, scale=D ** -0.5)
    print("partitions:", num_of_partitions, "output norms:", [round(x, 3) for x in out.flatten(1).norm(dim=1).tolist()])


if __name__ == "__main__":
    main()
