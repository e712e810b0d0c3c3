# egnn-pytorch (lucidrains/egnn-pytorch commit e1f6a29, "fix potential bug when using nearest neighbors"),
# egnn_pytorch/egnn_pytorch.py, EGNN.forward. With num_nearest_neighbors > 0 and a padded batch, the neighbours were
# ranked by distance over every atom slot, padding included: the padded atoms (coordinates left at the origin) could
# take some of a real atom's k nearest slots, and were then only masked out of the message mean, so real atoms
# aggregated fewer real neighbours than asked. The fix fills the ranking of padded keys with 1e5 before the topk.
# (einops' rearrange/repeat are written here as plain indexing; torch_geometric imports dropped.)
import sys

import torch
from torch import nn, einsum, broadcast_tensors
import torch.nn.functional as F


FIXED = "--fixed" in sys.argv
torch.manual_seed(0)

# helper functions

def exists(val):
    return val is not None

def safe_div(num, den, eps = 1e-8):
    return num.div(den + eps)

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

def fourier_encode_dist(x, num_encodings = 4, include_self = True):
    x = x.unsqueeze(-1)
    device, dtype, orig_x = x.device, x.dtype, x
    scales = 2 ** torch.arange(num_encodings, device = device, dtype = dtype)
    x = x / scales
    x = torch.cat([x.sin(), x.cos()], dim=-1)
    x = torch.cat((x, orig_x), dim = -1) if include_self else x
    return x

SiLU = nn.SiLU

# classes

class EGNN(nn.Module):
    def __init__(
        self,
        dim,
        edge_dim = 0,
        m_dim = 16,
        fourier_features = 0,
        norm_rel_coors = False,
        norm_coor_weights = False,
        num_nearest_neighbors = 0,
        dropout = 0.0,
        init_eps = 1e-3,
        norm_feats = False,
        update_feats = True,
        update_coors = True,
        only_sparse_neighbors = False,
        valid_radius = float('inf'),
    ):
        super().__init__()
        assert update_feats or update_coors, 'you must update either features, coordinates, or both'

        self.fourier_features = fourier_features

        edge_input_dim = (fourier_features * 2) + (dim * 2) + edge_dim + 1
        dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()

        self.edge_mlp = nn.Sequential(
            nn.Linear(edge_input_dim, edge_input_dim * 2),
            dropout,
            SiLU(),
            nn.Linear(edge_input_dim * 2, m_dim),
            SiLU()
        )

        self.node_norm = nn.LayerNorm(dim) if norm_feats else nn.Identity()

        self.node_mlp = nn.Sequential(
            nn.Linear(dim + m_dim, dim * 2),
            dropout,
            SiLU(),
            nn.Linear(dim * 2, dim),
        ) if update_feats else None

        self.norm_coor_weights = norm_coor_weights
        self.norm_rel_coors = norm_rel_coors

        if norm_rel_coors:
            self.rel_coors_scale = nn.Parameter(torch.ones(1))

        self.coors_mlp = nn.Sequential(
            nn.Linear(m_dim, m_dim * 4),
            dropout,
            SiLU(),
            nn.Linear(m_dim * 4, 1)
        ) if update_coors else None

        self.num_nearest_neighbors = num_nearest_neighbors
        self.only_sparse_neighbors = only_sparse_neighbors
        self.valid_radius = valid_radius

        self.init_eps = init_eps
        self.apply(self.init_)

    def init_(self, module):
        if type(module) in {nn.Linear}:
            # seems to be needed to keep the network from exploding to NaN with greater depths
            nn.init.normal_(module.weight, std = self.init_eps)

    def forward(self, feats, coors, edges = None, mask = None, adj_mat = None):
        b, n, d, device, fourier_features, num_nearest, valid_radius, only_sparse_neighbors = *feats.shape, feats.device, self.fourier_features, self.num_nearest_neighbors, self.valid_radius, self.only_sparse_neighbors
        use_nearest = num_nearest > 0

        rel_coors = coors[:, :, None, :] - coors[:, None, :, :]
        rel_dist = (rel_coors ** 2).sum(dim = -1, keepdim = True)

        i = j = n

        if use_nearest:
            ranking = rel_dist[..., 0]

            if FIXED:
                if exists(mask):
                    rank_mask = mask[:, None, :] * mask[:, None, :]
                    ranking.masked_fill_(~rank_mask, 1e5)

            if exists(adj_mat):
                if len(adj_mat.shape) == 2:
                    adj_mat = adj_mat[None].expand(b, -1, -1).clone()

                if only_sparse_neighbors:
                    num_nearest = int(adj_mat.float().sum(dim = -1).max().item())
                    valid_radius = 0

                self_mask = torch.eye(n, device = device, dtype = torch.bool)[None]

                ranking.masked_fill_(self_mask, -1.)
                adj_mat.masked_fill_(self_mask, False)
                ranking.masked_fill_(adj_mat, 0.)

            nbhd_ranking, nbhd_indices = ranking.topk(num_nearest, dim = -1, largest = False)

            nbhd_mask = nbhd_ranking <= valid_radius

            rel_coors = batched_index_select(rel_coors, nbhd_indices, dim = 2)
            rel_dist = batched_index_select(rel_dist, nbhd_indices, dim = 2)

            if exists(edges):
                edges = batched_index_select(edges, nbhd_indices, dim = 2)

            j = num_nearest

        if fourier_features > 0:
            rel_dist = fourier_encode_dist(rel_dist, num_encodings = fourier_features)
            rel_dist = rel_dist.squeeze(-2)

        if use_nearest:
            feats_j = batched_index_select(feats, nbhd_indices, dim = 1)
        else:
            feats_j = feats[:, None, :, :]

        feats_i = feats[:, :, None, :]
        feats_i, feats_j = broadcast_tensors(feats_i, feats_j)

        edge_input = torch.cat((feats_i, feats_j, rel_dist), dim = -1)

        if exists(edges):
            edge_input = torch.cat((edge_input, edges), dim = -1)

        m_ij = self.edge_mlp(edge_input)

        if exists(mask):
            mask_i = mask[:, :, None]

            if use_nearest:
                mask_j = batched_index_select(mask, nbhd_indices, dim = 1)
                mask = (mask_i * mask_j) & nbhd_mask
            else:
                mask_j = mask[:, None, :]
                mask = mask_i * mask_j

        if exists(self.coors_mlp):
            coor_weights = self.coors_mlp(m_ij)
            coor_weights = coor_weights.squeeze(-1)

            if self.norm_coor_weights:
                coor_weights = coor_weights.tanh()

            if self.norm_rel_coors:
                rel_coors = F.normalize(rel_coors, dim = -1) * self.rel_coors_scale

            if exists(mask):
                coor_weights.masked_fill_(~mask, 0.)

            coors_out = einsum('b i j, b i j c -> b i c', coor_weights, rel_coors) + coors
        else:
            coors_out = coors

        if exists(self.node_mlp):
            if exists(mask):
                # masked mean
                m_ij = m_ij.masked_fill(~mask[..., None], 0.)
                mask_sum = mask.sum(dim = -1)[..., None]
                m_i = safe_div(m_ij.sum(dim = -2), mask_sum)
                m_i = m_i.masked_fill(mask_sum == 0, 0.)
            else:
                m_i = m_ij.mean(dim = -2)

            normed_feats = self.node_norm(feats)
            node_mlp_input = torch.cat((normed_feats, m_i), dim = -1)
            node_out = self.node_mlp(node_mlp_input) + feats
        else:
            node_out = feats

        return node_out, coors_out

