# se3-transformer-pytorch (lucidrains/se3-transformer-pytorch commit 52deee1, "fix bug where rel dist may contain
# masking values used for ranking neighbors"), se3_transformer_pytorch/se3_transformer_pytorch.py, SE3Transformer.forward.
# The neighbour ranking was built as `modified_rel_dist = rel_dist`, an alias, and then filled in place: the bonded
# (adjacency) neighbours with 0 so that they rank first, the non-neighbours of a neighbor_mask with the dtype max. The
# same tensor is the rel_dist later gathered for the chosen neighbours and fed to every radial kernel, so each bonded
# neighbour's key and value were computed as if it sat at distance 0. The fix ranks on `rel_dist.clone()`.
# Trimmed to type-0 (degree 0) features, where the equivariant basis is the constant 1 and ConvSE3 reduces to the
# radial kernel applied to the gathered neighbour features; einops written as plain indexing.
import sys

import torch
import torch.nn.functional as F
from torch import nn, einsum

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


def exists(val):
    return val is not None


def batched_index_select(values, indices, dim = 1):
    value_dims = values.shape[(dim + 1):]
    values_shape, indices_shape = map(lambda t: list(t.shape), (values, indices))
    indices = indices[(..., *((None,) * len(value_dims)))]
    indices = indices.expand(*((-1,) * len(indices_shape)), *value_dims)
    value_expand_len = len(indices_shape) - (dim + 1)
    values = values[(*((slice(None),) * dim), *((None,) * value_expand_len), ...)]

    value_expand_shape = [-1] * len(values.shape)
    expand_slice = slice(dim, (dim + value_expand_len))
    value_expand_shape[expand_slice] = indices.shape[expand_slice]
    values = values.expand(*value_expand_shape)

    dim += value_expand_len
    return values.gather(dim, indices)


class RadialFunc(nn.Module):
    """NN parameterized radial profile function."""
    def __init__(self, num_freq, in_dim, out_dim, edge_dim = None, mid_dim = 128):
        super().__init__()
        self.num_freq = num_freq
        self.in_dim = in_dim
        self.mid_dim = mid_dim
        self.out_dim = out_dim
        self.edge_dim = edge_dim if exists(edge_dim) else 0

        self.net = nn.Sequential(
            nn.Linear(self.edge_dim + 1, mid_dim),
            nn.LayerNorm(mid_dim),
            nn.GELU(),
            nn.Linear(mid_dim, mid_dim),
            nn.LayerNorm(mid_dim),
            nn.GELU(),
            nn.Linear(mid_dim, num_freq * in_dim * out_dim)
        )

    def forward(self, x):
        y = self.net(x)
        # '... (o i f) -> ... o i' with f = 1 for the (0, 0) pair
        return y.view(*y.shape[:-1], self.out_dim, self.in_dim)


class ConvSE3(nn.Module):
    """type-0 -> type-0 tensor field network layer, pool = False, self_interaction = False"""
    def __init__(self, dim_in, dim_out, edge_dim = 0):
        super().__init__()
        self.kernel_unary = nn.ModuleDict({'(0,0)': RadialFunc(1, dim_in, dim_out, edge_dim)})

    def forward(self, inp, edge_info, rel_dist = None):
        neighbor_indices, neighbor_masks, edges = edge_info
        rel_dist = rel_dist[..., None]                                 # 'b m n -> b m n ()'

        x = batched_index_select(inp, neighbor_indices, dim = 1)       # b i j c
        edge_features = torch.cat((rel_dist, edges), dim = -1) if exists(edges) else rel_dist
        kernel = self.kernel_unary['(0,0)'](edge_features)             # b i j o c  (basis (0,0) == 1)
        return einsum('b i j o c, b i j c -> b i j o', kernel, x)


