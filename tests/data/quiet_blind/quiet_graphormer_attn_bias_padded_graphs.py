# Citation: microsoft/Graphormer graphormer/data/collator.py (pad_attn_bias_unsqueeze, collator), graphormer/data/wrapper.py
#   preprocess_item, graphormer/modules/graphormer_layers.py GraphAttnBias/GraphNodeFeature,
#   graphormer/modules/graphormer_graph_encoder.py, graphormer/modules/multihead_attention.py
#   (commit ac154fe4253d076a1c294f14be20dad0351cff3c)
# Padded graphs get an additive float attn_bias with -inf on padded columns (padded rows keep 0 on real columns), node
# pairs farther than spatial_pos_max (incl. disconnected components, distance 510) get -inf, and a bool key_padding_mask
# (x[:, :, 0] == 0, graph token never padded) is masked_fill'ed with -inf; each row keeps itself and the graph token.
import math
import torch
import torch.nn as nn
import torch.nn.functional as F
from types import SimpleNamespace


def floyd_warshall(adj):
    # graphormer/data/algos.pyx floyd_warshall: unreachable pairs = 510
    n = adj.size(0)
    d = torch.full((n, n), 510, dtype=torch.long)
    d[adj] = 1
    d.fill_diagonal_(0)
    for k in range(n):
        d = torch.minimum(d, d[:, k:k + 1] + d[k:k + 1, :])
    return d.clamp(max=510)


def preprocess_item(item):
    edge_attr, edge_index, x = item.edge_attr, item.edge_index, item.x
    N = x.size(0)
    adj = torch.zeros([N, N], dtype=torch.bool)
    adj[edge_index[0, :], edge_index[1, :]] = True
    if len(edge_attr.size()) == 1:
        edge_attr = edge_attr[:, None]
    attn_edge_type = torch.zeros([N, N, edge_attr.size(-1)], dtype=torch.long)
    attn_edge_type[edge_index[0, :], edge_index[1, :]] = edge_attr + 1
    spatial_pos = floyd_warshall(adj)
    attn_bias = torch.zeros([N + 1, N + 1], dtype=torch.float)
    item.attn_bias = attn_bias
    item.attn_edge_type = attn_edge_type
    item.spatial_pos = spatial_pos
    item.in_degree = adj.long().sum(dim=1).view(-1)
    item.out_degree = item.in_degree
    return item


def pad_1d_unsqueeze(x, padlen):
    x = x + 1
    xlen = x.size(0)
    if xlen < padlen:
        new_x = x.new_zeros([padlen], dtype=x.dtype)
        new_x[:xlen] = x
        x = new_x
    return x.unsqueeze(0)


def pad_2d_unsqueeze(x, padlen):
    x = x + 1
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


def collator(items, max_node=512, spatial_pos_max=20):
    items = [item for item in items if item is not None and item.x.size(0) <= max_node]
    attn_biases = [item.attn_bias for item in items]
    spatial_poses = [item.spatial_pos for item in items]
    for idx, _ in enumerate(attn_biases):
        attn_biases[idx][1:, 1:][spatial_poses[idx] >= spatial_pos_max] = float("-inf")
    max_node_num = max(item.x.size(0) for item in items)
    return dict(
        attn_bias=torch.cat([pad_attn_bias_unsqueeze(i, max_node_num + 1) for i in attn_biases]),
        attn_edge_type=torch.cat([pad_edge_type_unsqueeze(i.attn_edge_type, max_node_num) for i in items]),
        spatial_pos=torch.cat([pad_spatial_pos_unsqueeze(i, max_node_num) for i in spatial_poses]),
        in_degree=torch.cat([pad_1d_unsqueeze(i.in_degree, max_node_num) for i in items]),
        out_degree=torch.cat([pad_1d_unsqueeze(i.in_degree, max_node_num) for i in items]),
        x=torch.cat([pad_2d_unsqueeze(i.x, max_node_num) for i in items]),
        y=torch.cat([i.y for i in items]),
    )


