# lucidrains/equiformer-pytorch commit dd057f3 ("make sure to mask out padding tokens in mlp attention"):
# MLPAttention built its neighbor list with a neighbor_mask (padding atoms, radius) but never applied it
# to the attention logits, so padded atoms were attended to by every real atom.
import sys

import torch
import torch.nn.functional as F
from torch import nn, einsum

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


def exists(val):
    return val is not None


def batched_index_select(values, indices, dim=1):
    # values: (b, n, d), indices: (b, i, j) -> (b, i, j, d)
    b, i, j = indices.shape
    flat = indices.reshape(b, i * j, 1).expand(-1, -1, values.shape[-1])
    return values.gather(dim, flat).view(b, i, j, -1)


class MLPAttention(nn.Module):
    def __init__(self, dim, heads=2, dim_head=8, attend_self=True, attn_hidden_dim_mult=4,
                 attn_leakyrelu_slope=0.1, radial_hidden_dim=16):
        super().__init__()
        self.heads = heads
        self.attend_self = attend_self
        self.scale = dim_head ** -0.5
        self.prenorm = nn.LayerNorm(dim)
        attn_hidden_dim = heads * attn_hidden_dim_mult
        self.radial = nn.Sequential(nn.Linear(1, radial_hidden_dim), nn.SiLU())
        # stand-in for the DTP tensor product: per edge features -> (attention branch, value branch)
        self.to_attn_and_v = nn.Linear(dim + radial_hidden_dim, attn_hidden_dim + heads * dim_head)
        self.intermediate_split = [attn_hidden_dim, heads * dim_head]
        self.to_attn_logits = nn.Sequential(nn.LeakyReLU(attn_leakyrelu_slope), nn.Linear(attn_hidden_dim, heads, bias=False))
        self.to_out = nn.Linear(heads * dim_head, dim)

    def forward(self, features, edge_info, rel_dist, mask=None):
        neighbor_indices, neighbor_mask, _ = edge_info

        if FIXED and exists(neighbor_mask):
            if self.attend_self:
                neighbor_mask = F.pad(neighbor_mask, (1, 0), value=True)
            neighbor_mask = neighbor_mask[..., None]

        features = self.prenorm(features)
        source = batched_index_select(features, neighbor_indices, dim=1)        # (b, i, j, d)
        if self.attend_self:
            source = torch.cat((features[:, :, None], source), dim=2)
            rel_dist = F.pad(rel_dist, (1, 0), value=0.)

        edge_feats = torch.cat((source, self.radial(rel_dist[..., None])), dim=-1)
        attn_intermediate, values = self.to_attn_and_v(edge_feats).split(self.intermediate_split, dim=-1)

        attn_logits = self.to_attn_logits(attn_intermediate)
        attn_logits = attn_logits * self.scale

        if FIXED and exists(neighbor_mask):
            attn_logits = attn_logits.masked_fill(~neighbor_mask, -torch.finfo(attn_logits.dtype).max)

        attn = attn_logits.softmax(dim=-2)  # (batch, source, target, heads)

        values = values.unflatten(-1, (self.heads, -1))
        out = einsum('b i j h, b i j h d -> b i h d', attn, values).flatten(2)
        return self.to_out(out)


class Equiformer(nn.Module):
    def __init__(self, dim=16, depth=2, num_neighbors=float('inf'), valid_radius=1e5, num_tokens=10):
        super().__init__()
        self.token_emb = nn.Embedding(num_tokens, dim)
        self.num_neighbors = num_neighbors
        self.valid_radius = valid_radius
        self.layers = nn.ModuleList([MLPAttention(dim) for _ in range(depth)])

    def forward(self, atoms, coors, mask=None):
        b, n = atoms.shape
        feats = self.token_emb(atoms)

        exclude_self_mask = ~torch.eye(n, dtype=torch.bool)[None]
        rel_pos = coors[:, :, None] - coors[:, None, :]
        indices = torch.arange(n).expand(b, n, n)
        indices = indices.masked_select(exclude_self_mask).reshape(b, n, n - 1)
        rel_pos = rel_pos.masked_select(exclude_self_mask[..., None]).reshape(b, n, n - 1, 3)

        if exists(mask):
            mask = mask[:, :, None] & mask[:, None, :]
            mask = mask.masked_select(exclude_self_mask).reshape(b, n, n - 1)

        rel_dist = rel_pos.norm(dim=-1)
        modified_rel_dist = rel_dist.clone()
        if exists(mask):
            modified_rel_dist = modified_rel_dist.masked_fill(~mask, torch.finfo(rel_dist.dtype).max)

        neighbors = int(min(self.num_neighbors, n - 1))
        dist_values, nearest_indices = modified_rel_dist.topk(neighbors, dim=-1, largest=False)
        neighbor_mask = dist_values <= self.valid_radius

        neighbor_rel_dist = rel_dist.gather(2, nearest_indices)
        neighbor_indices = indices.gather(2, nearest_indices)
        if exists(mask):
            neighbor_mask = neighbor_mask & mask.gather(2, nearest_indices)

        edge_info = (neighbor_indices, neighbor_mask, None)
        for attn in self.layers:
            feats = feats + attn(feats, edge_info, neighbor_rel_dist)
        return feats


model = Equiformer().eval()
atoms = torch.tensor([[1, 2, 3, 4, 5], [6, 7, 8, 0, 0]])
coors = torch.randn(2, 5, 3)
mask = torch.tensor([[True] * 5, [True, True, True, False, False]])

with torch.no_grad():
    out = model(atoms, coors, mask=mask)
    ref = model(atoms[1:, :3], coors[1:, :3], mask=mask[1:, :3])

diff = (out[1, :3] - ref[0]).abs().max().item()
print(f"fixed={FIXED} padded molecule vs same molecule unpadded, max |out diff|: {diff:.2e}")
