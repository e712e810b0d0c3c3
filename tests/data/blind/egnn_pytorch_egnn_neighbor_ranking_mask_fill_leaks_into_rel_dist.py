# lucidrains/egnn-pytorch commit 878dd8e ("fix bug where rel dist may contain masking value"):
# EGNN ranked neighbours on a view of rel_dist, so the in-place neighbour/adjacency mask fills
# (1e5 for padding, -1 for self, 0 for bonded atoms) overwrote the distances fed to the edge MLP.
import sys
import torch
from torch import nn, einsum, broadcast_tensors

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


def exists(val):
    return val is not None


def batched_index_select(values, indices, dim=1):
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


class EGNN(nn.Module):
    def __init__(self, dim, edge_dim=0, m_dim=16, num_nearest_neighbors=0, init_eps=1e-3,
                 only_sparse_neighbors=False, valid_radius=float("inf"), m_pool_method="sum"):
        super().__init__()
        edge_input_dim = (dim * 2) + edge_dim + 1
        self.edge_mlp = nn.Sequential(nn.Linear(edge_input_dim, edge_input_dim * 2), nn.SiLU(),
                                      nn.Linear(edge_input_dim * 2, m_dim), nn.SiLU())
        self.node_norm = nn.Identity()
        self.coors_norm = nn.Identity()
        self.m_pool_method = m_pool_method
        self.node_mlp = nn.Sequential(nn.Linear(dim + m_dim, dim * 2), nn.SiLU(), nn.Linear(dim * 2, dim))
        self.coors_mlp = nn.Sequential(nn.Linear(m_dim, m_dim * 4), nn.SiLU(), nn.Linear(m_dim * 4, 1))
        self.num_nearest_neighbors = num_nearest_neighbors
        self.only_sparse_neighbors = only_sparse_neighbors
        self.valid_radius = valid_radius
        self.init_eps = init_eps
        self.apply(self.init_)

    def init_(self, module):
        if type(module) in {nn.Linear}:
            nn.init.normal_(module.weight, std=self.init_eps)

    def forward(self, feats, coors, edges=None, mask=None, adj_mat=None):
        b, n, d = feats.shape
        device = feats.device
        num_nearest, valid_radius, only_sparse_neighbors = self.num_nearest_neighbors, self.valid_radius, self.only_sparse_neighbors
        use_nearest = num_nearest > 0 or only_sparse_neighbors

        rel_coors = coors[:, :, None, :] - coors[:, None, :, :]       # b i () d - b () j d
        rel_dist = (rel_coors ** 2).sum(dim=-1, keepdim=True)

        if use_nearest:
            if FIXED:
                ranking = rel_dist[..., 0].clone()
            else:
                ranking = rel_dist[..., 0]

            if exists(mask):
                rank_mask = mask[:, None, :] * mask[:, None, :]
                ranking.masked_fill_(~rank_mask, 1e5)

            if exists(adj_mat):
                if len(adj_mat.shape) == 2:
                    adj_mat = adj_mat.clone()[None].expand(b, -1, -1)
                if only_sparse_neighbors:
                    num_nearest = int(adj_mat.float().sum(dim=-1).max().item())
                    valid_radius = 0
                self_mask = torch.eye(n, device=device, dtype=torch.bool)[None]
                adj_mat = adj_mat.masked_fill(self_mask, False)
                ranking.masked_fill_(self_mask, -1.)
                ranking.masked_fill_(adj_mat, 0.)

            nbhd_ranking, nbhd_indices = ranking.topk(num_nearest, dim=-1, largest=False)
            nbhd_mask = nbhd_ranking <= valid_radius
            rel_coors = batched_index_select(rel_coors, nbhd_indices, dim=2)
            rel_dist = batched_index_select(rel_dist, nbhd_indices, dim=2)

        feats_j = batched_index_select(feats, nbhd_indices, dim=1)
        feats_i = feats[:, :, None, :]
        feats_i, feats_j = broadcast_tensors(feats_i, feats_j)
        edge_input = torch.cat((feats_i, feats_j, rel_dist), dim=-1)
        m_ij = self.edge_mlp(edge_input)

        if exists(mask):
            mask_i = mask[:, :, None]
            mask_j = batched_index_select(mask, nbhd_indices, dim=1)
            mask = (mask_i * mask_j) & nbhd_mask

        coor_weights = self.coors_mlp(m_ij)[..., 0]
        rel_coors = self.coors_norm(rel_coors)
        if exists(mask):
            coor_weights.masked_fill_(~mask, 0.)
        coors_out = einsum("b i j, b i j c -> b i c", coor_weights, rel_coors) + coors

        if exists(mask):
            m_ij = m_ij.masked_fill(~mask[..., None], 0.)
        m_i = m_ij.sum(dim=-2)
        node_out = self.node_mlp(torch.cat((self.node_norm(feats), m_i), dim=-1)) + feats
        return node_out, coors_out


# two molecules, second one padded; bonded chain adjacency; 3 nearest neighbours
B, N, DIM = 2, 12, 16
feats = torch.randn(B, N, DIM)
coors = torch.randn(B, N, 3) * 2.0
mask = torch.ones(B, N, dtype=torch.bool)
mask[1, 8:] = False
adj_mat = torch.zeros(N, N, dtype=torch.bool)
idx = torch.arange(N - 1)
adj_mat[idx, idx + 1] = True
adj_mat[idx + 1, idx] = True

layer = EGNN(dim=DIM, num_nearest_neighbors=3)
captured = {}
layer.edge_mlp.register_forward_pre_hook(lambda mod, inp: captured.__setitem__("edge_input", inp[0].detach()))

with torch.no_grad():
    feats_out, coors_out = layer(feats, coors, mask=mask, adj_mat=adj_mat)

# reference: the distance column the edge MLP saw must be |x_i - x_j|^2 for the neighbour j it was given
ei = captured["edge_input"]                       # b i k (2*dim + 1)
fj, dist_seen = ei[..., DIM:2 * DIM], ei[..., -1]
j_idx = torch.cdist(fj.reshape(B, -1, DIM), feats).argmin(-1).reshape(B, N, -1)
true_dist = ((coors[:, :, None, :] - torch.gather(coors[:, None].expand(B, N, N, 3), 2,
             j_idx[..., None].expand(-1, -1, -1, 3))) ** 2).sum(-1)
valid = mask[:, :, None] & torch.gather(mask[:, None].expand(B, N, N), 2, j_idx)
err = ((dist_seen - true_dist).abs() * valid).max().item()
print(f"max |rel_dist fed to edge_mlp - true squared distance| over real pairs = {err:.6f}")