class GraphNodeFeature(nn.Module):
    def __init__(self, num_heads, num_atoms, num_in_degree, num_out_degree, hidden_dim, n_layers):
        super().__init__()
        self.atom_encoder = nn.Embedding(num_atoms + 1, hidden_dim, padding_idx=0)
        self.in_degree_encoder = nn.Embedding(num_in_degree, hidden_dim, padding_idx=0)
        self.out_degree_encoder = nn.Embedding(num_out_degree, hidden_dim, padding_idx=0)
        self.graph_token = nn.Embedding(1, hidden_dim)

    def forward(self, batched_data):
        x, in_degree, out_degree = batched_data["x"], batched_data["in_degree"], batched_data["out_degree"]
        n_graph, n_node = x.size()[:2]
        node_feature = self.atom_encoder(x).sum(dim=-2)
        node_feature = node_feature + self.in_degree_encoder(in_degree) + self.out_degree_encoder(out_degree)
        graph_token_feature = self.graph_token.weight.unsqueeze(0).repeat(n_graph, 1, 1)
        return torch.cat([graph_token_feature, node_feature], dim=1)


class GraphAttnBias(nn.Module):
    def __init__(self, num_heads, num_edges, num_spatial):
        super().__init__()
        self.num_heads = num_heads
        self.edge_encoder = nn.Embedding(num_edges + 1, num_heads, padding_idx=0)
        self.spatial_pos_encoder = nn.Embedding(num_spatial, num_heads, padding_idx=0)
        self.graph_token_virtual_distance = nn.Embedding(1, num_heads)

    def forward(self, batched_data):
        attn_bias, spatial_pos, x = batched_data["attn_bias"], batched_data["spatial_pos"], batched_data["x"]
        attn_edge_type = batched_data["attn_edge_type"]
        n_graph, n_node = x.size()[:2]
        graph_attn_bias = attn_bias.clone()
        graph_attn_bias = graph_attn_bias.unsqueeze(1).repeat(1, self.num_heads, 1, 1)
        spatial_pos_bias = self.spatial_pos_encoder(spatial_pos).permute(0, 3, 1, 2)
        graph_attn_bias[:, :, 1:, 1:] = graph_attn_bias[:, :, 1:, 1:] + spatial_pos_bias
        t = self.graph_token_virtual_distance.weight.view(1, self.num_heads, 1)
        graph_attn_bias[:, :, 1:, 0] = graph_attn_bias[:, :, 1:, 0] + t
        graph_attn_bias[:, :, 0, :] = graph_attn_bias[:, :, 0, :] + t
        edge_input = self.edge_encoder(attn_edge_type).mean(-2).permute(0, 3, 1, 2)
        graph_attn_bias[:, :, 1:, 1:] = graph_attn_bias[:, :, 1:, 1:] + edge_input
        graph_attn_bias = graph_attn_bias + attn_bias.unsqueeze(1)  # reset
        return graph_attn_bias


class MultiheadAttention(nn.Module):
    def __init__(self, embed_dim, num_heads, dropout=0.0):
        super().__init__()
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.head_dim = embed_dim // num_heads
        self.scaling = self.head_dim ** -0.5
        self.k_proj = nn.Linear(embed_dim, embed_dim)
        self.v_proj = nn.Linear(embed_dim, embed_dim)
        self.q_proj = nn.Linear(embed_dim, embed_dim)
        self.out_proj = nn.Linear(embed_dim, embed_dim)
        self.dropout_module = nn.Dropout(dropout)

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
            attn_weights += attn_mask.unsqueeze(0)
        if key_padding_mask is not None:
            attn_weights = attn_weights.view(bsz, self.num_heads, tgt_len, src_len)
            attn_weights = attn_weights.masked_fill(key_padding_mask.unsqueeze(1).unsqueeze(2).to(torch.bool), float("-inf"))
            attn_weights = attn_weights.view(bsz * self.num_heads, tgt_len, src_len)
        attn_weights_float = F.softmax(attn_weights, dim=-1, dtype=torch.float32)
        attn_weights = attn_weights_float.type_as(attn_weights)
        attn_probs = self.dropout_module(attn_weights)
        attn = torch.bmm(attn_probs, v)
        attn = attn.transpose(0, 1).contiguous().view(tgt_len, bsz, embed_dim)
        return self.out_proj(attn), None