class EGNN_Network(nn.Module):
    def __init__(
        self,
        *,
        depth,
        dim,
        num_tokens = None,
        num_edge_tokens = None,
        edge_dim = 0,
        **kwargs
    ):
        super().__init__()
        self.token_emb = nn.Embedding(num_tokens, dim) if exists(num_tokens) else None
        self.edge_emb = nn.Embedding(num_edge_tokens, edge_dim) if exists(num_edge_tokens) else None

        self.layers = nn.ModuleList([])
        for _ in range(depth):
            self.layers.append(EGNN(dim = dim, edge_dim = edge_dim, norm_feats = True, **kwargs))

    def forward(self, feats, coors, adj_mat = None, edges = None, mask = None):
        if exists(self.token_emb):
            feats = self.token_emb(feats)

        if exists(edges) and exists(self.edge_emb):
            edges = self.edge_emb(edges)

        for layer in self.layers:
            feats, coors = layer(feats, coors, adj_mat = adj_mat, edges = edges, mask = mask)

        return feats, coors


# a batch of two residue chains (21 amino-acid tokens, CA coordinates), the second one padded from 5 to 8 residues;
# padded slots keep token 0 and coordinates (0, 0, 0), as the sidechainnet loader pads them
net = EGNN_Network(num_tokens = 21, depth = 2, dim = 16, num_nearest_neighbors = 3, init_eps = 0.1)

lengths = [8, 5]
n = max(lengths)
seqs = torch.zeros(2, n, dtype = torch.long)
coors = torch.zeros(2, n, 3)
mask = torch.zeros(2, n, dtype = torch.bool)
for b, length in enumerate(lengths):
    seqs[b, :length] = torch.randint(1, 21, (length,))
    # a chain laid out along x with 3.8 A steps, starting 4 A from the origin
    coors[b, :length] = torch.stack([4.0 + 3.8 * torch.arange(length).float(), torch.randn(length), torch.randn(length)], dim = -1)
    mask[b, :length] = True

with torch.no_grad():
    feats_out, coors_out = net(seqs, coors, mask = mask)

for b, length in enumerate(lengths):
    print(f"chain {b}: feats[:, :4] of real residues\n", feats_out[b, :length, :4])
    print(f"chain {b}: denoised coords of real residues\n", coors_out[b, :length])
