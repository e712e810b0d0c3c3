# pytorch_geometric GATConv (pyg-team/pytorch_geometric#224, fix commit 6fe33a2ab): the attention
# softmax was normalised over edge_index[0] (the source j) instead of the target i that aggregates,
# so each node's neighbour weights do not sum to one and mix other nodes' neighbourhoods.
import sys
import torch
import torch.nn.functional as F
from torch.nn import Parameter

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


# ---- torch_scatter / torch_geometric.utils stand-ins (same semantics) ----
def scatter_add(src, index, dim=0, dim_size=None):
    out = src.new_zeros((dim_size,) + src.shape[1:])
    return out.index_add_(0, index, src)


def scatter_max(src, index, dim=0, dim_size=None):
    out = src.new_full((dim_size,) + src.shape[1:], float("-inf"))
    idx = index.view(-1, *([1] * (src.dim() - 1))).expand_as(src)
    out = out.scatter_reduce(0, idx, src, reduce="amax", include_self=True)
    out = torch.where(torch.isinf(out), torch.zeros_like(out), out)
    return out, None


def scatter_(name, src, index, dim_size=None):
    assert name == "add"
    return scatter_add(src, index, 0, dim_size)


def softmax(src, index, num_nodes=None):
    out = src - scatter_max(src, index, dim=0, dim_size=num_nodes)[0][index]
    out = out.exp()
    out = out / (scatter_add(out, index, dim=0, dim_size=num_nodes)[index] + 1e-16)
    return out


def remove_self_loops(edge_index, edge_attr=None):
    row, col = edge_index
    mask = row != col
    mask = mask.unsqueeze(0).expand_as(edge_index)
    edge_index = edge_index[mask].view(2, -1)
    return edge_index, edge_attr


def add_self_loops(edge_index, num_nodes=None):
    loop = torch.arange(0, num_nodes, dtype=edge_index.dtype)
    loop = loop.unsqueeze(0).repeat(2, 1)
    return torch.cat([edge_index, loop], dim=1)


def glorot(t):
    stdv = (6.0 / (t.size(-2) + t.size(-1))) ** 0.5
    t.data.uniform_(-stdv, stdv)


class MessagePassing(torch.nn.Module):
    def __init__(self, aggr="add", flow="source_to_target"):
        super().__init__()
        self.aggr = aggr
        self.flow = flow

    def propagate(self, edge_index, x, num_nodes):
        i, j = (0, 1) if self.flow == "target_to_source" else (1, 0)
        x_i = torch.index_select(x, 0, edge_index[i])
        x_j = torch.index_select(x, 0, edge_index[j])
        out = self.message(edge_index, x_i, x_j, num_nodes)
        out = scatter_(self.aggr, out, edge_index[i], dim_size=num_nodes)
        return self.update(out)


class GATConv(MessagePassing):
    def __init__(self, in_channels, out_channels, heads=1, concat=True, negative_slope=0.2, dropout=0, bias=True):
        super().__init__("add")
        self.in_channels, self.out_channels, self.heads = in_channels, out_channels, heads
        self.concat, self.negative_slope, self.dropout = concat, negative_slope, dropout
        self.weight = Parameter(torch.Tensor(in_channels, heads * out_channels))
        self.att = Parameter(torch.Tensor(1, heads, 2 * out_channels))
        self.bias = Parameter(torch.zeros(heads * out_channels))
        glorot(self.weight)
        glorot(self.att)

    def forward(self, x, edge_index):
        edge_index, _ = remove_self_loops(edge_index)
        edge_index = add_self_loops(edge_index, num_nodes=x.size(0))
        x = torch.mm(x, self.weight).view(-1, self.heads, self.out_channels)
        return self.propagate(edge_index, x=x, num_nodes=x.size(0))

    def message(self, edge_index, x_i, x_j, num_nodes):
        alpha = (torch.cat([x_i, x_j], dim=-1) * self.att).sum(dim=-1)
        alpha = F.leaky_relu(alpha, self.negative_slope)
        if FIXED:
            i = 0 if self.flow == "target_to_source" else 1
            alpha = softmax(alpha, edge_index[i], num_nodes)
        else:
            alpha = softmax(alpha, edge_index[0], num_nodes)
        if self.training and self.dropout > 0:
            alpha = F.dropout(alpha, p=self.dropout, training=True)
        return x_j * alpha.view(-1, self.heads, 1)

    def update(self, aggr_out):
        aggr_out = aggr_out.view(-1, self.heads * self.out_channels)
        return aggr_out + self.bias


# a small directed graph (edge_index[0] = source j, edge_index[1] = target i)
N, D_IN, D_OUT, H = 10, 16, 8, 2
x = torch.randn(N, D_IN)
src = torch.randint(0, N, (30,))
dst = torch.randint(0, N, (30,))
edge_index = torch.unique(torch.stack([src, dst]), dim=1)

conv = GATConv(D_IN, D_OUT, heads=H).eval()
with torch.no_grad():
    out = conv(x, edge_index)

    # reference: dense GAT, each target i attends over its in-neighbours j (+ itself)
    ei, _ = remove_self_loops(edge_index)
    ei = add_self_loops(ei, num_nodes=N)
    adj = torch.zeros(N, N, dtype=torch.bool)  # adj[i, j]: j -> i
    adj[ei[1], ei[0]] = True
    hx = torch.mm(x, conv.weight).view(N, H, D_OUT)
    a_i = (hx * conv.att[:, :, :D_OUT]).sum(-1)  # N x H
    a_j = (hx * conv.att[:, :, D_OUT:]).sum(-1)
    e = F.leaky_relu(a_i[:, None, :] + a_j[None, :, :], 0.2)  # i x j x H
    e = e.masked_fill(~adj[:, :, None], float("-inf"))
    att = e.softmax(dim=1)
    ref = torch.einsum("ijh,jhd->ihd", att, hx).reshape(N, H * D_OUT) + conv.bias

print(f"max |GATConv - dense masked GAT| = {(out - ref).abs().max().item():.6f}")
