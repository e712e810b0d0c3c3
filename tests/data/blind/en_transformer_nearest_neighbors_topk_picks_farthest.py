"""En-transformer: the "nearest neighbors" each atom attends are its farthest points.

Citation: lucidrains/En-transformer commit 0a874ed ("fix bug, get closest points", version
0.0.10), in `EnTransformer.forward`; read as the commit's diff and its parent's file.

Bug: with `num_nearest_neighbors > 0` the model restricts every node's attention to a
neighborhood chosen by `rel_dist.topk(num_nn, dim = -1).indices`. `topk` defaults to
`largest=True`, so `nbhd_indices` holds the num_nn FARTHEST nodes (the node itself, at distance
0, is never among them). `EquivariantAttention` then gathers k, v, the relative distances and
the coordinate basis by `nbhd_indices` and softmaxes over them, so each node attends the far
side of the point cloud and never its actual neighbors. Fix: `topk(num_nn, dim = -1,
largest = False)`.

This program keeps the project's module layout (`EnTransformer` -> `EquivariantAttention`,
edge MLP over [q, k, rel_dist], attention logits from `to_attn_mlp`, softmax over the gathered
neighbors) for a batch of two 10-point clouds with `num_nearest_neighbors = 4`.
"""
import sys

import torch
import torch.nn as nn

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


class EquivariantAttention(nn.Module):
    def __init__(self, *, dim, dim_head=8, heads=2, m_dim=16):
        super().__init__()
        attn_inner_dim = heads * dim_head
        self.heads = heads
        self.to_qkv = nn.Linear(dim, attn_inner_dim * 3, bias=False)
        self.to_out = nn.Linear(attn_inner_dim, dim)
        edge_input_dim = (dim_head * 2) + 1
        self.edge_mlp = nn.Sequential(
            nn.Linear(edge_input_dim, edge_input_dim * 2), nn.ReLU(), nn.Linear(edge_input_dim * 2, m_dim), nn.ReLU()
        )
        self.to_attn_mlp = nn.Sequential(nn.Linear(m_dim, m_dim * 4), nn.ReLU(), nn.Linear(m_dim * 4, 1))
        self.coors_mlp = nn.Sequential(nn.Linear(m_dim, m_dim * 4), nn.ReLU(), nn.Linear(m_dim * 4, 1))

    def forward(self, feats, coors, basis, nbhd_indices=None):
        b, n, d = feats.shape
        h = self.heads
        rel_coors = coors[:, :, None, :] - coors[:, None, :, :]
        rel_dist = (rel_coors ** 2).sum(dim=-1, keepdim=True)
        rel_dist = rel_dist[:, None].expand(b, h, n, n, 1)

        q, k, v = self.to_qkv(feats).chunk(3, dim=-1)
        q, k, v = map(lambda t: t.reshape(b, n, h, -1).transpose(1, 2), (q, k, v))

        # calculate nearest neighbors
        i = j = n
        if exists(nbhd_indices):
            i, j = nbhd_indices.shape[-2:]
            nbhd_indices_with_heads = nbhd_indices[:, None].expand(b, h, i, j)
            k = batched_index_select(k, nbhd_indices_with_heads, dim=2)
            v = batched_index_select(v, nbhd_indices_with_heads, dim=2)
            rel_dist = batched_index_select(rel_dist, nbhd_indices_with_heads, dim=3)
            basis = batched_index_select(basis, nbhd_indices, dim=2)
        else:
            k = k[:, :, None].expand(b, h, n, n, k.shape[-1])

        q = q[:, :, :, None].expand(b, h, n, j, q.shape[-1])
        edge_input = torch.cat((q, k, rel_dist), dim=-1)
        m_ij = self.edge_mlp(edge_input)
        coor_weights = self.coors_mlp(m_ij).squeeze(-1)
        coors_out = torch.einsum("b h i j, b i j c -> b i c", coor_weights, basis)

        sim = self.to_attn_mlp(m_ij).squeeze(-1)
        attn = sim.softmax(dim=-1)
        if exists(nbhd_indices):
            out = torch.einsum("b h i j, b h i j d -> b h i d", attn, v)
        else:
            out = torch.einsum("b h i j, b h j d -> b h i d", attn, v)
        out = out.transpose(1, 2).reshape(b, n, -1)
        return self.to_out(out), coors_out


class EnTransformer(nn.Module):
    def __init__(self, *, dim, depth, num_nearest_neighbors=0):
        super().__init__()
        self.num_nearest_neighbors = num_nearest_neighbors
        self.layers = nn.ModuleList([EquivariantAttention(dim=dim) for _ in range(depth)])
        self.norms = nn.ModuleList([nn.LayerNorm(dim) for _ in range(depth)])

    def forward(self, feats, coors):
        n, num_nn = feats.shape[1], self.num_nearest_neighbors
        rel_coors = coors[:, :, None, :] - coors[:, None, :, :]
        nbhd_indices = None
        if num_nn > 0 and num_nn < n:
            rel_dist = rel_coors.norm(dim=-1, p=2)
            if FIXED:
                nbhd_indices = rel_dist.topk(num_nn, dim=-1, largest=False).indices
            else:
                nbhd_indices = rel_dist.topk(num_nn, dim=-1).indices
        coors_delta = 0
        for attn, norm in zip(self.layers, self.norms):
            out, coors_out = attn(norm(feats), coors, basis=rel_coors, nbhd_indices=nbhd_indices)
            feats = feats + out
            coors_delta = coors_delta + coors_out
        return feats, coors + coors_delta


def main():
    torch.manual_seed(0)
    model = EnTransformer(dim=16, depth=1, num_nearest_neighbors=4).eval()
    feats = torch.randn(2, 10, 16)
    coors = torch.randn(2, 10, 3)
    with torch.no_grad():
        feats_out, coors_out = model(feats, coors)
    print("feats", tuple(feats_out.shape), "coors", tuple(coors_out.shape), "%.4f" % feats_out.abs().mean().item())


if __name__ == "__main__":
    main()