class GraphormerGraphEncoderLayer(nn.Module):
    def __init__(self, embedding_dim, ffn_embedding_dim, num_attention_heads, dropout=0.1, pre_layernorm=False):
        super().__init__()
        self.pre_layernorm = pre_layernorm
        self.self_attn = MultiheadAttention(embedding_dim, num_attention_heads, dropout=dropout)
        self.self_attn_layer_norm = nn.LayerNorm(embedding_dim)
        self.fc1 = nn.Linear(embedding_dim, ffn_embedding_dim)
        self.fc2 = nn.Linear(ffn_embedding_dim, embedding_dim)
        self.final_layer_norm = nn.LayerNorm(embedding_dim)
        self.dropout_module = nn.Dropout(dropout)

    def forward(self, x, self_attn_bias=None, self_attn_mask=None, self_attn_padding_mask=None):
        residual = x
        x, attn = self.self_attn(query=x, key=x, value=x, attn_bias=self_attn_bias, key_padding_mask=self_attn_padding_mask,
                                 need_weights=False, attn_mask=self_attn_mask)
        x = self.dropout_module(x)
        x = self.self_attn_layer_norm(residual + x)
        residual = x
        x = self.fc2(F.gelu(self.fc1(x)))
        x = self.dropout_module(x)
        x = self.final_layer_norm(residual + x)
        return x, attn


class GraphormerGraphEncoder(nn.Module):
    def __init__(self, num_atoms=64, num_in_degree=64, num_out_degree=64, num_edges=16, num_spatial=512, num_encoder_layers=2,
                 embedding_dim=32, ffn_embedding_dim=64, num_attention_heads=4):
        super().__init__()
        self.graph_node_feature = GraphNodeFeature(num_attention_heads, num_atoms, num_in_degree, num_out_degree, embedding_dim,
                                                   num_encoder_layers)
        self.graph_attn_bias = GraphAttnBias(num_attention_heads, num_edges, num_spatial)
        self.emb_layer_norm = nn.LayerNorm(embedding_dim)
        self.layers = nn.ModuleList([GraphormerGraphEncoderLayer(embedding_dim, ffn_embedding_dim, num_attention_heads)
                                     for _ in range(num_encoder_layers)])

    def forward(self, batched_data, attn_mask=None):
        data_x = batched_data["x"]
        n_graph, n_node = data_x.size()[:2]
        padding_mask = (data_x[:, :, 0]).eq(0)
        padding_mask_cls = torch.zeros(n_graph, 1, device=padding_mask.device, dtype=padding_mask.dtype)
        padding_mask = torch.cat((padding_mask_cls, padding_mask), dim=1)
        x = self.graph_node_feature(batched_data)
        attn_bias = self.graph_attn_bias(batched_data)
        x = self.emb_layer_norm(x)
        x = x.transpose(0, 1)
        for layer in self.layers:
            x, _ = layer(x, self_attn_padding_mask=padding_mask, self_attn_mask=attn_mask, self_attn_bias=attn_bias)
        graph_rep = x[0, :, :]
        return x, graph_rep


def make_graph(n, edges):
    ei = torch.tensor(edges, dtype=torch.long).t()
    ei = torch.cat([ei, ei.flip(0)], dim=1)  # undirected
    return preprocess_item(SimpleNamespace(x=torch.randint(0, 30, (n, 2)), edge_index=ei,
                                           edge_attr=torch.randint(0, 4, (ei.size(1),)), y=torch.randn(1)))


if __name__ == "__main__":
    torch.manual_seed(0)
    graphs = [make_graph(6, [(0, 1), (1, 2), (2, 3), (3, 4), (4, 5)]),
              make_graph(3, [(0, 1), (1, 2)]),
              make_graph(5, [(0, 1), (1, 2), (3, 4)])]  # two components: distance 510 -> -inf bias
    batch = collator(graphs)
    enc = GraphormerGraphEncoder()
    head = nn.Linear(32, 1)
    opt = torch.optim.AdamW(list(enc.parameters()) + list(head.parameters()), lr=2e-4)
    for step in range(2):
        _, graph_rep = enc(batch)
        loss = F.l1_loss(head(graph_rep).squeeze(-1), batch["y"])
        opt.zero_grad()
        loss.backward()
        opt.step()
    print("loss %.4f" % loss.item())
