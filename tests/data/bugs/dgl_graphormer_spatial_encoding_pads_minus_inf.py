"""DGL Graphormer: SpatialEncoder pads its attention bias with -inf, so padded nodes' rows are fully masked (dgl#5476).

Citation: dmlc/dgl#5476 ("Padded Tensor should not be full '-inf' In Spatial Encoder for
Graphormer", labelled bug:confirmed), fixed in dmlc/dgl#5100 ("[NN] Refactor the Code Structure
of GT": "Fix the attention nan value pollution issue caused by all -inf values in a row of
attn_bias (#5476) - attn_bias by SpatialEncoder or PathEncoder will be padded with zeros - add
a note for attn_mask in BiasedMHA to avoid all positions in a row masked"). The buggy lines are
quoted in #5476; BiasedMultiheadAttention / GraphormerLayer are as in
python/dgl/nn/pytorch/graph_transformer.py of that time (read from the stored file).

Bug: for a batch of graphs padded to ``max_num_nodes``, ``SpatialEncoder`` filled the
(N, N, heads) bias with ``-inf`` outside each graph's own block. Used as ``attn_bias`` of
``GraphormerLayer`` it masks the padded keys, but also every key of a padded node's query row,
whose softmax is then NaN; in the next layer the real nodes attend over those NaN keys and
values and the whole batch row turns to NaN.

Fix: pad the spatial encoding with zeros and mask the padded keys with BiasedMHA's
``attn_mask`` (non-zero = invalid, only key columns), as DGL's Graphormer example does.

Reproduction: two graphs (5 and 3 nodes) batched to 5 nodes, shortest-path distances computed
by BFS (dgl.shortest_dist), the SpatialEncoder embedding, two GraphormerLayers. Plain torch:
DGL's graph batching is replaced by lists of edges. The query scaling uses ``* self.scaling``
(the same PR fixed a separate ``/ self.scaling`` bug), so only the mask differs.
"""
import sys
from collections import deque

import torch as th
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


def shortest_dist(num_nodes, edges):
    """All-pairs hop distance, -1 where unreachable (what dgl.shortest_dist returns)."""
    adj = [[] for _ in range(num_nodes)]
    for u, v in edges:
        adj[u].append(v)
    dist = th.full((num_nodes, num_nodes), -1, dtype=th.long)
    for s in range(num_nodes):
        dist[s, s] = 0
        q = deque([s])
        while q:
            u = q.popleft()
            for v in adj[u]:
                if dist[s, v] < 0:
                    dist[s, v] = dist[s, u] + 1
                    q.append(v)
    return dist


class SpatialEncoder(nn.Module):
    def __init__(self, max_dist, num_heads=1):
        super().__init__()
        self.max_dist = max_dist
        self.num_heads = num_heads
        # deactivate node pair between which the distance is -1
        self.embedding_table = nn.Embedding(max_dist + 2, num_heads, padding_idx=0)

    def forward(self, graphs):
        max_num_nodes = max(n for n, _ in graphs)
        spatial_encoding = []
        for num_nodes, edges in graphs:
            dist = th.clamp(shortest_dist(num_nodes, edges), min=-1, max=self.max_dist)
            # shift by 1 since -1 is the padding index
            dist_embedding = self.embedding_table(dist + 1)
            if FIXED:
                padded_encoding = th.zeros(max_num_nodes, max_num_nodes, self.num_heads)
            else:
                padded_encoding = th.full((max_num_nodes, max_num_nodes, self.num_heads), float("-inf"))
            padded_encoding[0:num_nodes, 0:num_nodes] = dist_embedding
            spatial_encoding.append(padded_encoding)
        return th.stack(spatial_encoding, dim=0)


