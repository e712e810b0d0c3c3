# microsoft/Graphormer#119 (commit 567c8e0, "Bugfix: Stop Floyd-Warshall algorithm dropping node 0
# from paths"; follow-up microsoft/Graphormer#121, commit 8a5c141, makes the Cython `k` a signed int).
#
# Graphormer's multi-hop edge encoding adds, for every node pair (i, j), a per-head attention bias
# built from the edge features along the shortest path i -> j (graphormer/data/algos.pyx
# `gen_edge_input`, graphormer/modules/graphormer_layers.py `GraphAttnBias`). `floyd_warshall` kept
# the intermediate node of each path in a `path` matrix initialised with zeros, and `get_all_edges`
# stopped the recursion on `k == 0`: so "no intermediate node" and "the path goes through atom 0"
# were the same value, and every shortest path through atom 0 was cut to a single (non-existent)
# edge i -> j. The edge bias of those pairs was built from the wrong edges.
# Fix: `path` is initialised to -1 and `get_all_edges` stops on `k == -1`.
#
# Ported (Cython -> Python, torch_geometric data object -> a namespace) from
# graphormer/data/algos.pyx, graphormer/data/wrapper.py (preprocess_item), graphormer/data/collator.py,
# graphormer/modules/graphormer_layers.py, graphormer/modules/multihead_attention.py and
# graphormer/modules/graphormer_graph_encoder.py at 567c8e0^.
import math
import sys
from types import SimpleNamespace

import numpy
import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


# ---------------------------------------------------------------- graphormer/data/algos.pyx
def floyd_warshall(adjacency_matrix):
    (nrows, ncols) = adjacency_matrix.shape
    assert nrows == ncols
    n = nrows

    M = adjacency_matrix.astype(numpy.int64, order="C", casting="safe", copy=True)
    if FIXED:
        path = -1 * numpy.ones([n, n], dtype=numpy.int64)
    else:
        path = numpy.zeros([n, n], dtype=numpy.int64)

    # set unreachable nodes distance to 510
    for i in range(n):
        for j in range(n):
            if i == j:
                M[i][j] = 0
            elif M[i][j] == 0:
                M[i][j] = 510

    # floyed algo
    for k in range(n):
        for i in range(n):
            M_ik = M[i][k]
            for j in range(n):
                cost_ikkj = M_ik + M[k][j]
                M_ij = M[i][j]
                if M_ij > cost_ikkj:
                    M[i][j] = cost_ikkj
                    path[i][j] = k

    # set unreachable path to 510
    for i in range(n):
        for j in range(n):
            if M[i][j] >= 510:
                path[i][j] = 510
                M[i][j] = 510

    return M, path


def get_all_edges(path, i, j):
    k = int(path[i][j])
    if FIXED:
        if k == -1:
            return []
    else:
        if k == 0:
            return []
    return get_all_edges(path, i, k) + [k] + get_all_edges(path, k, j)


def gen_edge_input(max_dist, path, edge_feat):
    (nrows, ncols) = path.shape
    assert nrows == ncols
    n = nrows
    max_dist_copy = int(max_dist)

    path_copy = path.astype(numpy.int64, order="C", casting="safe", copy=True)
    edge_feat_copy = edge_feat.astype(numpy.int64, order="C", casting="safe", copy=True)

    edge_fea_all = -1 * numpy.ones([n, n, max_dist_copy, edge_feat.shape[-1]], dtype=numpy.int64)

    for i in range(n):
        for j in range(n):
            if i == j:
                continue
            if path_copy[i][j] == 510:
                continue
            path = [i] + get_all_edges(path_copy, i, j) + [j]
            num_path = len(path) - 1
            for k in range(num_path):
                edge_fea_all[i, j, k, :] = edge_feat_copy[path[k], path[k + 1], :]

    return edge_fea_all


