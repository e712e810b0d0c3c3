"""Graphormer (microsoft/Graphormer) graph encoder: a batch of padded molecules with a virtual graph token.

Follows graphormer/data/collator.py (pad_attn_bias_unsqueeze fills the padded bias with -inf, then
copies the real x[:xlen, :xlen] block and zeroes rows new_x[xlen:, :xlen]) and
graphormer/modules/graphormer_layers.py (GraphAttnBias: spatial_pos_encoder, virtual distance for the
graph token t) and graphormer/modules/graphormer_graph_encoder.py + multihead_attention.py (padding_mask from
x[:, :, 0].eq(0); attn_bias added to q @ k.T per head, then key_padding_mask filled with -inf).
The mask it means: node i attends to node j of the same molecule with a learned bias chosen by their
shortest-path distance; pairs at shortest-path distance >= `spatial_pos_max` are -inf
(the dataset preprocessing cuts them); the graph token [VNode] (index 0) sees and is seen by every real
node; padded node columns are -inf; padded node rows attend to the real nodes (their outputs are
dropped).
"""
import torch
import torch.nn as nn


def pad_attn_bias_unsqueeze(x, padlen):
    xlen = x.size(0)
    if xlen < padlen:
        new_x = x.new_zeros([padlen, padlen], dtype=x.dtype).fill_(float("-inf"))
        new_x[:xlen, :xlen] = x
        new_x[xlen:, :xlen] = 0
        x = new_x
    return x.unsqueeze(0)


def pad_spatial_pos_unsqueeze(x, padlen):
    x = x + 1  # 0 is reserved for padding
    xlen = x.size(0)
    if xlen < padlen:
        new_x = x.new_zeros([padlen, padlen], dtype=x.dtype)
        new_x[:xlen, :xlen] = x
        x = new_x
    return x.unsqueeze(0)


def pad_1d_unsqueeze(x, padlen):
    x = x + 1
    xlen = x.size(0)
    if xlen < padlen:
        new_x = x.new_zeros([padlen, x.size(1)], dtype=x.dtype)
        new_x[:xlen] = x
        x = new_x
    return x.unsqueeze(0)


def floyd_warshall(adj):
    n = adj.size(0)
    dist = torch.full((n, n), 510, dtype=torch.long)
    dist[adj.bool()] = 1
    dist.fill_diagonal_(0)
    for k in range(n):  # tiny molecules; the upstream does this in Cython at preprocessing time
        dist = torch.minimum(dist, dist[:, k:k + 1] + dist[k:k + 1, :])
    return dist


def collator(items, spatial_pos_max=4):
    max_node_num = max(i["x"].size(0) for i in items)
    attn_biases, spatial_poses, xs = [], [], []
    for item in items:
        n = item["x"].size(0)
        spatial_pos = floyd_warshall(item["adj"])
        attn_bias = torch.zeros([n + 1, n + 1], dtype=torch.float)  # with graph token
        attn_bias[1:, 1:][spatial_pos >= spatial_pos_max] = float("-inf")
        attn_biases.append(pad_attn_bias_unsqueeze(attn_bias, max_node_num + 1))
        spatial_poses.append(pad_spatial_pos_unsqueeze(spatial_pos, max_node_num))
        xs.append(pad_1d_unsqueeze(item["x"], max_node_num))
    return dict(attn_bias=torch.cat(attn_biases), spatial_pos=torch.cat(spatial_poses), x=torch.cat(xs))


class GraphAttnBias(nn.Module):
    def __init__(self, num_heads, num_spatial):
        super().__init__()
        self.num_heads = num_heads
        self.spatial_pos_encoder = nn.Embedding(num_spatial, num_heads, padding_idx=0)
        self.graph_token_virtual_distance = nn.Embedding(1, num_heads)

    def forward(self, batched_data):
        attn_bias, spatial_pos = batched_data["attn_bias"], batched_data["spatial_pos"]
        n_graph, n_node = spatial_pos.size()[:2]
        graph_attn_bias = attn_bias.clone().unsqueeze(1).repeat(1, self.num_heads, 1, 1)
        spatial_pos_bias = self.spatial_pos_encoder(spatial_pos.clamp(max=511)).permute(0, 3, 1, 2)
        graph_attn_bias[:, :, 1:, 1:] = graph_attn_bias[:, :, 1:, 1:] + spatial_pos_bias
        t = self.graph_token_virtual_distance.weight.view(1, self.num_heads, 1)
        graph_attn_bias[:, :, 1:, 0] = graph_attn_bias[:, :, 1:, 0] + t
        graph_attn_bias[:, :, 0, :] = graph_attn_bias[:, :, 0, :] + t
        return graph_attn_bias + attn_bias.unsqueeze(1)  # reset: -inf stays -inf


