"""Medusa/EAGLE-style verification: the tree's depths passed as position_ids after the prompt; the tree mask built
from the depths alone (each node sees every shallower node: its parent's siblings too). --fixed builds it from
retrieve_indices' paths."""
import sys
import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
PATHS = torch.tensor([[0, 1, 3], [0, 1, 4], [0, 2, 5], [0, 2, -1]])  # retrieve_indices: root-to-leaf node paths
DEPTH = torch.tensor([0, 1, 1, 2, 2, 2])


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 24)

    def forward(self, x, mask, cache):
        q, k, v = self.proj(x).view(1, -1, 2, 12).transpose(1, 2).chunk(3, -1)
        if cache:
            k, v = torch.cat([cache[0], k], 2), torch.cat([cache[1], v], 2)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask), (k, v)


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = Block()

    def forward(self, hidden, position_ids, cache=None, tree_mask=None):
        t = hidden.shape[1]
        past = 0 if cache is None else cache[0].shape[2]
        mask = torch.ones(t, past + t, dtype=torch.bool).tril(past)
        if tree_mask is not None:
            mask[:, past:] = tree_mask
        return self.block(hidden, mask, cache)


def tree_mask():
    t = len(DEPTH)
    if not FIXED:
        return (DEPTH[None, :] < DEPTH[:, None]) | torch.eye(t, dtype=torch.bool)
    mask = torch.eye(t, dtype=torch.bool)
    for path in PATHS.tolist():
        path = [n for n in path if n >= 0]
        for i, node in enumerate(path):
            mask[node, path[:i]] = True
    return mask


torch.manual_seed(0)
model = Model()
_, cache = model(torch.randn(1, 5, 8), torch.arange(5)[None])
model(torch.randn(1, 6, 8), (DEPTH + 5)[None], cache, tree_mask())