# ---------------------------------------------------------------- graphormer/data/wrapper.py
def convert_to_single_emb(x, offset: int = 512):
    feature_num = x.size(1) if len(x.size()) > 1 else 1
    feature_offset = 1 + torch.arange(0, feature_num * offset, offset, dtype=torch.long)
    x = x + feature_offset
    return x


def preprocess_item(item):
    edge_attr, edge_index, x = item.edge_attr, item.edge_index, item.x
    N = x.size(0)
    x = convert_to_single_emb(x)

    # node adj matrix [N, N] bool
    adj = torch.zeros([N, N], dtype=torch.bool)
    adj[edge_index[0, :], edge_index[1, :]] = True

    # edge feature here
    if len(edge_attr.size()) == 1:
        edge_attr = edge_attr[:, None]
    attn_edge_type = torch.zeros([N, N, edge_attr.size(-1)], dtype=torch.long)
    attn_edge_type[edge_index[0, :], edge_index[1, :]] = convert_to_single_emb(edge_attr) + 1

    shortest_path_result, path = floyd_warshall(adj.numpy())
    max_dist = numpy.amax(shortest_path_result)
    edge_input = gen_edge_input(max_dist, path, attn_edge_type.numpy())
    spatial_pos = torch.from_numpy((shortest_path_result)).long()
    attn_bias = torch.zeros([N + 1, N + 1], dtype=torch.float)  # with graph token

    # combine
    item.x = x
    item.attn_bias = attn_bias
    item.attn_edge_type = attn_edge_type
    item.spatial_pos = spatial_pos
    item.in_degree = adj.long().sum(dim=1).view(-1)
    item.out_degree = item.in_degree  # for undirected graph
    item.edge_input = torch.from_numpy(edge_input).long()
    return item


# ---------------------------------------------------------------- graphormer/data/collator.py
def pad_1d_unsqueeze(x, padlen):
    x = x + 1  # pad id = 0
    xlen = x.size(0)
    if xlen < padlen:
        new_x = x.new_zeros([padlen], dtype=x.dtype)
        new_x[:xlen] = x
        x = new_x
    return x.unsqueeze(0)


def pad_2d_unsqueeze(x, padlen):
    x = x + 1  # pad id = 0
    xlen, xdim = x.size()
    if xlen < padlen:
        new_x = x.new_zeros([padlen, xdim], dtype=x.dtype)
        new_x[:xlen, :] = x
        x = new_x
    return x.unsqueeze(0)


def pad_attn_bias_unsqueeze(x, padlen):
    xlen = x.size(0)
    if xlen < padlen:
        new_x = x.new_zeros([padlen, padlen], dtype=x.dtype).fill_(float("-inf"))
        new_x[:xlen, :xlen] = x
        new_x[xlen:, :xlen] = 0
        x = new_x
    return x.unsqueeze(0)


def pad_edge_type_unsqueeze(x, padlen):
    xlen = x.size(0)
    if xlen < padlen:
        new_x = x.new_zeros([padlen, padlen, x.size(-1)], dtype=x.dtype)
        new_x[:xlen, :xlen, :] = x
        x = new_x
    return x.unsqueeze(0)


def pad_spatial_pos_unsqueeze(x, padlen):
    x = x + 1
    xlen = x.size(0)
    if xlen < padlen:
        new_x = x.new_zeros([padlen, padlen], dtype=x.dtype)
        new_x[:xlen, :xlen] = x
        x = new_x
    return x.unsqueeze(0)


def pad_3d_unsqueeze(x, padlen1, padlen2, padlen3):
    x = x + 1
    xlen1, xlen2, xlen3, xlen4 = x.size()
    if xlen1 < padlen1 or xlen2 < padlen2 or xlen3 < padlen3:
        new_x = x.new_zeros([padlen1, padlen2, padlen3, xlen4], dtype=x.dtype)
        new_x[:xlen1, :xlen2, :xlen3, :] = x
        x = new_x
    return x.unsqueeze(0)