class MultiheadAttention(nn.Module):
    """graphormer/modules/multihead_attention.py: fairseq attention with an additive attn_bias."""

    def __init__(self, embed_dim, num_heads):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = embed_dim // num_heads
        self.scaling = self.head_dim ** -0.5
        self.k_proj = nn.Linear(embed_dim, embed_dim)
        self.v_proj = nn.Linear(embed_dim, embed_dim)
        self.q_proj = nn.Linear(embed_dim, embed_dim)
        self.out_proj = nn.Linear(embed_dim, embed_dim)

    def forward(self, query, key, value, attn_bias, key_padding_mask=None):
        tgt_len, bsz, embed_dim = query.size()  # fairseq layout: T x B x C
        src_len = key.size(0)
        q = self.q_proj(query) * self.scaling
        k = self.k_proj(key)
        v = self.v_proj(value)
        q = q.contiguous().view(tgt_len, bsz * self.num_heads, self.head_dim).transpose(0, 1)
        k = k.contiguous().view(-1, bsz * self.num_heads, self.head_dim).transpose(0, 1)
        v = v.contiguous().view(-1, bsz * self.num_heads, self.head_dim).transpose(0, 1)
        attn_weights = torch.bmm(q, k.transpose(1, 2))
        if attn_bias is not None:
            attn_weights += attn_bias.view(bsz * self.num_heads, tgt_len, src_len)
        if key_padding_mask is not None:
            attn_weights = attn_weights.view(bsz, self.num_heads, tgt_len, src_len)
            attn_weights = attn_weights.masked_fill(key_padding_mask.unsqueeze(1).unsqueeze(2).to(torch.bool), float("-inf"))
            attn_weights = attn_weights.view(bsz * self.num_heads, tgt_len, src_len)
        attn_probs = torch.softmax(attn_weights, dim=-1)
        attn = torch.bmm(attn_probs, v)
        attn = attn.transpose(0, 1).contiguous().view(tgt_len, bsz, embed_dim)
        return self.out_proj(attn)


class GraphormerGraphEncoderLayer(nn.Module):
    def __init__(self, embedding_dim, num_attention_heads):
        super().__init__()
        self.self_attn = MultiheadAttention(embedding_dim, num_attention_heads)
        self.self_attn_layer_norm = nn.LayerNorm(embedding_dim)
        self.fc1 = nn.Linear(embedding_dim, embedding_dim * 2)
        self.fc2 = nn.Linear(embedding_dim * 2, embedding_dim)
        self.final_layer_norm = nn.LayerNorm(embedding_dim)

    def forward(self, x, self_attn_bias=None, self_attn_padding_mask=None):
        residual = x
        x = self.self_attn_layer_norm(x)  # pre_layernorm
        x = self.self_attn(x, x, x, attn_bias=self_attn_bias, key_padding_mask=self_attn_padding_mask)
        x = residual + x
        residual = x
        x = self.fc2(torch.relu(self.fc1(self.final_layer_norm(x))))
        return residual + x


class GraphormerGraphEncoder(nn.Module):
    def __init__(self, num_atoms=16, num_spatial=512, embedding_dim=32, num_attention_heads=4, num_encoder_layers=2):
        super().__init__()
        self.num_attention_heads = num_attention_heads
        self.atom_encoder = nn.Embedding(num_atoms + 1, embedding_dim, padding_idx=0)
        self.graph_token = nn.Embedding(1, embedding_dim)
        self.graph_attn_bias = GraphAttnBias(num_attention_heads, num_spatial)
        self.layers = nn.ModuleList([GraphormerGraphEncoderLayer(embedding_dim, num_attention_heads)
                                     for _ in range(num_encoder_layers)])

    def forward(self, batched_data):
        x = batched_data["x"]
        n_graph, n_node = x.size()[:2]
        padding_mask = x[:, :, 0].eq(0)  # B x T
        padding_mask_cls = torch.zeros(n_graph, 1, dtype=padding_mask.dtype)
        padding_mask = torch.cat((padding_mask_cls, padding_mask), dim=1)
        node_feature = self.atom_encoder(x).sum(dim=-2)
        h = torch.cat([self.graph_token.weight.unsqueeze(0).repeat(n_graph, 1, 1), node_feature], dim=1)
        attn_bias = self.graph_attn_bias(batched_data)  # B x H x (T+1) x (T+1)
        h = h.transpose(0, 1)  # B x T x C -> T x B x C
        for layer in self.layers:
            h = layer(h, self_attn_bias=attn_bias, self_attn_padding_mask=padding_mask)
        return h[0, :, :]  # graph representation read from the virtual node


def chain(n):
    adj = torch.zeros(n, n)
    idx = torch.arange(n - 1)
    adj[idx, idx + 1] = 1
    adj[idx + 1, idx] = 1
    return adj


def main():
    torch.manual_seed(0)
    items = [dict(x=torch.randint(0, 15, (n, 1)), adj=chain(n)) for n in (7, 4, 5)]
    batch = collator(items)
    model = GraphormerGraphEncoder().eval()
    with torch.no_grad():
        g = model(batch)
    print("graph embeddings", tuple(g.shape), f"{g.norm(dim=-1).mean().item():.3f}")


if __name__ == "__main__":
    main()
