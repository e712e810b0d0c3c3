# pyg-team/pytorch_geometric#6343 (commit 9aeebac28d3dce300295ac36aa0131a98d29a05d, "Re-work GraphMultisetTransformer"; before/after read)
# Before the re-work, MAB added the -1e9 padding mask of to_dense_batch to the scores and then took the softmax over
# dim 1 (the seeds), not over the keys: the same -1e9 shift cancels in each key column, so every seed attends to the
# padded zero rows of smaller graphs. The re-work uses nn.MultiheadAttention with key_padding_mask=~mask.
import math
import sys
from typing import List, Optional, Tuple, Type

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn import LayerNorm, Linear, MultiheadAttention, Parameter

FIXED = "--fixed" in sys.argv


def to_dense_batch(x, batch, fill_value=0., max_num_nodes=None, batch_size=None):
    if batch_size is None:
        batch_size = int(batch.max()) + 1
    num_nodes = torch.zeros(batch_size, dtype=torch.long).scatter_add_(0, batch, batch.new_ones(x.size(0)))
    cum_nodes = torch.cat([batch.new_zeros(1), num_nodes.cumsum(dim=0)])
    if max_num_nodes is None:
        max_num_nodes = int(num_nodes.max())
    idx = torch.arange(batch.size(0), device=x.device) - cum_nodes[batch]
    idx = idx + batch * max_num_nodes
    size = [batch_size * max_num_nodes] + list(x.size())[1:]
    out = x.new_full(size, fill_value)
    out[idx] = x
    out = out.view([batch_size, max_num_nodes] + list(x.size())[1:])
    mask = torch.zeros(batch_size * max_num_nodes, dtype=torch.bool, device=x.device)
    mask[idx] = 1
    mask = mask.view(batch_size, max_num_nodes)
    return out, mask


class GCNConv(torch.nn.Module):
    def __init__(self, in_channels, out_channels):
        super().__init__()
        self.lin = Linear(in_channels, out_channels, bias=False)
        self.bias = Parameter(torch.zeros(out_channels))

    def reset_parameters(self):
        self.lin.reset_parameters()
        self.bias.data.zero_()

    def forward(self, x, edge_index):
        n = x.size(0)
        loop = torch.arange(n)
        row, col = torch.cat([edge_index, torch.stack([loop, loop])], dim=1)
        deg = torch.zeros(n).index_add_(0, col, torch.ones(col.numel()))
        dis = deg.pow(-0.5)
        norm = dis[row] * dis[col]
        x = self.lin(x)
        out = torch.zeros_like(x).index_add_(0, col, x[row] * norm.view(-1, 1))
        return out + self.bias


class Aggregation(torch.nn.Module):
    def to_dense_batch(self, x, index=None, ptr=None, dim_size=None, dim=-2):
        return to_dense_batch(x, index, batch_size=dim_size)


# ----- torch_geometric/nn/aggr/gmt.py before #6343 -----

class MAB(torch.nn.Module):
    r"""Multihead-Attention Block."""
    def __init__(self, dim_Q: int, dim_K: int, dim_V: int, num_heads: int,
                 Conv: Optional[Type] = None, layer_norm: bool = False):
        super().__init__()
        self.dim_V = dim_V
        self.num_heads = num_heads
        self.layer_norm = layer_norm
        self.fc_q = Linear(dim_Q, dim_V)
        if Conv is None:
            self.layer_k = Linear(dim_K, dim_V)
            self.layer_v = Linear(dim_K, dim_V)
        else:
            self.layer_k = Conv(dim_K, dim_V)
            self.layer_v = Conv(dim_K, dim_V)
        if layer_norm:
            self.ln0 = LayerNorm(dim_V)
            self.ln1 = LayerNorm(dim_V)
        self.fc_o = Linear(dim_V, dim_V)

    def reset_parameters(self):
        self.fc_q.reset_parameters()
        self.layer_k.reset_parameters()
        self.layer_v.reset_parameters()
        if self.layer_norm:
            self.ln0.reset_parameters()
            self.ln1.reset_parameters()
        self.fc_o.reset_parameters()

    def forward(self, Q: Tensor, K: Tensor, graph: Optional[Tuple[Tensor, Tensor, Tensor]] = None,
                mask: Optional[Tensor] = None) -> Tensor:
        Q = self.fc_q(Q)
        if graph is not None:
            x, edge_index, batch = graph
            K, V = self.layer_k(x, edge_index), self.layer_v(x, edge_index)
            K, _ = to_dense_batch(K, batch)
            V, _ = to_dense_batch(V, batch)
        else:
            K, V = self.layer_k(K), self.layer_v(K)

        dim_split = self.dim_V // self.num_heads
        Q_ = torch.cat(Q.split(dim_split, 2), dim=0)
        K_ = torch.cat(K.split(dim_split, 2), dim=0)
        V_ = torch.cat(V.split(dim_split, 2), dim=0)

        if mask is not None:
            mask = torch.cat([mask for _ in range(self.num_heads)], 0)
            attention_score = Q_.bmm(K_.transpose(1, 2))
            attention_score = attention_score / math.sqrt(self.dim_V)
            A = torch.softmax(mask + attention_score, 1)
        else:
            A = torch.softmax(Q_.bmm(K_.transpose(1, 2)) / math.sqrt(self.dim_V), 2)

        out = torch.cat((Q_ + A.bmm(V_)).split(Q.size(0), 0), 2)
        if self.layer_norm:
            out = self.ln0(out)
        out = out + self.fc_o(out).relu()
        if self.layer_norm:
            out = self.ln1(out)
        return out