class AttentionSE3(nn.Module):
    def __init__(self, dim, dim_head = 64, heads = 8, attend_self = False, edge_dim = None):
        super().__init__()
        hidden_dim = dim_head * heads
        self.scale = dim_head ** -0.5
        self.heads = heads

        self.to_q = nn.Linear(dim, hidden_dim, bias = False)
        self.to_v = ConvSE3(dim, hidden_dim, edge_dim = edge_dim or 0)
        self.to_k = ConvSE3(dim, hidden_dim, edge_dim = edge_dim or 0)
        self.to_out = nn.Linear(hidden_dim, dim, bias = False)

        self.attend_self = attend_self
        if attend_self:
            self.to_self_k = nn.Linear(dim, hidden_dim, bias = False)
            self.to_self_v = nn.Linear(dim, hidden_dim, bias = False)

    def forward(self, features, edge_info, rel_dist):
        h, attend_self = self.heads, self.attend_self
        neighbor_indices, neighbor_mask, edges = edge_info

        max_neg_value = -torch.finfo().max

        if exists(neighbor_mask):
            neighbor_mask = neighbor_mask[:, None]                     # 'b i j -> b () i j'

        q = self.to_q(features)
        v = self.to_v(features, edge_info, rel_dist)
        k = self.to_k(features, edge_info, rel_dist)

        b, n, _ = q.shape
        q = q.view(b, n, h, -1).transpose(1, 2)                         # b h i d
        k, v = map(lambda t: t.view(*t.shape[:3], h, -1).permute(0, 3, 1, 2, 4), (k, v))  # b h i j d

        if attend_self:
            self_k, self_v = self.to_self_k(features), self.to_self_v(features)
            self_k, self_v = map(lambda t: t.view(b, n, h, -1).transpose(1, 2)[:, :, :, None], (self_k, self_v))
            k = torch.cat((self_k, k), dim = 3)
            v = torch.cat((self_v, v), dim = 3)

        sim = einsum('b h i d, b h i j d -> b h i j', q, k) * self.scale

        if exists(neighbor_mask):
            num_left_pad = sim.shape[-1] - neighbor_mask.shape[-1]
            mask = F.pad(neighbor_mask, (num_left_pad, 0), value = True)
            sim.masked_fill_(~mask, max_neg_value)

        attn = sim.softmax(dim = -1)
        out = einsum('b h i j, b h i j d -> b h i d', attn, v)
        out = out.transpose(1, 2).reshape(b, n, -1)                    # 'b h n d -> b n (h d)'
        return self.to_out(out)


class AttentionBlockSE3(nn.Module):
    def __init__(self, dim, dim_head = 24, heads = 8, attend_self = False, edge_dim = None):
        super().__init__()
        self.attn = AttentionSE3(dim, heads = heads, dim_head = dim_head, attend_self = attend_self, edge_dim = edge_dim)
        self.prenorm = nn.LayerNorm(dim)   # NormSE3 on type-0 features

    def forward(self, features, edge_info, rel_dist):
        res = features
        outputs = self.prenorm(features)
        outputs = self.attn(outputs, edge_info, rel_dist)
        return outputs + res


