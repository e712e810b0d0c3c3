# equiformer-pytorch (lucidrains/equiformer-pytorch commit 5dfc465): Equiformer picks each atom's k nearest neighbours by
# topk over relative distance without masking padding atoms, so padding fills neighbour slots; the neighbor_mask then
# drops them and the real atom attends to fewer real neighbours than when its molecule is run alone.
# Degree-0 (invariant) path only; the neighbour selection and the masked_fill in L2DistAttention follow the project code.
import sys
import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


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


class L2DistAttention(nn.Module):
    """degree-0 slice of equiformer's L2DistAttention; keys/values come from the selected neighbours"""

    def __init__(self, dim, dim_head=8, heads=4):
        super().__init__()
        self.heads = heads
        self.scale = dim_head ** -0.5
        self.prenorm = nn.LayerNorm(dim)
        self.to_q = nn.Linear(dim, dim_head * heads, bias=False)
        self.to_kv = nn.Linear(dim + 1, dim_head * heads * 2, bias=False)  # stands in for DTP(features, rel_dist)
        self.to_out = nn.Linear(dim_head * heads, dim, bias=False)

    def forward(self, features, edge_info, rel_dist, mask=None):
        neighbor_indices, neighbor_mask, edges = edge_info
        if exists(neighbor_mask):
            neighbor_mask = neighbor_mask[:, None]  # 'b i j -> b 1 i j'
        features = self.prenorm(features)
        q = self.to_q(features)
        neighbor_feats = batched_index_select(features, neighbor_indices, dim=1)
        kv = self.to_kv(torch.cat((neighbor_feats, rel_dist), dim=-1))
        h = self.heads
        q = q.view(*q.shape[:2], h, -1).transpose(1, 2)  # 'b i (h d) -> b h i d'
        kv = kv.view(*kv.shape[:3], h, -1).permute(0, 3, 1, 2, 4)  # 'b i j (h d) -> b h i j d'
        k, v = kv.chunk(2, dim=-1)
        q = q.unsqueeze(3).expand(-1, -1, -1, k.shape[-2], -1)  # 'b h i d -> b h i j d'
        sim = -(q - k).norm(dim=-1) * self.scale
        if exists(neighbor_mask):
            left_pad_needed = 0
            padded_neighbor_mask = F.pad(neighbor_mask, (left_pad_needed, 0), value=True)
            sim = sim.masked_fill(~padded_neighbor_mask, -torch.finfo(sim.dtype).max)
        attn = sim.softmax(dim=-1)
        out = torch.einsum('b h i j, b h i j d -> b h i d', attn, v)
        return self.to_out(out.transpose(1, 2).flatten(2))  # 'b h n d -> b n (h d)'


class Equiformer(nn.Module):
    def __init__(self, num_tokens=10, dim=32, depth=2, num_neighbors=4, valid_radius=1e5):
        super().__init__()
        self.token_emb = nn.Embedding(num_tokens, dim)
        self.layers = nn.ModuleList([L2DistAttention(dim) for _ in range(depth)])
        self.num_neighbors = num_neighbors
        self.valid_radius = valid_radius

    def forward(self, feats, coors, mask=None):
        _mask = mask
        b, n, device = *feats.shape, feats.device
        neighbors, valid_radius = self.num_neighbors, self.valid_radius

        exclude_self_mask = (~torch.eye(n, dtype=torch.bool, device=device))[None]  # 'i j -> 1 i j'
        get_max_value = lambda t: torch.finfo(t.dtype).max

        indices = torch.arange(n, device=device).expand(b, n, n)  # 'j -> b i j'
        rel_pos = coors[:, :, None, :] - coors[:, None, :, :]
        indices = indices.masked_select(exclude_self_mask).reshape(b, n, n - 1)
        rel_pos = rel_pos.masked_select(exclude_self_mask[..., None]).reshape(b, n, n - 1, 3)

        if exists(mask):
            mask = mask[:, :, None] * mask[:, None, :]
            mask = mask.masked_select(exclude_self_mask).reshape(b, n, n - 1)

        rel_dist = rel_pos.norm(dim=-1)

        modified_rel_dist = rel_dist.clone()
        max_value = get_max_value(modified_rel_dist)

        if FIXED:
            # make sure padding tokens are not considered when ordering by relative distance
            if exists(mask):
                modified_rel_dist = modified_rel_dist.masked_fill(~mask, max_value)

        neighbors = int(min(neighbors, n - 1))
        total_neighbors = int(min(neighbors, n - 1))

        dist_values, nearest_indices = modified_rel_dist.topk(total_neighbors, dim=-1, largest=False)
        neighbor_mask = dist_values <= valid_radius

        neighbor_rel_dist = batched_index_select(rel_dist, nearest_indices, dim=2)
        neighbor_indices = batched_index_select(indices, nearest_indices, dim=2)

        if exists(mask):
            neighbor_mask = neighbor_mask & batched_index_select(mask, nearest_indices, dim=2)

        neighbor_rel_dist = neighbor_rel_dist[..., None]
        edge_info = (neighbor_indices, neighbor_mask, None)

        x = self.token_emb(feats)
        for attn in self.layers:
            x = x + attn(x, edge_info, neighbor_rel_dist, mask=_mask)
        return x


model = Equiformer().eval()

# two molecules of 8 and 5 atoms; the shorter is right-padded with atom type 0 at the origin (coords zero)
sizes = [8, 5]
n = max(sizes)
feats = torch.zeros(len(sizes), n, dtype=torch.long)
coors = torch.zeros(len(sizes), n, 3)
mask = torch.zeros(len(sizes), n, dtype=torch.bool)
for b, s in enumerate(sizes):
    feats[b, :s] = torch.randint(1, 10, (s,))
    coors[b, :s] = torch.randn(s, 3)
    mask[b, :s] = True

with torch.no_grad():
    out = model(feats, coors, mask=mask)
    diff = 0.0
    for b, s in enumerate(sizes):
        alone = model(feats[b:b + 1, :s], coors[b:b + 1, :s], mask=mask[b:b + 1, :s])
        diff = max(diff, (out[b, :s] - alone[0]).abs().max().item())

print(f"max |padded batch - each molecule alone| over real atoms: {diff:.6f}")
