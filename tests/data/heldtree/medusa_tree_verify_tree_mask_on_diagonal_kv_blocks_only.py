# The FastDeploy#3514 bug (a blockwise verify kernel that skips the speculative tree mask on KV blocks below the query
# block's causal diagonal) written as a Medusa-style tree verification step: a (B, H, L, D) batch of two sequences,
# row 1's prompt left-padded by 3 tokens, 8 draft nodes appended to a 6-token cache, queries in blocks of 4 over keys in
# blocks of 4 (not aligned with the draft's start). The buggy kernel applies `spec_tree_mask` only to the KV blocks that
# overlap the query block's own columns; the fix applies it to every KV block holding draft keys.
import sys
import torch

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)
B, H, D = 2, 2, 8
BLOCK_M, BLOCK_N = 4, 4
PREFIX = 6
PARENTS = [-1, 0, 0, 1, 2, 1, 3, 4]          # Medusa choices flattened: node -> parent
T = len(PARENTS)


def tree_from_parents(parents):
    mask = torch.zeros(len(parents), len(parents))
    for i in range(len(parents)):
        j = i
        while j >= 0:
            mask[i, j] = 1.0
            j = parents[j]
    return mask                                # float 0/1, 1 = visible (Medusa's medusa_attn_mask convention)


def verify_attention(q, k, v, spec_tree_mask, key_padding):
    # q: (B, H, T, D) draft queries; k, v: (B, H, PREFIX + T, D); key_padding: (B, PREFIX + T) True = pad
    n_keys = k.shape[2]
    out = torch.empty_like(q)
    for m0 in range(0, T, BLOCK_M):
        rows = torch.arange(m0, min(T, m0 + BLOCK_M))
        q_abs = PREFIX + rows                                   # the queries' key columns
        s = q[:, :, rows] @ k.transpose(-1, -2) / D ** 0.5      # (B, H, M, n_keys)
        s = s.masked_fill(key_padding[:, None, None, :], float("-inf"))
        cols = torch.arange(n_keys)
        s = s.masked_fill(cols[None, :] > q_abs[:, None], float("-inf"))   # causal
        for n0 in range(0, n_keys, BLOCK_N):
            block = cols[n0:n0 + BLOCK_N]
            if not FIXED and not (block.max() >= q_abs.min()):
                continue                                        # "below the diagonal": tree mask skipped
            draft = block[block >= PREFIX]
            if draft.numel() == 0:
                continue
            hidden = spec_tree_mask[rows][:, draft - PREFIX] == 0
            s[..., draft] = s[..., draft].masked_fill(hidden, float("-inf"))
        out[:, :, rows] = torch.softmax(s, dim=-1) @ v
    return out


tree = tree_from_parents(PARENTS)
q = torch.randn(B, H, T, D)
k = torch.randn(B, H, PREFIX + T, D)
v = torch.randn(B, H, PREFIX + T, D)
key_padding = torch.zeros(B, PREFIX + T, dtype=torch.bool)
key_padding[1, :3] = True                                       # row 1's prompt left-padded
out = verify_attention(q, k, v, tree, key_padding)

# reference: one dense SDPA call per row with [real prefix | tree] as its boolean mask
worst = 0.0
for b in range(B):
    real = ~key_padding[b]
    full = torch.cat([torch.ones(T, PREFIX, dtype=torch.bool), tree.bool()], dim=-1) & real[None]
    ref = torch.nn.functional.scaled_dot_product_attention(q[b], k[b], v[b], attn_mask=full)
    worst = max(worst, (out[b] - ref).abs().max().item())
print(f"max |blockwise tree verify - dense reference| = {worst:.6f}")
