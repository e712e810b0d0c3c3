# PaddlePaddle/FastDeploy#3514 (append_attention_c16_impl.cuh, multi_query_append_attention kernel):
# mask_check_iteration = kv_len - q_len + tile_id*num_rows_per_block/GROUP_SIZE, so KV tiles in the causal lower
# triangle are never masked and the speculative tree mask is skipped there (sibling draft tokens leak); fix: kv_len - q_len.
import sys
import torch

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)

NUM_HEADS, HEAD_DIM = 2, 16
GROUP_SIZE = 1                      # q heads per kv head
NUM_ROWS_PER_BLOCK = 4              # query rows handled by one tile_id
KV_TILE = 4                         # NUM_WARP_KV * num_frags_z * 16, shrunk


def sub_if_greater_or_zero(a, b):
    return a - b if a > b else 0


def build_tree_mask(parents):
    # mask[i, j] = 1 if draft token j is i itself or an ancestor of i (FastDeploy tree-mask layout [num_token, num_token])
    n = len(parents)
    m = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        j = i
        while j >= 0:
            m[i, j] = True
            j = parents[j]
    return m


def mask_s(s, q_idx, kv_idx, kv_len, q_len, tree_mask):
    # causal check plus tree check on the speculative block (what the kernel's mask_s does after the PR)
    out = s.clone()
    for a, qi in enumerate(q_idx):
        q_abs = kv_len - q_len + qi
        for b, kj in enumerate(kv_idx):
            masked = kj > q_abs
            if not masked and kj >= kv_len - q_len:
                masked = not bool(tree_mask[qi, kj - (kv_len - q_len)])
            if masked:
                out[:, a, b] = float("-inf")
    return out


def multi_query_append_attention(q, k, v, tree_mask, chunk_start=0):
    # q: [H, q_len, D]; k, v: [H, kv_len, D] (cache prefix followed by the draft tokens just appended)
    q_len, kv_len = q.shape[1], k.shape[1]
    chunk_len = kv_len
    out = torch.empty_like(q)
    num_tiles = (q_len + NUM_ROWS_PER_BLOCK - 1) // NUM_ROWS_PER_BLOCK
    for tile_id in range(num_tiles):
        rows = list(range(tile_id * NUM_ROWS_PER_BLOCK, min(q_len, (tile_id + 1) * NUM_ROWS_PER_BLOCK)))
        if FIXED:
            mask_check_iteration = min(chunk_len, sub_if_greater_or_zero(kv_len - q_len, chunk_start)) // KV_TILE
        else:
            mask_check_iteration = min(chunk_len, sub_if_greater_or_zero(
                kv_len - q_len + tile_id * NUM_ROWS_PER_BLOCK // GROUP_SIZE, chunk_start)) // KV_TILE
        scores = []
        for it in range((kv_len + KV_TILE - 1) // KV_TILE):
            cols = list(range(it * KV_TILE, min(kv_len, (it + 1) * KV_TILE)))
            s = q[:, rows] @ k[:, cols].transpose(-1, -2) / HEAD_DIM ** 0.5
            if it >= mask_check_iteration:
                s = mask_s(s, rows, cols, kv_len, q_len, tree_mask)
            scores.append(s)
        p = torch.softmax(torch.cat(scores, -1), -1)
        out[:, rows] = p @ v
    return out


prefix_len = 8
# draft tree from Medusa/EAGLE style choices: root + 2 children + 2 grandchildren each + ...
parents = [-1, 0, 0, 1, 1, 2, 2, 3]
q_len = len(parents)
tree_mask = build_tree_mask(parents)
q = torch.randn(NUM_HEADS, q_len, HEAD_DIM)
k = torch.randn(NUM_HEADS, prefix_len + q_len, HEAD_DIM)
v = torch.randn(NUM_HEADS, prefix_len + q_len, HEAD_DIM)

out = multi_query_append_attention(q, k, v, tree_mask)

# reference: dense SDPA with [prefix all-visible | tree mask]
full = torch.cat([torch.ones(q_len, prefix_len, dtype=torch.bool), tree_mask], -1)
ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=full)
print(f"max |tiled tree attention - dense tree-mask reference| = {(out - ref).abs().max().item():.6f}")