def collator(items, max_node=512, multi_hop_max_dist=20, spatial_pos_max=20):
    items = [item for item in items if item is not None and item.x.size(0) <= max_node]
    items = [
        (
            item.idx,
            item.attn_bias,
            item.attn_edge_type,
            item.spatial_pos,
            item.in_degree,
            item.out_degree,
            item.x,
            item.edge_input[:, :, :multi_hop_max_dist, :],
            item.y,
        )
        for item in items
    ]
    (idxs, attn_biases, attn_edge_types, spatial_poses, in_degrees, out_degrees, xs, edge_inputs, ys) = zip(*items)

    for idx, _ in enumerate(attn_biases):
        attn_biases[idx][1:, 1:][spatial_poses[idx] >= spatial_pos_max] = float("-inf")
    max_node_num = max(i.size(0) for i in xs)
    max_dist = max(i.size(-2) for i in edge_inputs)
    y = torch.cat(ys)
    x = torch.cat([pad_2d_unsqueeze(i, max_node_num) for i in xs])
    edge_input = torch.cat([pad_3d_unsqueeze(i, max_node_num, max_node_num, max_dist) for i in edge_inputs])
    attn_bias = torch.cat([pad_attn_bias_unsqueeze(i, max_node_num + 1) for i in attn_biases])
    attn_edge_type = torch.cat([pad_edge_type_unsqueeze(i, max_node_num) for i in attn_edge_types])
    spatial_pos = torch.cat([pad_spatial_pos_unsqueeze(i, max_node_num) for i in spatial_poses])
    in_degree = torch.cat([pad_1d_unsqueeze(i, max_node_num) for i in in_degrees])

    return dict(
        idx=torch.LongTensor(idxs),
        attn_bias=attn_bias,
        attn_edge_type=attn_edge_type,
        spatial_pos=spatial_pos,
        in_degree=in_degree,
        out_degree=in_degree,  # for undirected graph
        x=x,
        edge_input=edge_input,
        y=y,
    )


# ---------------------------------------------------------------- graphormer/modules/graphormer_layers.py
def init_params(module, n_layers):
    if isinstance(module, nn.Linear):
        module.weight.data.normal_(mean=0.0, std=0.02 / math.sqrt(n_layers))
        if module.bias is not None:
            module.bias.data.zero_()
    if isinstance(module, nn.Embedding):
        module.weight.data.normal_(mean=0.0, std=0.02)


class GraphNodeFeature(nn.Module):
    def __init__(self, num_heads, num_atoms, num_in_degree, num_out_degree, hidden_dim, n_layers):
        super().__init__()
        self.num_heads = num_heads
        self.num_atoms = num_atoms
        self.atom_encoder = nn.Embedding(num_atoms + 1, hidden_dim, padding_idx=0)
        self.in_degree_encoder = nn.Embedding(num_in_degree, hidden_dim, padding_idx=0)
        self.out_degree_encoder = nn.Embedding(num_out_degree, hidden_dim, padding_idx=0)
        self.graph_token = nn.Embedding(1, hidden_dim)
        self.apply(lambda module: init_params(module, n_layers=n_layers))

    def forward(self, batched_data):
        x, in_degree, out_degree = batched_data["x"], batched_data["in_degree"], batched_data["out_degree"]
        n_graph, n_node = x.size()[:2]
        node_feature = self.atom_encoder(x).sum(dim=-2)  # [n_graph, n_node, n_hidden]
        node_feature = node_feature + self.in_degree_encoder(in_degree) + self.out_degree_encoder(out_degree)
        graph_token_feature = self.graph_token.weight.unsqueeze(0).repeat(n_graph, 1, 1)
        graph_node_feature = torch.cat([graph_token_feature, node_feature], dim=1)
        return graph_node_feature