class SE3Transformer(nn.Module):
    def __init__(
        self,
        *,
        dim,
        heads = 8,
        dim_head = 24,
        depth = 2,
        valid_radius = 1e5,
        num_tokens = None,
        attend_self = True,
        num_neighbors = float('inf'),
        attend_sparse_neighbors = False,
        max_sparse_neighbors = float('inf'),
    ):
        super().__init__()
        self.token_emb = nn.Embedding(num_tokens, dim) if exists(num_tokens) else None
        self.valid_radius = valid_radius
        self.num_neighbors = num_neighbors
        self.attend_sparse_neighbors = attend_sparse_neighbors
        self.max_sparse_neighbors = max_sparse_neighbors
        self.causal = False
        self.layers = nn.ModuleList([
            AttentionBlockSE3(dim, heads = heads, dim_head = dim_head, attend_self = attend_self)
            for _ in range(depth)
        ])

    def forward(self, feats, coors, mask = None, adj_mat = None, edges = None, neighbor_mask = None):
        if exists(self.token_emb):
            feats = self.token_emb(feats)

        assert not (self.attend_sparse_neighbors and not exists(adj_mat)), 'adjacency matrix (adjacency_mat) or edges (edges) must be passed in'

        b, n, d, device = *feats.shape, feats.device

        neighbors, max_sparse_neighbors, valid_radius = self.num_neighbors, self.max_sparse_neighbors, self.valid_radius

        # se3 transformer by default cannot have a node attend to itself

        exclude_self_mask = (~torch.eye(n, dtype = torch.bool, device = device))[None]
        remove_self = lambda t: t.masked_select(exclude_self_mask).reshape(b, n, n - 1)
        get_max_value = lambda t: torch.finfo(t.dtype).max

        # calculate sparsely connected neighbors

        sparse_neighbor_mask = None
        num_sparse_neighbors = 0

        if self.attend_sparse_neighbors:
            assert exists(adj_mat), 'adjacency matrix must be passed in (keyword argument adj_mat)'

            if exists(adj_mat):
                if len(adj_mat.shape) == 2:
                    adj_mat = adj_mat[None].expand(b, -1, -1)

            adj_mat = remove_self(adj_mat)

            adj_mat_values = adj_mat.float()
            adj_mat_max_neighbors = adj_mat_values.sum(dim = -1).max().item()

            if max_sparse_neighbors < adj_mat_max_neighbors:
                noise = torch.empty_like(adj_mat_values).uniform_(-0.01, 0.01)
                adj_mat_values += noise

            num_sparse_neighbors = int(min(max_sparse_neighbors, adj_mat_max_neighbors))
            values, indices = adj_mat_values.topk(num_sparse_neighbors, dim = -1)
            sparse_neighbor_mask = torch.zeros_like(adj_mat_values).scatter_(-1, indices, values)
            sparse_neighbor_mask = sparse_neighbor_mask > 0.5

        # exclude edge of token to itself

        indices = torch.arange(n, device = device)[None, :, None].expand(b, n, n)
        rel_pos  = coors[:, :, None, :] - coors[:, None, :, :]

        indices = indices.masked_select(exclude_self_mask).reshape(b, n, n - 1)
        rel_pos = rel_pos.masked_select(exclude_self_mask[..., None]).reshape(b, n, n - 1, 3)

        if exists(mask):
            mask = mask[:, :, None] * mask[:, None, :]
            mask = mask.masked_select(exclude_self_mask).reshape(b, n, n - 1)

        rel_dist = rel_pos.norm(dim = -1)

        # rel_dist gets modified using adjacency or neighbor mask

        modified_rel_dist = rel_dist.clone() if FIXED else rel_dist
        max_value = get_max_value(modified_rel_dist) # for masking out nodes from being considered as neighbors

        # neighbors

        if exists(neighbor_mask):
            neighbor_mask = remove_self(neighbor_mask)

            max_neighbors = neighbor_mask.sum(dim = -1).max().item()
            if max_neighbors > neighbors:
                print(f'neighbor_mask shows maximum number of neighbors as {max_neighbors} but specified number of neighbors is {neighbors}')

            modified_rel_dist.masked_fill_(~neighbor_mask, max_value)

        # use sparse neighbor mask to assign priority of bonded

        if exists(sparse_neighbor_mask):
            modified_rel_dist.masked_fill_(sparse_neighbor_mask, 0.)

        # if number of local neighbors by distance is set to 0, then only fetch the sparse neighbors defined by adjacency matrix

        if neighbors == 0:
            valid_radius = 0

        # get neighbors and neighbor mask, excluding self

        neighbors = int(min(neighbors, n - 1))
        total_neighbors = int(neighbors + num_sparse_neighbors)
        assert total_neighbors > 0, 'you must be fetching at least 1 neighbor'

        total_neighbors = int(min(total_neighbors, n - 1)) # make sure total neighbors does not exceed the length of the sequence itself

        dist_values, nearest_indices = modified_rel_dist.topk(total_neighbors, dim = -1, largest = False)
        neighbor_mask = dist_values <= valid_radius

        neighbor_rel_dist = batched_index_select(rel_dist, nearest_indices, dim = 2)
        neighbor_indices = batched_index_select(indices, nearest_indices, dim = 2)

        if exists(mask):
            neighbor_mask = neighbor_mask & batched_index_select(mask, nearest_indices, dim = 2)

        edge_info = (neighbor_indices, neighbor_mask, edges)
        x = feats

        for layer in self.layers:
            x = layer(x, edge_info, rel_dist = neighbor_rel_dist)

        return x


# two small molecules (atom-type tokens, 3D coordinates, bond adjacency), the second padded from 7 to 9 atoms
model = SE3Transformer(
    num_tokens = 10,
    dim = 16,
    heads = 2,
    dim_head = 8,
    depth = 2,
    num_neighbors = 2,
    attend_sparse_neighbors = True,
    max_sparse_neighbors = 2,
)

lengths = [9, 7]
n = max(lengths)
atoms = torch.zeros(2, n, dtype = torch.long)
coors = torch.zeros(2, n, 3)
mask = torch.zeros(2, n, dtype = torch.bool)
adj_mat = torch.zeros(2, n, n, dtype = torch.bool)
for b, length in enumerate(lengths):
    atoms[b, :length] = torch.randint(1, 10, (length,))
    coors[b, :length] = torch.randn(length, 3) * 1.5
    mask[b, :length] = True
    i = torch.arange(length - 1)
    adj_mat[b, i, i + 1] = True     # a chain of bonds
    adj_mat[b, i + 1, i] = True

with torch.no_grad():
    out = model(atoms, coors, mask = mask, adj_mat = adj_mat)

for b, length in enumerate(lengths):
    print(f"molecule {b}: type-0 features of real atoms, [:, :4]\n", out[b, :length, :4])
