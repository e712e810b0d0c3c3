"""se3-transformer-pytorch: every "nearest neighbor" a token attends is the token itself.

Citation: lucidrains/se3-transformer-pytorch commit f6d616b ("fix big bug, found by
@MattMcPartlon", version 0.6.0; the README added: "A huge bug has been uncovered ... if you were
not using the adjacency sparse neighbors settings and relying on nearest neighbors
functionality"). Read as the commit's diff and its parent's `SE3Transformer.forward`.

Bug: `SE3Transformer.forward` builds the index of every candidate neighbor as
`indices = repeat(torch.arange(n), 'i -> b i j', b = b, j = n)`, so entry (i, j) holds i, the
QUERY's own index, not j. After the self edge is removed and `topk` over the (correct) relative
distances picks the nearest positions, `neighbor_indices = batched_index_select(indices, ...)`
gathers i for every neighbor: the attention layers fetch the keys and values of the token itself
`neighbors` times, and the real nearest neighbors, which `neighbor_mask` says are attended, never
are. Fix: `repeat(torch.arange(n), 'j -> b i j', b = b, i = n)`.

This program is the nearest-neighbor path with type-0 features only: a point cloud of 8 points
(batch 2, the second padded to 6 points with `mask`), `neighbors = 3`, `attend_self = True`,
keys gathered by `neighbor_indices`, sim = q . k masked with `neighbor_mask`, softmax.
"""
import sys

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv


def exists(v):
    return v is not None


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


class AttentionSE3(nn.Module):
    """Type-0 part of the SE3 attention block: self plus gathered neighbors, masked softmax."""

    def __init__(self, dim, heads=2, dim_head=8, attend_self=True):
        super().__init__()
        self.heads = heads
        self.attend_self = attend_self
        inner = heads * dim_head
        self.to_q = nn.Linear(dim, inner, bias=False)
        self.to_k = nn.Linear(dim, inner, bias=False)
        self.to_v = nn.Linear(dim, inner, bias=False)
        self.to_out = nn.Linear(inner, dim)
        self.scale = dim_head ** -0.5

    def forward(self, features, edge_info):
        neighbor_indices, neighbor_mask, _ = edge_info
        b, n, _ = features.shape
        h = self.heads
        q = self.to_q(features).reshape(b, n, h, -1)
        k = self.to_k(features).reshape(b, n, h, -1)
        v = self.to_v(features).reshape(b, n, h, -1)
        k_nb = batched_index_select(k, neighbor_indices, dim=1)  # b i j h d
        v_nb = batched_index_select(v, neighbor_indices, dim=1)
        if self.attend_self:
            k_nb = torch.cat((k[:, :, None], k_nb), dim=2)
            v_nb = torch.cat((v[:, :, None], v_nb), dim=2)
            neighbor_mask = nn.functional.pad(neighbor_mask, (1, 0), value=True)
        sim = torch.einsum("b i h d, b i j h d -> b h i j", q, k_nb) * self.scale
        sim = sim.masked_fill(~neighbor_mask[:, None], -torch.finfo(sim.dtype).max)
        attn = sim.softmax(dim=-1)
        out = torch.einsum("b h i j, b i j h d -> b i h d", attn, v_nb)
        return self.to_out(out.reshape(b, n, -1))


class SE3Transformer(nn.Module):
    def __init__(self, dim, num_neighbors=3, valid_radius=1e5, attend_self=True):
        super().__init__()
        self.num_neighbors = num_neighbors
        self.valid_radius = valid_radius
        self.token_emb = nn.Embedding(10, dim)
        self.attn = AttentionSE3(dim, attend_self=attend_self)

    def forward(self, feats, coors, mask=None):
        feats = self.token_emb(feats)
        b, n, device = *feats.shape[:2], feats.device
        neighbors, valid_radius = self.num_neighbors, self.valid_radius
        exclude_self_mask = ~torch.eye(n, dtype=torch.bool, device=device)[None].expand(b, n, n)

        # exclude edge of token to itself
        if FIXED:
            indices = torch.arange(n, device=device)[None, None, :].expand(b, n, n)  # 'j -> b i j'
        else:
            indices = torch.arange(n, device=device)[None, :, None].expand(b, n, n)  # 'i -> b i j'
        rel_pos = coors[:, :, None, :] - coors[:, None, :, :]
        indices = indices.masked_select(exclude_self_mask).reshape(b, n, n - 1)
        rel_pos = rel_pos.masked_select(exclude_self_mask[..., None]).reshape(b, n, n - 1, 3)
        if exists(mask):
            mask = mask[:, :, None] * mask[:, None, :]
            mask = mask.masked_select(exclude_self_mask).reshape(b, n, n - 1)

        rel_dist = rel_pos.norm(dim=-1)
        modified_rel_dist = rel_dist.clone()
        neighbors = int(min(neighbors, n - 1))
        dist_values, nearest_indices = modified_rel_dist.topk(neighbors, dim=-1, largest=False)
        neighbor_mask = dist_values <= valid_radius
        neighbor_rel_dist = batched_index_select(rel_dist, nearest_indices, dim=2)
        neighbor_indices = batched_index_select(indices, nearest_indices, dim=2)
        if exists(mask):
            neighbor_mask = neighbor_mask & batched_index_select(mask, nearest_indices, dim=2)

        edge_info = (neighbor_indices, neighbor_mask, neighbor_rel_dist)
        return feats + self.attn(feats, edge_info)


def main():
    torch.manual_seed(0)
    model = SE3Transformer(dim=16, num_neighbors=3).eval()
    feats = torch.randint(0, 10, (2, 8))
    coors = torch.randn(2, 8, 3)
    mask = torch.ones(2, 8, dtype=torch.bool)
    mask[1, 6:] = False
    with torch.no_grad():
        out = model(feats, coors, mask=mask)
    print("type0 out", tuple(out.shape), "%.4f" % out.abs().mean().item())


if __name__ == "__main__":
    main()