class GraphAttnBias(nn.Module):
    def __init__(self, num_heads, num_atoms, num_edges, num_spatial, num_edge_dis, hidden_dim,
                 edge_type, multi_hop_max_dist, n_layers):
        super().__init__()
        self.num_heads = num_heads
        self.multi_hop_max_dist = multi_hop_max_dist
        self.edge_encoder = nn.Embedding(num_edges + 1, num_heads, padding_idx=0)
        self.edge_type = edge_type
        if self.edge_type == "multi_hop":
            self.edge_dis_encoder = nn.Embedding(num_edge_dis * num_heads * num_heads, 1)
        self.spatial_pos_encoder = nn.Embedding(num_spatial, num_heads, padding_idx=0)
        self.graph_token_virtual_distance = nn.Embedding(1, num_heads)
        self.apply(lambda module: init_params(module, n_layers=n_layers))

    def forward(self, batched_data):
        attn_bias, spatial_pos, x = batched_data["attn_bias"], batched_data["spatial_pos"], batched_data["x"]
        edge_input, attn_edge_type = batched_data["edge_input"], batched_data["attn_edge_type"]

        n_graph, n_node = x.size()[:2]
        graph_attn_bias = attn_bias.clone()
        graph_attn_bias = graph_attn_bias.unsqueeze(1).repeat(1, self.num_heads, 1, 1)

        # spatial pos
        spatial_pos_bias = self.spatial_pos_encoder(spatial_pos).permute(0, 3, 1, 2)
        graph_attn_bias[:, :, 1:, 1:] = graph_attn_bias[:, :, 1:, 1:] + spatial_pos_bias

        # reset spatial pos here
        t = self.graph_token_virtual_distance.weight.view(1, self.num_heads, 1)
        graph_attn_bias[:, :, 1:, 0] = graph_attn_bias[:, :, 1:, 0] + t
        graph_attn_bias[:, :, 0, :] = graph_attn_bias[:, :, 0, :] + t

        # edge feature
        if self.edge_type == "multi_hop":
            spatial_pos_ = spatial_pos.clone()
            spatial_pos_[spatial_pos_ == 0] = 1  # set pad to 1
            spatial_pos_ = torch.where(spatial_pos_ > 1, spatial_pos_ - 1, spatial_pos_)
            if self.multi_hop_max_dist > 0:
                spatial_pos_ = spatial_pos_.clamp(0, self.multi_hop_max_dist)
                edge_input = edge_input[:, :, :, : self.multi_hop_max_dist, :]
            # [n_graph, n_node, n_node, max_dist, n_head]
            edge_input = self.edge_encoder(edge_input).mean(-2)
            max_dist = edge_input.size(-2)
            edge_input_flat = edge_input.permute(3, 0, 1, 2, 4).reshape(max_dist, -1, self.num_heads)
            edge_input_flat = torch.bmm(
                edge_input_flat,
                self.edge_dis_encoder.weight.reshape(-1, self.num_heads, self.num_heads)[:max_dist, :, :],
            )
            edge_input = edge_input_flat.reshape(max_dist, n_graph, n_node, n_node, self.num_heads).permute(1, 2, 3, 0, 4)
            edge_input = (edge_input.sum(-2) / (spatial_pos_.float().unsqueeze(-1))).permute(0, 3, 1, 2)
        else:
            edge_input = self.edge_encoder(attn_edge_type).mean(-2).permute(0, 3, 1, 2)

        graph_attn_bias[:, :, 1:, 1:] = graph_attn_bias[:, :, 1:, 1:] + edge_input
        graph_attn_bias = graph_attn_bias + attn_bias.unsqueeze(1)  # reset
        return graph_attn_bias


