"""Graph attention over a PyG-style mini-batch, as torch_geometric's TransformerConv computes it.

Follows pyg-team/pytorch_geometric torch_geometric/nn/conv/transformer_conv.py (TransformerConv.message) and
torch_geometric/utils/softmax.py (softmax over `index` with scatter max / sum). Several graphs are concatenated
into one node set with a `batch` vector and their edge_index offset by the graph's first node (as
`Batch.from_data_list` does). Each node i attends over its in-neighbours j (edges j -> i, self loops added), so the
mask is the block-diagonal adjacency: no edge crosses graphs, not every pair inside a graph is an edge.
Attention dropout is applied to alpha as in the project (eval here, so identity).
"""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F


def scatter_softmax(src, index, num_nodes):
    """PyG utils.softmax: normalise src over entries that share `index` (the target node)."""
    src_max = torch.full((num_nodes,) + src.shape[1:], float("-inf"))
    src_max = src_max.scatter_reduce(0, index.view(-1, 1).expand_as(src), src, reduce="amax", include_self=True)
    out = (src - src_max.index_select(0, index)).exp()
    out_sum = torch.zeros((num_nodes,) + src.shape[1:]).index_add_(0, index, out) + 1e-16
    return out / out_sum.index_select(0, index)


class TransformerConv(nn.Module):
    def __init__(self, in_channels, out_channels, heads=1, dropout=0.0, root_weight=True):
        super().__init__()
        self.out_channels, self.heads, self.dropout = out_channels, heads, dropout
        self.lin_key = nn.Linear(in_channels, heads * out_channels)
        self.lin_query = nn.Linear(in_channels, heads * out_channels)
        self.lin_value = nn.Linear(in_channels, heads * out_channels)
        self.lin_skip = nn.Linear(in_channels, heads * out_channels) if root_weight else None
        self._alpha = None

    def forward(self, x, edge_index, return_attention_weights=False):
        H, C = self.heads, self.out_channels
        query = self.lin_query(x).view(-1, H, C)
        key = self.lin_key(x).view(-1, H, C)
        value = self.lin_value(x).view(-1, H, C)
        src, dst = edge_index  # flow source_to_target: messages j -> i, i = dst
        alpha = (query[dst] * key[src]).sum(dim=-1) / math.sqrt(C)
        alpha = scatter_softmax(alpha, dst, x.size(0))
        self._alpha = alpha
        alpha = F.dropout(alpha, p=self.dropout, training=self.training)
        msg = value[src] * alpha.view(-1, H, 1)
        out = torch.zeros(x.size(0), H, C).index_add_(0, dst, msg).view(-1, H * C)
        if self.lin_skip is not None:
            out = out + self.lin_skip(x)
        return (out, (edge_index, self._alpha)) if return_attention_weights else out


def ring_with_chord(n):
    src = list(range(n)) + [(i + 1) % n for i in range(n)]
    dst = [(i + 1) % n for i in range(n)] + list(range(n))
    if n >= 4:
        src, dst = src + [0], dst + [n // 2]
    return torch.tensor([src, dst])


def collate(graphs):
    """Batch.from_data_list: concatenate nodes, offset edge indices, record the batch vector."""
    xs, eis, batch, offset = [], [], [], 0
    for g, (x, ei) in enumerate(graphs):
        xs.append(x)
        eis.append(ei + offset)
        batch.append(torch.full((x.size(0),), g))
        offset += x.size(0)
    return torch.cat(xs), torch.cat(eis, dim=1), torch.cat(batch)


def main():
    torch.manual_seed(0)
    sizes = [5, 3, 7]
    graphs = [(torch.randn(n, 16), ring_with_chord(n)) for n in sizes]
    x, edge_index, batch = collate(graphs)
    loops = torch.arange(x.size(0)).repeat(2, 1)  # add_self_loops
    edge_index = torch.cat([edge_index, loops], dim=1)
    conv = TransformerConv(16, 8, heads=2, dropout=0.1).eval()
    with torch.no_grad():
        out, (ei, alpha) = conv(x, edge_index, return_attention_weights=True)
        # dense reference per graph: softmax(q k^T) restricted to the adjacency (j -> i)
        q = conv.lin_query(x).view(-1, 2, 8)
        k = conv.lin_key(x).view(-1, 2, 8)
        v = conv.lin_value(x).view(-1, 2, 8)
        for g in range(len(sizes)):
            nodes = (batch == g).nonzero().flatten()
            lo, n = int(nodes[0]), len(nodes)
            adj = torch.zeros(n, n, dtype=torch.bool)
            sel = (batch[ei[1]] == g)
            adj[ei[1][sel] - lo, ei[0][sel] - lo] = True
            for h in range(2):
                s = q[nodes, h].mm(k[nodes, h].t()) / math.sqrt(8)
                w = s.masked_fill(~adj, float("-inf")).softmax(-1)
                ref = w.mm(v[nodes, h]) + conv.lin_skip(x[nodes]).view(-1, 2, 8)[:, h]
                assert torch.allclose(out.view(-1, 2, 8)[nodes, h], ref, atol=1e-5)
    assert (batch[edge_index[0]] == batch[edge_index[1]]).all()
    print(f"nodes {x.size(0)} edges {edge_index.size(1)} out {tuple(out.shape)}")


if __name__ == "__main__":
    main()
