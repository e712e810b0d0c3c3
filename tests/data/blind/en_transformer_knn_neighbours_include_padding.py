"""En-transformer: k-nearest-neighbour attention picks padded nodes as neighbours.

Citation: lucidrains/En-transformer commit b98429c88f4656133fca5a494147c9d956b64a2b ("fix a
potential bug"; comment in the fix: "make sure padding does not end up becoming neighbors").
Read in the upstream git history of en_transformer/en_transformer.py (parent and fix commit).

Bug: `EquivariantAttention.forward` with `num_nearest_neighbors > 0` chooses each node's keys as
`rel_dist.topk(num_nn, largest=False)` over ALL nodes, padding included; the padding mask is only
gathered afterwards (`k_mask = batched_index_select(k_mask, nbhd_indices, dim=2)`) and fills the
chosen padded slots with -max. Padded nodes sit at the padded coordinates (zeros), so for real
atoms near the origin they take neighbour slots: the atom then attends to fewer real neighbours
than `num_nearest_neighbors` (here only itself) instead of its true nearest real atoms.
Fix: rank with `rel_dist.masked_fill(~(mask[:, :, None] * mask[:, None, :]), 1e5)` before topk.

This program: the pre-fix `EquivariantAttention` (einops written as permute/expand), one layer,
molecule 0 with 6 atoms, molecule 1 with 4 atoms padded to 6 (zero coordinates), k = 3.
"""
import sys

import torch
import torch.nn.functional as F
from torch import einsum, nn

FIXED = "--fixed" in sys.argv


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


def fourier_encode_dist(x, num_encodings=4, include_self=True):
    x = x.unsqueeze(-1)
    device, dtype, orig_x = x.device, x.dtype, x
    scales = 2 ** torch.arange(num_encodings, device=device, dtype=dtype)
    x = x / scales
    x = torch.cat([x.sin(), x.cos()], dim=-1)
    x = torch.cat((x, orig_x), dim=-1) if include_self else x
    return x


