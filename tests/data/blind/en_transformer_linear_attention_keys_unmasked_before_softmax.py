# lucidrains/En-transformer commit 1531623 ("make sure keys are masked prior to softmax kernel for linear
# attention"): GlobalLinearAttention zeroed padded values but let padded nodes' keys into k.softmax(dim=-2),
# so padding nodes of a point cloud / molecule still took a share of every query's attention.
import sys

import torch
from torch import nn, einsum

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


def exists(val):
    return val is not None


def max_neg_value(t):
    return -torch.finfo(t.dtype).max


class GlobalLinearAttention(nn.Module):
    def __init__(self, *, dim, dim_head, heads):
        super().__init__()
        inner_dim = dim_head * heads
        self.heads = heads
        self.scale = dim_head ** -0.5
        self.to_qkv = nn.Linear(dim, inner_dim * 3, bias=False)
        self.to_out = nn.Linear(inner_dim, dim)

    def forward(self, feats, coors, mask=None):
        h = self.heads
        q, k, v = self.to_qkv(feats).chunk(3, dim=-1)
        q, k, v = map(lambda t: t.unflatten(-1, (h, -1)).transpose(1, 2), (q, k, v))  # b h n d

        if FIXED and exists(mask):
            mask = mask[:, None, :, None]
            k.masked_fill_(~mask, max_neg_value(k))

        q = q.softmax(dim=-1)
        k = k.softmax(dim=-2)

        q = q * self.scale

        if exists(mask):
            if not FIXED:
                mask = mask[:, None, :, None]
            v.masked_fill_(~mask, 0.)

        context = einsum('b h n d, b h n e -> b h d e', k, v)
        out = einsum('b h d e, b h n d -> b h n e', context, q)
        out = out.transpose(1, 2).flatten(2)
        return self.to_out(out), 0


class EquivariantAttention(nn.Module):
    def __init__(self, *, dim, dim_head=8, heads=2):
        super().__init__()
        self.heads = heads
        self.scale = dim_head ** -0.5
        self.to_qkv = nn.Linear(dim, dim_head * heads * 3, bias=False)
        self.coors_mlp = nn.Sequential(nn.Linear(heads, 8), nn.SiLU(), nn.Linear(8, 1))
        self.to_out = nn.Linear(dim_head * heads, dim)

    def forward(self, feats, coors, mask=None):
        h = self.heads
        rel_coors = coors[:, :, None, :] - coors[:, None, :, :]
        q, k, v = self.to_qkv(feats).chunk(3, dim=-1)
        q, k, v = map(lambda t: t.unflatten(-1, (h, -1)).transpose(1, 2), (q, k, v))
        sim = einsum('b h i d, b h j d -> b h i j', q, k) * self.scale
        if exists(mask):
            pair_mask = mask[:, None, :, None] & mask[:, None, None, :]
            sim = sim.masked_fill(~pair_mask, max_neg_value(sim))
        attn = sim.softmax(dim=-1)
        coor_weights = self.coors_mlp(attn.permute(0, 2, 3, 1)).squeeze(-1)
        if exists(mask):
            coor_weights = coor_weights.masked_fill(~pair_mask[:, 0], 0.)
        coors_out = einsum('b i j, b i j c -> b i c', coor_weights, rel_coors)
        out = einsum('b h i j, b h j d -> b h i d', attn, v).transpose(1, 2).flatten(2)
        return self.to_out(out), coors_out


class EnTransformer(nn.Module):
    def __init__(self, *, dim, depth, dim_head=8, heads=2, global_linear_attn_every=1):
        super().__init__()
        self.layers = nn.ModuleList([])
        for ind in range(depth):
            global_attn = GlobalLinearAttention(dim=dim, dim_head=dim_head, heads=heads) \
                if (ind % global_linear_attn_every) == 0 else None
            self.layers.append(nn.ModuleList([
                global_attn,
                EquivariantAttention(dim=dim, dim_head=dim_head, heads=heads),
                nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, dim * 2), nn.GELU(), nn.Linear(dim * 2, dim)),
            ]))

    def forward(self, feats, coors, mask=None):
        for global_attn, attn, ff in self.layers:
            if exists(global_attn):
                f, _ = global_attn(feats, coors, mask=mask)
                feats = feats + f
            f, c = attn(feats, coors, mask=mask)
            feats, coors = feats + f, coors + c
            feats = feats + ff(feats)
        return feats, coors


model = EnTransformer(dim=16, depth=2).eval()

# two molecules of 5 and 3 atoms, padded to 5 nodes
feats = torch.randn(2, 5, 16)
coors = torch.randn(2, 5, 3)
mask = torch.tensor([[True] * 5, [True, True, True, False, False]])
feats[1, 3:] = 0.
coors[1, 3:] = 0.

with torch.no_grad():
    feats_out, coors_out = model(feats, coors, mask=mask)
    ref_feats, ref_coors = model(feats[1:, :3], coors[1:, :3], mask=mask[1:, :3])

diff = (feats_out[1, :3] - ref_feats[0]).abs().max().item()
print(f"fixed={FIXED} padded molecule vs same molecule unpadded, max |feats diff|: {diff:.2e}")