class BiasedMultiheadAttention(nn.Module):
    def __init__(self, feat_size, num_heads, bias=True, attn_bias_type="add", attn_drop=0.1):
        super().__init__()
        self.feat_size = feat_size
        self.num_heads = num_heads
        self.head_dim = feat_size // num_heads
        self.scaling = self.head_dim ** -0.5
        self.attn_bias_type = attn_bias_type
        self.q_proj = nn.Linear(feat_size, feat_size, bias=bias)
        self.k_proj = nn.Linear(feat_size, feat_size, bias=bias)
        self.v_proj = nn.Linear(feat_size, feat_size, bias=bias)
        self.out_proj = nn.Linear(feat_size, feat_size, bias=bias)
        self.dropout = nn.Dropout(p=attn_drop)

    def forward(self, ndata, attn_bias=None, attn_mask=None):
        q_h = self.q_proj(ndata).transpose(0, 1)
        k_h = self.k_proj(ndata).transpose(0, 1)
        v_h = self.v_proj(ndata).transpose(0, 1)
        bsz, N, _ = ndata.shape
        q_h = q_h.reshape(N, bsz * self.num_heads, self.head_dim).transpose(0, 1) * self.scaling
        k_h = k_h.reshape(N, bsz * self.num_heads, self.head_dim).permute(1, 2, 0)
        v_h = v_h.reshape(N, bsz * self.num_heads, self.head_dim).transpose(0, 1)

        attn_weights = (th.bmm(q_h, k_h).transpose(0, 2).reshape(N, N, bsz, self.num_heads).transpose(0, 2))
        if attn_bias is not None:
            if self.attn_bias_type == "add":
                attn_weights += attn_bias
            else:
                attn_weights *= attn_bias
        if attn_mask is not None:
            attn_weights[attn_mask.to(th.bool)] = float("-inf")

        attn_weights = F.softmax(attn_weights.transpose(0, 2).reshape(N, N, bsz * self.num_heads).transpose(0, 2), dim=2)
        attn_weights = self.dropout(attn_weights)
        attn = th.bmm(attn_weights, v_h).transpose(0, 1)
        return self.out_proj(attn.reshape(N, bsz, self.feat_size).transpose(0, 1))


class GraphormerLayer(nn.Module):
    def __init__(self, feat_size, hidden_size, num_heads, attn_bias_type="add", norm_first=False, dropout=0.1,
                 activation=nn.ReLU()):
        super().__init__()
        self.norm_first = norm_first
        self.attn = BiasedMultiheadAttention(feat_size=feat_size, num_heads=num_heads, attn_bias_type=attn_bias_type,
                                             attn_drop=dropout)
        self.ffn = nn.Sequential(nn.Linear(feat_size, hidden_size), activation, nn.Dropout(p=dropout),
                                 nn.Linear(hidden_size, feat_size), nn.Dropout(p=dropout))
        self.dropout = nn.Dropout(p=dropout)
        self.attn_layer_norm = nn.LayerNorm(feat_size)
        self.ffn_layer_norm = nn.LayerNorm(feat_size)

    def forward(self, nfeat, attn_bias=None, attn_mask=None):
        residual = nfeat
        nfeat = self.attn(nfeat, attn_bias, attn_mask)
        nfeat = residual + self.dropout(nfeat)
        nfeat = self.attn_layer_norm(nfeat)
        residual = nfeat
        nfeat = residual + self.ffn(nfeat)
        return self.ffn_layer_norm(nfeat)


def main():
    th.manual_seed(0)
    feat_size, num_heads = 16, 4
    graphs = [
        (5, [(0, 1), (1, 0), (1, 2), (2, 1), (2, 3), (3, 2), (3, 4), (4, 3)]),
        (3, [(0, 1), (1, 0), (1, 2), (2, 1)]),
    ]
    max_num_nodes = max(n for n, _ in graphs)
    node_embed = nn.Embedding(8, feat_size)
    nfeat = th.zeros(len(graphs), max_num_nodes, feat_size)
    for i, (n, _) in enumerate(graphs):
        nfeat[i, :n] = node_embed(th.arange(n))

    spatial_encoder = SpatialEncoder(max_dist=4, num_heads=num_heads)
    layers = nn.ModuleList(GraphormerLayer(feat_size, 32, num_heads, dropout=0.0) for _ in range(2))
    with th.no_grad():
        attn_bias = spatial_encoder(graphs)
        attn_mask = None
        if FIXED:
            attn_mask = th.zeros(len(graphs), max_num_nodes, max_num_nodes)
            for i, (n, _) in enumerate(graphs):
                attn_mask[i, :, n:] = 1
        x = nfeat
        for layer in layers:
            x = layer(x, attn_bias, attn_mask)
    print("out", tuple(x.shape), "NaN per graph", th.isnan(x).flatten(1).sum(1).tolist())


if __name__ == "__main__":
    main()