class EquivariantAttention(nn.Module):
    def __init__(self, *, dim, dim_head=64, heads=4, edge_dim=0, m_dim=16, fourier_features=0,
                 norm_rel_coors=False, num_nearest_neighbors=0, init_eps=1e-3):
        super().__init__()
        self.fourier_features = fourier_features
        self.num_nearest_neighbors = num_nearest_neighbors
        attn_inner_dim = heads * dim_head
        self.heads = heads
        self.to_qkv = nn.Linear(dim, attn_inner_dim * 3, bias=False)
        self.to_out = nn.Linear(attn_inner_dim, dim)
        edge_input_dim = (fourier_features * 2) + (dim_head * 2) + edge_dim + 1
        self.edge_mlp = nn.Sequential(nn.Linear(edge_input_dim, edge_input_dim * 2), nn.ReLU(),
                                      nn.Linear(edge_input_dim * 2, m_dim), nn.ReLU())
        self.to_attn_mlp = nn.Sequential(nn.Linear(m_dim, m_dim * 4), nn.ReLU(), nn.Linear(m_dim * 4, 1))
        self.coors_mlp = nn.Sequential(nn.Linear(m_dim * heads, m_dim * 4), nn.ReLU(), nn.Linear(m_dim * 4, 1))
        self.norm_rel_coors = norm_rel_coors
        self.init_eps = init_eps
        self.apply(self.init_)

    def init_(self, module):
        if type(module) in {nn.Linear}:
            nn.init.normal_(module.weight, std=self.init_eps)

    def forward(self, feats, coors, edges=None, mask=None):
        b, n, d, h, fourier_features, num_nn = *feats.shape, self.heads, self.fourier_features, self.num_nearest_neighbors
        rel_coors = coors[:, :, None, :] - coors[:, None, :, :]
        rel_dist = rel_coors.norm(dim=-1, p=2)

        nbhd_indices = None
        if num_nn > 0:
            ranking = rel_dist
            if FIXED and exists(mask):
                # make sure padding does not end up becoming neighbors
                ranking_mask = mask[:, :, None] * mask[:, None, :]
                ranking = ranking.masked_fill(~ranking_mask, 1e5)
            nbhd_indices = ranking.topk(num_nn, dim=-1, largest=False).indices

        rel_dist = rel_dist[..., None]
        if fourier_features > 0:
            rel_dist = fourier_encode_dist(rel_dist, num_encodings=fourier_features).squeeze(3)
        rel_dist = rel_dist[:, None].expand(b, h, *rel_dist.shape[1:])  # 'b i j d -> b h i j d'

        q, k, v = self.to_qkv(feats).chunk(3, dim=-1)
        q, k, v = map(lambda t: t.view(b, n, h, -1).transpose(1, 2), (q, k, v))

        i = j = n
        if exists(nbhd_indices):
            i, j = nbhd_indices.shape[-2:]
            nbhd_indices_with_heads = nbhd_indices[:, None].expand(b, h, i, j)
            k = batched_index_select(k, nbhd_indices_with_heads, dim=2)
            v = batched_index_select(v, nbhd_indices_with_heads, dim=2)
            rel_dist = batched_index_select(rel_dist, nbhd_indices_with_heads, dim=3)
            rel_coors = batched_index_select(rel_coors, nbhd_indices, dim=2)
        else:
            k = k[:, :, None].expand(b, h, n, n, k.shape[-1])

        if exists(mask):
            q_mask = mask[:, None, :, None]
            k_mask = mask[:, None, :].expand(b, n, n)
            if exists(nbhd_indices):
                k_mask = batched_index_select(k_mask, nbhd_indices, dim=2)
            k_mask = k_mask[:, None]
            mask = q_mask * k_mask

        q = q[:, :, :, None].expand(b, h, i, j, q.shape[-1])
        edge_input = torch.cat((q, k, rel_dist), dim=-1)
        m_ij = self.edge_mlp(edge_input)

        coor_mlp_input = m_ij.permute(0, 2, 3, 1, 4).reshape(b, i, j, -1)  # 'b h i j d -> b i j (h d)'
        coor_weights = self.coors_mlp(coor_mlp_input).squeeze(-1)
        if exists(mask):
            coor_weights.masked_fill_(~mask[:, 0], 0.)
        if self.norm_rel_coors:
            rel_coors = F.normalize(rel_coors, dim=-1, p=2)
        coors_out = einsum('b i j, b i j c -> b i c', coor_weights, rel_coors)

        sim = self.to_attn_mlp(m_ij).squeeze(-1)
        if exists(mask):
            max_neg_value = -torch.finfo(sim.dtype).max
            sim.masked_fill_(~mask, max_neg_value)
        attn = sim.softmax(dim=-1)
        self.last_attn = attn
        out = einsum('b h i j, b h i j d -> b h i d', attn, v)
        out = out.transpose(1, 2).reshape(b, n, -1)  # 'b h n d -> b n (h d)'
        return self.to_out(out), coors_out


def main():
    torch.manual_seed(0)
    attn = EquivariantAttention(dim=16, dim_head=8, heads=2, fourier_features=2, num_nearest_neighbors=3, init_eps=0.5)
    feats = torch.randn(2, 6, 16)
    coors = torch.randn(2, 6, 3) * 3
    coors[1] = torch.tensor([[-1., 0, 0], [1., 0, 0], [0, 1.5, 0], [3., 0, 0], [0, 0, 0], [0, 0, 0]])
    feats[1, 4:] = 0.0
    mask = torch.tensor([[True] * 6, [True] * 4 + [False] * 2])
    with torch.no_grad():
        out, coors_out = attn(feats, coors, mask=mask)
    keys_seen = (attn.last_attn[1, 0] > 0).sum(-1)[:4].tolist()
    print("molecule 1: real keys attended per real atom:", keys_seen)
    print("molecule 1 atom 0 out[:4]:", [round(v, 5) for v in out[1, 0, :4].tolist()])


if __name__ == "__main__":
    main()
