"""GPS layer (local message passing + global attention) as rampasek/GraphGPS writes it.

Follows graphgps/layer/gps_layer.py (GPSLayer.forward, _sa_block) and torch_geometric.utils.to_dense_batch. Node
features of a mini-batch of graphs are [N_total, C] with a `batch` vector; the global branch scatters them into a
dense [B, N_max, C] tensor, runs nn.MultiheadAttention with key_padding_mask = ~mask (every node of a graph sees
all nodes of its own graph, none of another graph, no padding) and gathers the real rows back with `[mask]`, so
padding query rows are discarded. The local branch is a GIN-style sum over edge_index. Eval mode here.
"""
import torch
import torch.nn as nn


def to_dense_batch(x, batch):
    num_nodes = torch.bincount(batch)
    B, N_max = num_nodes.numel(), int(num_nodes.max())
    cum_nodes = torch.cat([batch.new_zeros(1), num_nodes.cumsum(0)])
    idx = torch.arange(batch.size(0)) - cum_nodes[batch] + batch * N_max
    out = x.new_zeros(B * N_max, x.size(-1))
    out[idx] = x
    mask = torch.zeros(B * N_max, dtype=torch.bool)
    mask[idx] = True
    return out.view(B, N_max, -1), mask.view(B, N_max)


class GPSLayer(nn.Module):
    def __init__(self, dim_h, num_heads, dropout=0.0, attn_dropout=0.2):
        super().__init__()
        self.local_mlp = nn.Sequential(nn.Linear(dim_h, dim_h), nn.ReLU(), nn.Linear(dim_h, dim_h))
        self.self_attn = nn.MultiheadAttention(dim_h, num_heads, dropout=attn_dropout, batch_first=True)
        self.norm1_local, self.norm1_attn = nn.BatchNorm1d(dim_h), nn.BatchNorm1d(dim_h)
        self.ff_block = nn.Sequential(nn.Linear(dim_h, 2 * dim_h), nn.ReLU(), nn.Linear(2 * dim_h, dim_h))
        self.norm2 = nn.BatchNorm1d(dim_h)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x, edge_index, batch):
        h_in1 = x
        h_out_list = []
        agg = torch.zeros_like(x).index_add_(0, edge_index[1], x[edge_index[0]])  # GIN: sum of neighbours
        h_local = self.local_mlp(x + agg)
        h_out_list.append(self.norm1_local(h_in1 + self.dropout(h_local)))
        h_dense, mask = to_dense_batch(x, batch)
        h_attn = self._sa_block(h_dense, None, ~mask)[mask]
        h_out_list.append(self.norm1_attn(h_in1 + self.dropout(h_attn)))
        h = sum(h_out_list)
        return self.norm2(h + self.ff_block(h))

    def _sa_block(self, x, attn_mask, key_padding_mask):
        x = self.self_attn(x, x, x, attn_mask=attn_mask, key_padding_mask=key_padding_mask, need_weights=False)[0]
        return self.dropout(x)


def main():
    torch.manual_seed(0)
    sizes = [6, 2, 4]
    batch = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes))
    x = torch.randn(int(sum(sizes)), 16)
    edges, start = [], 0
    for n in sizes:  # path graph per molecule, both directions
        for i in range(n - 1):
            edges += [(start + i, start + i + 1), (start + i + 1, start + i)]
        start += n
    edge_index = torch.tensor(edges).t()
    layer = GPSLayer(16, 4).eval()
    with torch.no_grad():
        out = layer(x, edge_index, batch)
        # reference for the global branch: one graph at a time, no padding and no mask
        h_dense, mask = to_dense_batch(x, batch)
        dense_attn = layer._sa_block(h_dense, None, ~mask)[mask]
        for g in range(len(sizes)):
            xg = x[batch == g].unsqueeze(0)
            alone = layer.self_attn(xg, xg, xg, need_weights=False)[0][0]
            assert torch.allclose(dense_attn[batch == g], alone, atol=1e-5), g
    print(f"graphs {len(sizes)} nodes {x.size(0)} out {tuple(out.shape)}")


if __name__ == "__main__":
    main()