# ---------------------------------------------------------------- graphormer/modules/multihead_attention.py
class MultiheadAttention(nn.Module):
    def __init__(self, embed_dim, num_heads, dropout=0.0):
        super().__init__()
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.head_dim = embed_dim // num_heads
        self.scaling = self.head_dim ** -0.5
        self.dropout_module = nn.Dropout(dropout)
        self.k_proj = nn.Linear(embed_dim, embed_dim)
        self.v_proj = nn.Linear(embed_dim, embed_dim)
        self.q_proj = nn.Linear(embed_dim, embed_dim)
        self.out_proj = nn.Linear(embed_dim, embed_dim)

    def forward(self, query, key, value, attn_bias, key_padding_mask=None, need_weights=True, attn_mask=None):
        tgt_len, bsz, embed_dim = query.size()
        src_len = tgt_len

        q = self.q_proj(query)
        k = self.k_proj(query)
        v = self.v_proj(query)
        q *= self.scaling

        q = q.contiguous().view(tgt_len, bsz * self.num_heads, self.head_dim).transpose(0, 1)
        k = k.contiguous().view(-1, bsz * self.num_heads, self.head_dim).transpose(0, 1)
        v = v.contiguous().view(-1, bsz * self.num_heads, self.head_dim).transpose(0, 1)

        attn_weights = torch.bmm(q, k.transpose(1, 2))

        if attn_bias is not None:
            attn_weights += attn_bias.view(bsz * self.num_heads, tgt_len, src_len)

        if attn_mask is not None:
            attn_mask = attn_mask.unsqueeze(0)
            attn_weights += attn_mask

        if key_padding_mask is not None:
            # don't attend to padding symbols
            attn_weights = attn_weights.view(bsz, self.num_heads, tgt_len, src_len)
            attn_weights = attn_weights.masked_fill(
                key_padding_mask.unsqueeze(1).unsqueeze(2).to(torch.bool), float("-inf")
            )
            attn_weights = attn_weights.view(bsz * self.num_heads, tgt_len, src_len)

        attn_weights_float = F.softmax(attn_weights, dim=-1, dtype=torch.float32)
        attn_weights = attn_weights_float.type_as(attn_weights)
        attn_probs = self.dropout_module(attn_weights)

        attn = torch.bmm(attn_probs, v)
        attn = attn.transpose(0, 1).contiguous().view(tgt_len, bsz, embed_dim)
        attn = self.out_proj(attn)
        return attn, None


# ---------------------------------------------------------------- graphormer/modules/graphormer_graph_encoder(_layer).py
class GraphormerGraphEncoderLayer(nn.Module):
    def __init__(self, embedding_dim, ffn_embedding_dim, num_attention_heads):
        super().__init__()
        self.self_attn = MultiheadAttention(embedding_dim, num_attention_heads)
        self.self_attn_layer_norm = nn.LayerNorm(embedding_dim)
        self.fc1 = nn.Linear(embedding_dim, ffn_embedding_dim)
        self.fc2 = nn.Linear(ffn_embedding_dim, embedding_dim)
        self.final_layer_norm = nn.LayerNorm(embedding_dim)

    def forward(self, x, self_attn_bias=None, self_attn_mask=None, self_attn_padding_mask=None):
        residual = x
        x, attn = self.self_attn(query=x, key=x, value=x, attn_bias=self_attn_bias,
                                 key_padding_mask=self_attn_padding_mask, need_weights=False,
                                 attn_mask=self_attn_mask)
        x = residual + x
        x = self.self_attn_layer_norm(x)
        residual = x
        x = self.fc2(F.gelu(self.fc1(x)))
        x = residual + x
        x = self.final_layer_norm(x)
        return x, attn