class SAB(torch.nn.Module):
    r"""Self-Attention Block."""
    def __init__(self, in_channels, out_channels, num_heads, Conv=None, layer_norm=False):
        super().__init__()
        self.mab = MAB(in_channels, in_channels, out_channels, num_heads, Conv=Conv, layer_norm=layer_norm)

    def forward(self, x, graph=None, mask=None):
        return self.mab(x, x, graph, mask)


class PMA(torch.nn.Module):
    r"""Graph pooling with Multihead-Attention."""
    def __init__(self, channels, num_heads, num_seeds, Conv=None, layer_norm=False):
        super().__init__()
        self.S = torch.nn.Parameter(torch.Tensor(1, num_seeds, channels))
        self.mab = MAB(channels, channels, channels, num_heads, Conv=Conv, layer_norm=layer_norm)
        self.reset_parameters()

    def reset_parameters(self):
        torch.nn.init.xavier_uniform_(self.S)
        self.mab.reset_parameters()

    def forward(self, x, graph=None, mask=None):
        return self.mab(self.S.repeat(x.size(0), 1, 1), x, graph, mask)


class GraphMultisetTransformerOld(Aggregation):
    def __init__(self, in_channels: int, hidden_channels: int, out_channels: int, Conv: Optional[Type] = None,
                 num_nodes: int = 300, pooling_ratio: float = 0.25,
                 pool_sequences: List[str] = ['GMPool_G', 'SelfAtt', 'GMPool_I'],
                 num_heads: int = 4, layer_norm: bool = False):
        super().__init__()
        self.in_channels = in_channels
        self.hidden_channels = hidden_channels
        self.out_channels = out_channels
        self.Conv = Conv or GCNConv
        self.num_nodes = num_nodes
        self.pooling_ratio = pooling_ratio
        self.pool_sequences = pool_sequences
        self.num_heads = num_heads
        self.layer_norm = layer_norm

        self.lin1 = Linear(in_channels, hidden_channels)
        self.lin2 = Linear(hidden_channels, out_channels)

        self.pools = torch.nn.ModuleList()
        num_out_nodes = math.ceil(num_nodes * pooling_ratio)
        for i, pool_type in enumerate(pool_sequences):
            if i == len(pool_sequences) - 1:
                num_out_nodes = 1
            if pool_type == 'GMPool_G':
                self.pools.append(PMA(hidden_channels, num_heads, num_out_nodes, Conv=self.Conv, layer_norm=layer_norm))
                num_out_nodes = math.ceil(num_out_nodes * self.pooling_ratio)
            elif pool_type == 'GMPool_I':
                self.pools.append(PMA(hidden_channels, num_heads, num_out_nodes, Conv=None, layer_norm=layer_norm))
                num_out_nodes = math.ceil(num_out_nodes * self.pooling_ratio)
            elif pool_type == 'SelfAtt':
                self.pools.append(SAB(hidden_channels, hidden_channels, num_heads, Conv=None, layer_norm=layer_norm))

    def forward(self, x, index=None, ptr=None, dim_size=None, dim=-2, edge_index=None):
        x = self.lin1(x)
        batch_x, mask = self.to_dense_batch(x, index, ptr, dim_size, dim)
        mask = (~mask).unsqueeze(1).to(dtype=x.dtype) * -1e9

        for i, (name, pool) in enumerate(zip(self.pool_sequences, self.pools)):
            graph = (x, edge_index, index) if name == 'GMPool_G' else None
            batch_x = pool(batch_x, graph, mask)
            mask = None

        return self.lin2(batch_x.squeeze(1))


# ----- torch_geometric/nn/aggr/utils.py + gmt.py after #6343 -----

class MultiheadAttentionBlock(torch.nn.Module):
    def __init__(self, channels: int, heads: int = 1, layer_norm: bool = True):
        super().__init__()
        self.channels = channels
        self.heads = heads
        self.attn = MultiheadAttention(channels, heads, batch_first=True)
        self.lin = Linear(channels, channels)
        self.layer_norm1 = LayerNorm(channels) if layer_norm else None
        self.layer_norm2 = LayerNorm(channels) if layer_norm else None

    def forward(self, x: Tensor, y: Tensor, x_mask: Optional[Tensor] = None,
                y_mask: Optional[Tensor] = None) -> Tensor:
        if y_mask is not None:
            y_mask = ~y_mask
        out, _ = self.attn(x, y, y, y_mask, need_weights=False)
        if x_mask is not None:
            out[~x_mask] = 0.
        out = out + x
        if self.layer_norm1 is not None:
            out = self.layer_norm1(out)
        out = out + self.lin(out).relu()
        if self.layer_norm2 is not None:
            out = self.layer_norm2(out)
        return out


