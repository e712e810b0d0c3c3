# dmlc/dgl#3267, fixed by dmlc/dgl#3272 ("[bugfix] fix the bug of DotGatConv when compute the edge_softmax").
# dgl.nn.pytorch.conv.DotGatConv (python/dgl/nn/pytorch/conv/dotgatconv.py) scores each edge u->v with
# u_dot_v(ft, ft) and normalises the scores over v's incoming edges with edge_softmax. Before the fix the
# 1/sqrt(out_feats) scale was applied to the *output* of edge_softmax:
#     graph.edata['sa'] = edge_softmax(graph, graph.edata['a']) / (self._out_feats ** 0.5)
# so each node's neighbour weights summed to 1/sqrt(d) instead of 1 and the softmax ran on unscaled logits.
# The fix scales the logits before the softmax:
#     graph.edata['sa'] = edge_softmax(graph, graph.edata['a'] / (self._out_feats ** 0.5))
# DGL is not a dependency here: the graph is kept as (src, dst) edge lists and u_dot_v / edge_softmax /
# update_all(u_mul_e, sum) are written with scatter ops, as DGL's reference (non-fused) semantics define them.
import sys

import torch
from torch import nn

FIXED = "--fixed" in sys.argv


class Graph:
    def __init__(self, src, dst, num_nodes):
        self.src = src
        self.dst = dst
        self.num_nodes = num_nodes
        self.srcdata = {}
        self.dstdata = {}
        self.edata = {}

    def in_degrees(self):
        return torch.bincount(self.dst, minlength=self.num_nodes)


def u_dot_v(graph, lhs, rhs):
    # (E, H, 1), as dgl.function.u_dot_v gives it
    return (graph.srcdata[lhs][graph.src] * graph.dstdata[rhs][graph.dst]).sum(-1, keepdim=True)


def edge_softmax(graph, logits):
    # softmax over the incoming edges of each destination node (dgl.ops.edge_softmax, norm_by='dst')
    idx = graph.dst.view(-1, *([1] * (logits.dim() - 1))).expand_as(logits)
    smax = torch.full((graph.num_nodes,) + logits.shape[1:], float("-inf"), dtype=logits.dtype)
    smax = smax.scatter_reduce(0, idx, logits, reduce="amax", include_self=True)
    out = torch.exp(logits - smax[graph.dst])
    ssum = torch.zeros((graph.num_nodes,) + logits.shape[1:], dtype=logits.dtype).index_add(0, graph.dst, out)
    return out / ssum[graph.dst]


def update_all_u_mul_e_sum(graph, ft, e):
    msg = graph.srcdata[ft][graph.src] * graph.edata[e]
    agg = torch.zeros((graph.num_nodes,) + msg.shape[1:], dtype=msg.dtype)
    return agg.index_add(0, graph.dst, msg)


class DotGatConv(nn.Module):
    def __init__(self, in_feats, out_feats, num_heads, allow_zero_in_degree=False):
        super().__init__()
        self._in_src_feats = self._in_dst_feats = in_feats
        self._out_feats = out_feats
        self._allow_zero_in_degree = allow_zero_in_degree
        self._num_heads = num_heads
        self.fc = nn.Linear(self._in_src_feats, self._out_feats * self._num_heads, bias=False)

    def forward(self, graph, feat, get_attention=False):
        if not self._allow_zero_in_degree:
            if (graph.in_degrees() == 0).any():
                raise RuntimeError("There are 0-in-degree nodes in the graph")

        h_src = feat
        feat_src = feat_dst = self.fc(h_src).view(-1, self._num_heads, self._out_feats)

        # Assign features to nodes
        graph.srcdata.update({"ft": feat_src})
        graph.dstdata.update({"ft": feat_dst})

        # Step 1. dot product
        graph.edata["a"] = u_dot_v(graph, "ft", "ft")

        # Step 2. edge softmax to compute attention scores
        if FIXED:
            graph.edata["sa"] = edge_softmax(graph, graph.edata["a"] / self._out_feats ** 0.5)
        else:
            graph.edata["sa"] = edge_softmax(graph, graph.edata["a"]) / (self._out_feats ** 0.5)

        # Step 3. Broadcast softmax value to each edge, and aggregate dst node
        rst = update_all_u_mul_e_sum(graph, "ft", "sa")

        if get_attention:
            return rst, graph.edata["sa"]
        return rst


class DotGAT(nn.Module):
    # two DotGatConv layers for node classification, heads averaged on the last one
    def __init__(self, in_feats, hidden, num_classes, heads):
        super().__init__()
        self.conv1 = DotGatConv(in_feats, hidden, heads)
        self.conv2 = DotGatConv(hidden * heads, num_classes, 1)

    def forward(self, g, x):
        h = self.conv1(g, x).flatten(1)
        h = torch.relu(h)
        return self.conv2(g, h).mean(1)


def main():
    torch.manual_seed(0)
    num_nodes = 8
    # a small directed graph with self-loops (every node has in-degree >= 1)
    src = torch.tensor([0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 1, 2, 3, 4, 5, 6, 0, 7, 2])
    dst = torch.tensor([0, 1, 2, 3, 4, 5, 6, 7, 1, 2, 0, 3, 2, 5, 4, 7, 6, 3, 5])
    g = Graph(src, dst, num_nodes)

    feat = torch.randn(num_nodes, 6)
    labels = torch.tensor([0, 1, 2, 0, 1, 2, 0, 1])

    model = DotGAT(6, 16, 3, heads=2)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for step in range(20):
        logits = model(g, feat)
        loss = nn.functional.cross_entropy(logits, labels)
        opt.zero_grad()
        loss.backward()
        opt.step()

    model.eval()
    with torch.no_grad():
        _, attn = model.conv1(g, feat, get_attention=True)
        logits = model(g, feat)
    per_node = torch.zeros(num_nodes, attn.shape[1]).index_add(0, g.dst, attn[..., 0])
    print("final loss", round(loss.item(), 4))
    print("attention mass per node (head 0)", [round(v, 4) for v in per_node[:, 0].tolist()])
    print("predictions", logits.argmax(-1).tolist())


if __name__ == "__main__":
    main()