class GraphormerGraphEncoder(nn.Module):
    def __init__(self, num_atoms, num_in_degree, num_out_degree, num_edges, num_spatial, num_edge_dis,
                 edge_type, multi_hop_max_dist, num_encoder_layers, embedding_dim, ffn_embedding_dim,
                 num_attention_heads):
        super().__init__()
        self.graph_node_feature = GraphNodeFeature(num_attention_heads, num_atoms, num_in_degree,
                                                   num_out_degree, embedding_dim, num_encoder_layers)
        self.graph_attn_bias = GraphAttnBias(num_attention_heads, num_atoms, num_edges, num_spatial,
                                             num_edge_dis, embedding_dim, edge_type, multi_hop_max_dist,
                                             num_encoder_layers)
        self.layers = nn.ModuleList([
            GraphormerGraphEncoderLayer(embedding_dim, ffn_embedding_dim, num_attention_heads)
            for _ in range(num_encoder_layers)
        ])

    def forward(self, batched_data, attn_mask=None):
        data_x = batched_data["x"]
        n_graph, n_node = data_x.size()[:2]
        padding_mask = (data_x[:, :, 0]).eq(0)  # B x T x 1
        padding_mask_cls = torch.zeros(n_graph, 1, device=padding_mask.device, dtype=padding_mask.dtype)
        padding_mask = torch.cat((padding_mask_cls, padding_mask), dim=1)

        x = self.graph_node_feature(batched_data)
        attn_bias = self.graph_attn_bias(batched_data)

        # B x T x C -> T x B x C
        x = x.transpose(0, 1)
        for layer in self.layers:
            x, _ = layer(x, self_attn_padding_mask=padding_mask, self_attn_mask=attn_mask,
                         self_attn_bias=attn_bias)
        graph_rep = x[0, :, :]
        return x, graph_rep


def make_item(idx, atoms, bonds, bond_types, y):
    src = [a for a, b in bonds] + [b for a, b in bonds]
    dst = [b for a, b in bonds] + [a for a, b in bonds]
    return SimpleNamespace(
        idx=idx,
        x=torch.tensor(atoms, dtype=torch.long).view(-1, 1),
        edge_index=torch.tensor([src, dst], dtype=torch.long),
        edge_attr=torch.tensor(bond_types + bond_types, dtype=torch.long).view(-1, 1),
        y=torch.tensor([y], dtype=torch.float),
    )


def main():
    torch.manual_seed(0)
    # two small molecules; in the first, atom 0 is a branch point (isobutanol-like skeleton):
    # the shortest paths 1->2, 1->3, 2->3, 1->4 ... all go through atom 0.
    mol_a = make_item(0, atoms=[6, 6, 6, 6, 8], bonds=[(0, 1), (0, 2), (0, 3), (3, 4)],
                      bond_types=[0, 0, 0, 1], y=0.7)
    mol_b = make_item(1, atoms=[6, 8, 7], bonds=[(0, 1), (1, 2)], bond_types=[1, 2], y=-0.2)
    items = [preprocess_item(mol_a), preprocess_item(mol_b)]

    batch = collator(items, max_node=128, multi_hop_max_dist=5, spatial_pos_max=20)

    model = GraphormerGraphEncoder(
        num_atoms=512 * 9, num_in_degree=64, num_out_degree=64, num_edges=512 * 3, num_spatial=64,
        num_edge_dis=16, edge_type="multi_hop", multi_hop_max_dist=5, num_encoder_layers=2,
        embedding_dim=32, ffn_embedding_dim=64, num_attention_heads=4,
    )
    # larger edge embeddings so the edge term is visible next to the spatial term
    with torch.no_grad():
        model.graph_attn_bias.edge_encoder.weight.normal_(0.0, 1.0)
        model.graph_attn_bias.edge_dis_encoder.weight.normal_(0.0, 1.0)
    model.eval()
    head = nn.Linear(32, 1)

    with torch.no_grad():
        _, graph_rep = model(batch)
        pred = head(graph_rep).squeeze(-1)
    loss = F.l1_loss(pred, batch["y"])
    print("edge_input[0, 1, 2]:", batch["edge_input"][0, 1, 2].flatten().tolist())
    print("graph_rep[:, :4]:", graph_rep[:, :4])
    print("pred:", pred.tolist(), "mae:", round(float(loss), 6))


if __name__ == "__main__":
    main()
