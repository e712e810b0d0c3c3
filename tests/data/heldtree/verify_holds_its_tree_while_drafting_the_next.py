"""A tree verifier that drafts the next tree from inside verify(): two tree masks on the stack, the nearer one applies.

Written another way (tests/data/heldtree) beside quiet-r133a's OPT-Tree program (tests/data/quiet_blind): `verify`
is handed the tree it just checked (`tree_mask`, 7 nodes), accepts a path, and drafts the next tree (5 nodes) by
calling `draft_tree`, whose `tree_attention` kernel is handed that new tree's `tree_mask` over a cache of the accepted
tokens. Correct: each draft node attends the cache, its ancestors and itself in its own tree. `--leak`: the kernel
builds its draft block as a plain causal triangle instead of the tree it was handed (each node sees every earlier
node), which the tree handed nearest the call contradicts.
"""
import sys

import torch
import torch.nn.functional as F

LEAK = "--leak" in sys.argv
HEADS, DIM = 2, 8


def tree_mask_of(parents):
    """(T, T) bool, node i sees node j where j is i or one of its ancestors."""
    t = len(parents)
    mask = torch.zeros(t, t, dtype=torch.bool)
    for i in range(t):
        j = i
        while j >= 0:
            mask[i, j] = True
            j = parents[j]
    return mask


def tree_attention(q, cache_k, cache_v, k, v, tree_mask):
    """Draft nodes over the cache then the draft keys: the cache whole, the draft block by the tree."""
    t = q.shape[2]
    block = torch.ones(t, t, dtype=torch.bool).tril() if LEAK else tree_mask
    keep = torch.cat([torch.ones(t, cache_k.shape[2], dtype=torch.bool), block], dim=1)
    return F.scaled_dot_product_attention(q, torch.cat([cache_k, k], 2), torch.cat([cache_v, v], 2), attn_mask=keep)


def draft_tree(cache_k, cache_v, parents, tree_mask):
    t = len(parents)
    q, k, v = (torch.randn(1, HEADS, t, DIM) for _ in range(3))
    return tree_attention(q, cache_k, cache_v, k, v, tree_mask)


def verify(cache_k, cache_v, scores, tree_mask, parents):
    """Accept the best root-to-leaf path of the checked tree, then draft the next tree after it."""
    leaf = int(scores.argmax())
    path = []
    while leaf >= 0:
        path.append(leaf)
        leaf = parents[leaf]
    accepted = len(path)
    cache_k = torch.cat([cache_k, torch.randn(1, HEADS, accepted, DIM)], 2)
    cache_v = torch.cat([cache_v, torch.randn(1, HEADS, accepted, DIM)], 2)
    next_parents = [-1, 0, 0, 1, 2]
    return draft_tree(cache_k, cache_v, next_parents, tree_mask_of(next_parents))


def main():
    torch.manual_seed(0)
    cache_k, cache_v = torch.randn(1, HEADS, 6, DIM), torch.randn(1, HEADS, 6, DIM)
    parents = [-1, 0, 0, 1, 1, 2, 3]
    tree_mask = tree_mask_of(parents)
    out = draft_tree(cache_k, cache_v, parents, tree_mask)
    nxt = verify(cache_k, cache_v, out.sum(dim=(0, 1, 3)), tree_mask, parents)
    print("checked tree:", tuple(out.shape), "next tree:", tuple(nxt.shape))


if __name__ == "__main__":
    main()
