# lucidrains/molecule-attention-transformer commit 23c9cbe: Attention masked the dot products and the distance
# matrix for padded atoms but added Lg * adjacency_mat unmasked, so edges into padded atoms still carry attention.
import sys

import torch
from torch import nn, einsum

FIXED = "--fixed" in sys.argv

DEFAULT_DISTANCE_KERNEL = lambda t: torch.exp(-t)


def exists(val):
    return val is not None


class Residual(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x, **kwargs):
        return x + self.fn(x, **kwargs)


class PreNorm(nn.Module):
    def __init__(self, dim, fn):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fn = fn

    def forward(self, x, **kwargs):
        return self.fn(self.norm(x), **kwargs)


class FeedForward(nn.Module):
    def __init__(self, dim, mult=4):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(dim, dim * mult), nn.GELU(), nn.Linear(dim * mult, dim))

    def forward(self, x):
        return self.net(x)


class Attention(nn.Module):
    def __init__(self, dim, heads=8, dim_head=64, Lg=0.5, Ld=0.5, La=1, distance_kernel=DEFAULT_DISTANCE_KERNEL):
        super().__init__()
        inner_dim = dim_head * heads
        self.heads = heads
        self.scale = dim_head ** -0.5
        self.to_qkv = nn.Linear(dim, inner_dim * 3, bias=False)
        self.to_out = nn.Linear(inner_dim, dim)
        # weighted combination of self-attention (La), adjacency graph (Lg), pair-wise distance matrix (Ld)
        self.La, self.Ld, self.Lg = La, Ld, Lg
        self.distance_kernel = distance_kernel

    def forward(self, x, mask=None, adjacency_mat=None, distance_mat=None):
        h, La, Ld, Lg, distance_kernel = self.heads, self.La, self.Ld, self.Lg, self.distance_kernel
        b, n, _ = x.shape
        qkv = self.to_qkv(x).view(b, n, h, 3, -1).permute(0, 2, 1, 3, 4)
        q, k, v = qkv.unbind(dim=-2)
        dots = einsum('b h i d, b h j d -> b h i j', q, k) * self.scale

        if exists(distance_mat):
            distance_mat = distance_mat[:, None, :, :]
        if FIXED and exists(adjacency_mat):
            adjacency_mat = adjacency_mat[:, None, :, :]

        if exists(mask):
            mask_value = torch.finfo(dots.dtype).max
            mask = mask[:, None, :, None] * mask[:, None, None, :]
            # mask attention
            dots.masked_fill_(~mask, -mask_value)
            if exists(distance_mat):
                # mask distance to infinity
                distance_mat.masked_fill_(~mask, mask_value)
            if FIXED and exists(adjacency_mat):
                adjacency_mat.masked_fill_(~mask, 0.)

        attn = dots.softmax(dim=-1)
        # sum contributions from adjacency and distance tensors
        attn = attn * La
        if exists(adjacency_mat):
            attn = attn + Lg * (adjacency_mat if FIXED else adjacency_mat[:, None, :, :])
        if exists(distance_mat):
            distance_mat = distance_kernel(distance_mat)
            attn = attn + Ld * distance_mat

        out = einsum('b h i j, b h j d -> b h i d', attn, v)
        out = out.permute(0, 2, 1, 3).reshape(b, n, -1)
        return self.to_out(out)


class MAT(nn.Module):
    def __init__(self, *, dim_in, model_dim, dim_out, depth, heads=8, dim_head=8, Lg=0.5, Ld=0.5, La=1):
        super().__init__()
        self.embed_to_model = nn.Linear(dim_in, model_dim)
        self.layers = nn.ModuleList([])
        for _ in range(depth):
            self.layers.append(nn.ModuleList([
                Residual(PreNorm(model_dim, Attention(model_dim, heads=heads, dim_head=dim_head, Lg=Lg, Ld=Ld, La=La))),
                Residual(PreNorm(model_dim, FeedForward(model_dim)))
            ]))
        self.norm_out = nn.LayerNorm(model_dim)
        self.linear_out = nn.Linear(model_dim, dim_out)

    def encode(self, x, mask=None, adjacency_mat=None, distance_mat=None):
        x = self.embed_to_model(x)
        for (attn, ff) in self.layers:
            x = attn(x, mask=mask, adjacency_mat=adjacency_mat, distance_mat=distance_mat)
            x = ff(x)
        return self.norm_out(x)

    def forward(self, x, mask=None, adjacency_mat=None, distance_mat=None):
        x = self.encode(x, mask, adjacency_mat, distance_mat)
        return self.linear_out(x.mean(dim=-2))


def featurize(coords_list, n_max, dim_in, cutoff=1.6):
    """Pad atoms to n_max; padded atoms sit at the origin with zero features."""
    b = len(coords_list)
    coords = torch.zeros(b, n_max, 3)
    feats = torch.zeros(b, n_max, dim_in)
    mask = torch.zeros(b, n_max, dtype=torch.bool)
    for i, c in enumerate(coords_list):
        coords[i, :len(c)] = c
        feats[i, :len(c)] = torch.randn(len(c), dim_in)
        mask[i, :len(c)] = True
    distance_mat = torch.cdist(coords, coords)
    adjacency_mat = (distance_mat < cutoff).float()     # bonded if closer than the cutoff
    return feats, mask, adjacency_mat, distance_mat


if __name__ == "__main__":
    torch.manual_seed(0)
    dim_in = 8
    model = MAT(dim_in=dim_in, model_dim=16, dim_out=1, depth=2, heads=2).eval()
    mol_a = torch.randn(7, 3) * 1.5
    mol_b = torch.randn(4, 3) * 0.7          # small molecule near the origin -> padded to 7 atoms
    feats, mask, adj, dist = featurize([mol_a, mol_b], 7, dim_in)
    with torch.no_grad():
        y = model(feats, mask=mask, adjacency_mat=adj, distance_mat=dist)
        h_batched = model.encode(feats, mask=mask, adjacency_mat=adj, distance_mat=dist)[1, :4]
        h_alone = model.encode(feats[1:, :4], mask=mask[1:, :4], adjacency_mat=adj[1:, :4, :4],
                               distance_mat=dist[1:, :4, :4])[0]
    diff = (h_batched - h_alone).abs().max().item()
    print(f"fixed={FIXED} prediction={y.squeeze(-1).tolist()} "
          f"max |atom states padded - unpadded| for molecule b: {diff:.6f}")
