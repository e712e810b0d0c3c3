"""graphormer-pyg: the per-graph batch mask multiplies the scores, so nodes attend across graphs.

Citation: leffff/graphormer-pyg issue #14 "softmax in GraphormerAttentionHead" (closed), fixed in
commit f56d6487f05ffc105a0f977b303ce596338a23fc "Fixed attention bug".

Bug: `GraphormerAttentionHead.forward` works on a PyG mini-batch flattened to one node axis, with
`ptr` giving each graph's node range. It built a 0/1 `batch_mask` (1 inside each graph's block) and
computed `a = (a + b + c) * batch_mask; softmax = torch.softmax(a, dim=-1)`. Multiplying sets the
cross-graph scores to 0, not to a large negative number, so after the softmax every node still puts
weight exp(0)/Z on every node of the other graphs in the batch.

Fix (f56d6487): a second mask `batch_mask_neg_inf` (-1e6 across graphs, 1 inside) multiplies the
scores, and the softmax output is multiplied by the 0/1 `batch_mask_zeros`, so the cross-graph weights
are zeroed.

This program: a batch of two small graphs (3 and 4 nodes) given as node features plus `ptr`, one
attention head with the upstream `q`/`k`/`v` linears and a spatial-encoding bias `b` (shortest-path
distances embedded per graph, 0 across graphs). The edge encoding `c` is reduced to zeros (its path
loop does not touch the mask). The pre-fix and fixed bodies of `forward` are copied in structure from
the upstream file at f56d6487^ and f56d6487; `CentralityEncoding`/`SpatialEncoding` are simplified.
"""
import sys

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv


class GraphormerAttentionHead(nn.Module):
    def __init__(self, dim_in: int, dim_q: int, dim_k: int):
        super().__init__()
        self.q = nn.Linear(dim_in, dim_q)
        self.k = nn.Linear(dim_in, dim_k)
        self.v = nn.Linear(dim_in, dim_k)

    def forward(self, query, key, value, b, ptr=None):
        """
        :param b: spatial encoding matrix (num_nodes x num_nodes)
        :param ptr: batch pointer that shows graph indexes in batch of graphs
        """
        device = next(self.parameters()).device
        if FIXED:
            batch_mask_neg_inf = torch.full(size=(query.shape[0], query.shape[0]), fill_value=-1e6).to(device)
            batch_mask_zeros = torch.zeros(size=(query.shape[0], query.shape[0])).to(device)
            if ptr is None:
                batch_mask_neg_inf = torch.ones(size=(query.shape[0], query.shape[0])).to(device)
                batch_mask_zeros += 1
            else:
                for i in range(len(ptr) - 1):
                    batch_mask_neg_inf[ptr[i]:ptr[i + 1], ptr[i]:ptr[i + 1]] = 1
                    batch_mask_zeros[ptr[i]:ptr[i + 1], ptr[i]:ptr[i + 1]] = 1
        else:
            batch_mask = torch.zeros((query.shape[0], query.shape[0])).to(device)
            if ptr is None:
                batch_mask += 1
            else:
                for i in range(len(ptr) - 1):
                    batch_mask[ptr[i]:ptr[i + 1], ptr[i]:ptr[i + 1]] = 1

        query = self.q(query)
        key = self.k(key)
        value = self.v(value)

        c = torch.zeros_like(b)  # edge encoding (path-averaged edge features), omitted here
        a = query.mm(key.transpose(0, 1)) / query.size(-1) ** 0.5
        if FIXED:
            a = (a + b + c) * batch_mask_neg_inf
            softmax = torch.softmax(a, dim=-1) * batch_mask_zeros
        else:
            a = (a + b + c) * batch_mask
            softmax = torch.softmax(a, dim=-1)
        x = softmax.mm(value)
        return x, softmax


def spatial_encoding(num_nodes_per_graph, dists, b_weights):
    """Per-graph shortest-path distances embedded as a scalar bias; 0 between graphs."""
    n = sum(num_nodes_per_graph)
    b = torch.zeros(n, n)
    start = 0
    for g, k in enumerate(num_nodes_per_graph):
        b[start:start + k, start:start + k] = b_weights[dists[g]]
        start += k
    return b


def main():
    torch.manual_seed(0)
    # two path graphs: 0-1-2 and 3-4-5-6 (PyG Batch: x, ptr)
    num_nodes = [3, 4]
    ptr = torch.tensor([0, 3, 7])
    x = torch.randn(7, 16)
    d0 = torch.tensor([[0, 1, 2], [1, 0, 1], [2, 1, 0]])
    d1 = (torch.arange(4)[:, None] - torch.arange(4)[None, :]).abs()
    b_weights = torch.randn(5)
    b = spatial_encoding(num_nodes, [d0, d1], b_weights)
    head = GraphormerAttentionHead(16, 8, 8).eval()
    with torch.no_grad():
        out, weights = head(x, x, x, b, ptr)
    cross = weights[:3, 3:].sum().item() + weights[3:, :3].sum().item()
    print("fixed" if FIXED else "buggy", "attention weight across graphs", round(cross, 4))


if __name__ == "__main__":
    main()
