"""SpecInfer-style verification of a draft tree stated by its parents: the mask walks one hop up, so a node sees its
parent and not its grandparent (--fixed walks to the root)."""
import sys
import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


class Verifier(nn.Module):
    def __init__(self, d=8):
        super().__init__()
        self.emb = nn.Embedding(32, d)
        self.qkv = nn.Linear(d, 3 * d)

    def forward(self, input_ids, past=None, tree_parents=None):
        q, k, v = self.qkv(self.emb(input_ids))[:, None].chunk(3, -1)
        if past is not None:
            k, v = torch.cat([past[0], k], 2), torch.cat([past[1], v], 2)
        n, t = k.shape[2], q.shape[2]
        if tree_parents is None:
            mask = torch.ones(t, n, dtype=torch.bool).tril(n - t)
        else:
            tree = torch.eye(t, dtype=torch.bool)
            for node in range(t):
                p = int(tree_parents[node])
                while p >= 0:
                    tree[node, p] = True
                    p = int(tree_parents[p]) if FIXED else -1
            mask = torch.cat([torch.ones(t, n - t, dtype=torch.bool), tree], 1)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask), (k, v)


torch.manual_seed(0)
m = Verifier()
_, past = m(torch.tensor([[1, 2, 3, 4]]))
parents = torch.tensor([-1, 0, 0, 1, 1, 2, 3])
m(torch.tensor([[5, 6, 7, 8, 9, 10, 11]]), past, tree_parents=parents)
