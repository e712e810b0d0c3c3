# Citation: rampasek/GraphGPS graphgps/layer/gps_layer.py (commit 016956acf80e9dee4fff7c11ad381aba1fdd4048), GPSLayer.forward/_sa_block
# Graphs of different sizes are densified with to_dense_batch; mask is True for real nodes, and ~mask is passed as
# key_padding_mask (bool block) to nn.MultiheadAttention; padded query rows are dropped again by [mask].
import torch
import torch.nn as nn
import torch.nn.functional as F


def to_dense_batch(x, batch, fill_value=0.0):
    # torch_geometric.utils.to_dense_batch (minimal copy)
    batch_size = int(batch.max()) + 1
    num_nodes = torch.bincount(batch, minlength=batch_size)
    cum_nodes = torch.cat([num_nodes.new_zeros(1), num_nodes.cumsum(0)])
    max_num_nodes = int(num_nodes.max())
    idx = torch.arange(batch.size(0)) - cum_nodes[batch] + batch * max_num_nodes
    out = x.new_full((batch_size * max_num_nodes, x.size(-1)), fill_value)
    out[idx] = x
    out = out.view(batch_size, max_num_nodes, x.size(-1))
    mask = torch.zeros(batch_size * max_num_nodes, dtype=torch.bool)
    mask[idx] = True
    return out, mask.view(batch_size, max_num_nodes)


class GPSLayer(nn.Module):
    """Global attention part of GPSLayer (global_model_type='Transformer', local_gnn_type='None')."""

    def __init__(self, dim_h, num_heads, dropout=0.0, attn_dropout=0.0):
        super().__init__()
        self.dim_h = dim_h
        self.num_heads = num_heads
        self.global_model_type = 'Transformer'
        self.self_attn = torch.nn.MultiheadAttention(dim_h, num_heads, dropout=attn_dropout, batch_first=True)
        self.norm1_attn = nn.BatchNorm1d(dim_h)
        self.dropout_attn = nn.Dropout(dropout)
        self.activation = F.relu
        self.ff_linear1 = nn.Linear(dim_h, dim_h * 2)
        self.ff_linear2 = nn.Linear(dim_h * 2, dim_h)
        self.norm2 = nn.BatchNorm1d(dim_h)
        self.ff_dropout1 = nn.Dropout(dropout)
        self.ff_dropout2 = nn.Dropout(dropout)

    def forward(self, x, batch):
        h = x
        h_in1 = h
        h_out_list = []
        h_dense, mask = to_dense_batch(h, batch)
        if self.global_model_type == 'Transformer':
            h_attn = self._sa_block(h_dense, None, ~mask)[mask]
        h_attn = self.dropout_attn(h_attn)
        h_attn = h_in1 + h_attn
        h_attn = self.norm1_attn(h_attn)
        h_out_list.append(h_attn)
        h = sum(h_out_list)
        h = h + self._ff_block(h)
        h = self.norm2(h)
        return h

    def _sa_block(self, x, attn_mask, key_padding_mask):
        x = self.self_attn(x, x, x, attn_mask=attn_mask, key_padding_mask=key_padding_mask, need_weights=False)[0]
        return x

    def _ff_block(self, x):
        x = self.ff_dropout1(self.activation(self.ff_linear1(x)))
        return self.ff_dropout2(self.ff_linear2(x))


if __name__ == "__main__":
    torch.manual_seed(0)
    sizes = [5, 2, 8, 3]  # four graphs with different node counts
    batch = torch.cat([torch.full((n,), i, dtype=torch.long) for i, n in enumerate(sizes)])
    x = torch.randn(batch.numel(), 32)
    y = torch.randn(len(sizes))
    layers = nn.ModuleList([GPSLayer(32, 4) for _ in range(2)])
    head = nn.Linear(32, 1)
    opt = torch.optim.Adam(list(layers.parameters()) + list(head.parameters()), lr=1e-3)
    for step in range(3):
        h = x
        for layer in layers:
            h = layer(h, batch)
        pooled = torch.zeros(len(sizes), 32).index_add_(0, batch, h) / torch.tensor(sizes).unsqueeze(-1)
        loss = F.mse_loss(head(pooled).squeeze(-1), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    print("loss %.4f" % loss.item())