class SetAttentionBlock(torch.nn.Module):
    def __init__(self, channels: int, heads: int = 1, layer_norm: bool = True):
        super().__init__()
        self.mab = MultiheadAttentionBlock(channels, heads, layer_norm)

    def forward(self, x: Tensor, mask: Optional[Tensor] = None) -> Tensor:
        return self.mab(x, x, mask, mask)


class PoolingByMultiheadAttention(torch.nn.Module):
    def __init__(self, channels: int, num_seed_points: int = 1, heads: int = 1, layer_norm: bool = True):
        super().__init__()
        self.lin = Linear(channels, channels)
        self.seed = Parameter(torch.Tensor(1, num_seed_points, channels))
        self.mab = MultiheadAttentionBlock(channels, heads, layer_norm)
        torch.nn.init.xavier_uniform_(self.seed)

    def forward(self, x: Tensor, mask: Optional[Tensor] = None) -> Tensor:
        x = self.lin(x).relu()
        return self.mab(self.seed.expand(x.size(0), -1, -1), x, y_mask=mask)


class GraphMultisetTransformer(Aggregation):
    def __init__(self, channels: int, k: int, num_encoder_blocks: int = 1, heads: int = 1,
                 layer_norm: bool = False):
        super().__init__()
        self.pma1 = PoolingByMultiheadAttention(channels, k, heads, layer_norm)
        self.encoders = torch.nn.ModuleList([
            SetAttentionBlock(channels, heads, layer_norm) for _ in range(num_encoder_blocks)])
        self.pma2 = PoolingByMultiheadAttention(channels, 1, heads, layer_norm)

    def forward(self, x, index=None, ptr=None, dim_size=None, dim=-2):
        x, mask = self.to_dense_batch(x, index, ptr, dim_size, dim)
        x = self.pma1(x, mask)
        for encoder in self.encoders:
            x = encoder(x)
        x = self.pma2(x)
        return x.squeeze(1)


# ----- examples/proteins_gmt.py -----

num_features, num_classes = 8, 2


class Net(torch.nn.Module):
    def __init__(self, avg_num_nodes):
        super().__init__()
        self.conv1 = GCNConv(num_features, 32)
        self.conv2 = GCNConv(32, 32)
        self.conv3 = GCNConv(32, 32)
        if FIXED:
            self.pool = GraphMultisetTransformer(96, k=10, heads=4)
            self.lin1 = Linear(96, 16)
        else:
            self.pool = GraphMultisetTransformerOld(
                in_channels=96, hidden_channels=64, out_channels=32, Conv=GCNConv,
                num_nodes=avg_num_nodes, pooling_ratio=0.25,
                pool_sequences=['GMPool_G', 'SelfAtt', 'GMPool_I'], num_heads=4, layer_norm=False)
            self.lin1 = Linear(32, 16)
        self.lin2 = Linear(16, num_classes)

    def forward(self, x0, edge_index, batch):
        x1 = self.conv1(x0, edge_index).relu()
        x2 = self.conv2(x1, edge_index).relu()
        x3 = self.conv3(x2, edge_index).relu()
        x = torch.cat([x1, x2, x3], dim=-1)
        if FIXED:
            x = self.pool(x, batch)
        else:
            x = self.pool(x, batch, edge_index=edge_index)
        x = self.lin1(x).relu()
        x = F.dropout(x, p=0.5, training=self.training)
        return self.lin2(x)


def make_batch(sizes):
    xs, edges, batch, off = [], [], [], 0
    for g, n in enumerate(sizes):
        xs.append(torch.randn(n, num_features))
        src = torch.arange(n)
        dst = (src + 1) % n
        e = torch.cat([torch.stack([src, dst]), torch.stack([dst, src])], dim=1)
        edges.append(e + off)
        batch.append(torch.full((n,), g, dtype=torch.long))
        off += n
    return torch.cat(xs), torch.cat(edges, dim=1), torch.cat(batch)


torch.manual_seed(0)
sizes = [5, 12, 8, 20]
x, edge_index, batch = make_batch(sizes)
y = torch.tensor([0, 1, 0, 1])
model = Net(avg_num_nodes=sum(sizes) // len(sizes))
optimizer = torch.optim.Adam(model.parameters(), lr=0.001, weight_decay=1e-4)

model.train()
for step in range(3):
    optimizer.zero_grad()
    out = model(x, edge_index, batch)
    loss = F.cross_entropy(out, y)
    loss.backward()
    optimizer.step()
print(f"loss {loss.item():.4f}")
