"""AI-Hypercomputer/maxtext#4298: with context_parallel_load_balance=True the queries are in the
load-balanced (zigzag) order; the Splash causal mask (LoadBalancedCausalMask) reorders its q ids, but
the local sliding-window mask (LocalMask) still used the default query order, so the window was laid
over the wrong rows. Torch rendering: the Splash kernel is a hand-written masked softmax per CP rank."""
import sys

import torch

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)

CP_SIZE = 2
SEQ_LEN = 16
NUM_HEADS = 2
HEAD_DIM = 8
SLIDING_WINDOW_SIZE = 4  # config.sliding_window_size, attention_type="local_sliding"


def reorder_mask_load_balancing(tensor, cp_size, seq_dim):
    """Split the sequence into 2*cp_size chunks; rank r holds chunks r and 2*cp_size-1-r."""
    chunks = tensor.chunk(2 * cp_size, dim=seq_dim)
    order = []
    for r in range(cp_size):
        order += [chunks[r], chunks[2 * cp_size - 1 - r]]
    return torch.cat(order, dim=seq_dim)


class LoadBalancedCausalMask:
    def __init__(self, shape, cp_size):
        q_sequence = reorder_mask_load_balancing(torch.arange(shape[0]), cp_size, 0)
        kv_ids = torch.arange(shape[1])
        self.array = q_sequence[:, None] >= kv_ids[None, :]


class LocalMask:
    def __init__(self, shape, window_size):
        q_ids = torch.arange(shape[0])
        kv_ids = torch.arange(shape[1])
        left, right = window_size
        self.array = (kv_ids[None, :] > q_ids[:, None] - left) & (kv_ids[None, :] <= q_ids[:, None] + right)


class LoadBalancedLocalMask:
    def __init__(self, shape, window_size, cp_size):
        q_ids = reorder_mask_load_balancing(torch.arange(shape[0]), cp_size, 0)
        kv_ids = torch.arange(shape[1])
        left, right = window_size
        self.array = (kv_ids[None, :] > q_ids[:, None] - left) & (kv_ids[None, :] <= q_ids[:, None] + right)


def splash_attention_kernel(query, key, value, mask):
    # query [H, Lq, D], key/value [H, S, D], mask [Lq, S] bool
    scores = query @ key.transpose(-1, -2) / HEAD_DIM ** 0.5
    scores = scores + torch.where(mask, 0.0, -1e10)
    return torch.softmax(scores, dim=-1) @ value


def tpu_flash_attention(query, key, value, context_parallel_load_balance=True):
    """query is in load-balanced order (sharded over cp); key/value are all-gathered in natural order."""
    shape = (query.shape[1], key.shape[1])
    mask = LoadBalancedCausalMask(shape, CP_SIZE).array
    if FIXED:
        mask = mask & LoadBalancedLocalMask(shape, (SLIDING_WINDOW_SIZE, 0), CP_SIZE).array
    else:
        mask = mask & LocalMask(shape, (SLIDING_WINDOW_SIZE, 0)).array
    local_len = shape[0] // CP_SIZE
    outs = []
    for cp_rank in range(CP_SIZE):
        rows = slice(cp_rank * local_len, (cp_rank + 1) * local_len)
        outs.append(splash_attention_kernel(query[:, rows], key, value, mask[rows]))
    return torch.cat(outs, dim=1)


def main():
    q = torch.randn(NUM_HEADS, SEQ_LEN, HEAD_DIM)
    k = torch.randn(NUM_HEADS, SEQ_LEN, HEAD_DIM)
    v = torch.randn(NUM_HEADS, SEQ_LEN, HEAD_DIM)
    q_lb = reorder_mask_load_balancing(q, CP_SIZE, 1)  # inputs reordered for load balancing
    out_lb = tpu_flash_attention(q_lb, k, v)

    # reference without context parallelism: causal sliding window in natural order
    i = torch.arange(SEQ_LEN)
    allowed = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - SLIDING_WINDOW_SIZE)
    ref = splash_attention_kernel(q, k, v, allowed)
    ref_lb = reorder_mask_load_balancing(ref, CP_SIZE, 1)
    diff = (out_lb - ref_lb).abs().max().item()
    print(f"{'fixed' if FIXED else 'buggy'}: max |load-balanced CP local_sliding - reference| = {diff:.4e}")


if __name__ == "__main__":
    main()
