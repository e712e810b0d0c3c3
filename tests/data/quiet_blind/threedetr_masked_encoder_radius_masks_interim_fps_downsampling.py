"""3DETR's masked point-cloud encoder, as facebookresearch/3detr writes it: models/transformer.py
MaskedTransformerEncoder.compute_mask (`dist = torch.cdist(xyz, xyz, p=2)`; "entries that are True in
the mask do not contribute to self-attention so points outside the radius are not considered":
`mask = dist >= radius`), MaskedTransformerEncoder.forward (mask tiled to (bsz * nhead, n, n), dist
reused until the point count changes, interim_downsampling after layer 0), models/model_3detr.py
build_encoder (masking_radius = [math.pow(x, 2) for x in [0.4, 0.8, 1.2]], i.e. compared against the
unsquared distance as the project does), pre-norm TransformerEncoderLayer with nn.MultiheadAttention.
Interim downsampling is reduced to farthest point sampling + max-pool over the 4 nearest points
(3DETR uses PointnetSAModuleVotes: FPS + ball-query grouping + shared MLP + max-pool).

Intent: early layers are local: a point attends to points closer than the layer's radius (itself always,
at distance 0), so no row is ever empty; the last layer (radius 1.44 > scene diameter here for most
pairs) is nearly global, as is layer 1 on the 16 downsampled points.

Checks: (1) the encoder equals a per-point loop over the neighbours closer than each layer's radius,
with distances recomputed after downsampling; (2) each scene of the batch equals that scene alone.
"""
import math
import torch
import torch.nn as nn

torch.manual_seed(0)
torch.set_default_dtype(torch.float64)
D, NH, N0, N1 = 32, 4, 48, 16
RADII = [math.pow(x, 2) for x in [0.4, 0.8, 1.2]]


class EncLayer(nn.Module):   # 3detr TransformerEncoderLayer.forward_pre
    def __init__(self):
        super().__init__()
        self.nhead = NH
        self.self_attn = nn.MultiheadAttention(D, NH)
        self.norm1, self.norm2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.ffn = nn.Sequential(nn.Linear(D, 64), nn.ReLU(), nn.Linear(64, D))

    def forward(self, src, src_mask=None):
        src2 = self.norm1(src)
        src = src + self.self_attn(src2, src2, src2, attn_mask=src_mask)[0]
        return src + self.ffn(self.norm2(src))


def fps(xyz, m):  # (B,N,3) -> (B,m) indices, starting at point 0 like pointnet2's furthest_point_sample
    B, N, _ = xyz.shape
    idx = torch.zeros(B, m, dtype=torch.long)
    dist = torch.full((B, N), float("inf"))
    far = torch.zeros(B, dtype=torch.long)
    for i in range(m):
        idx[:, i] = far
        c = xyz[torch.arange(B), far][:, None]
        dist = torch.minimum(dist, ((xyz - c) ** 2).sum(-1))
        far = dist.argmax(-1)
    return idx


class Downsample(nn.Module):
    def __init__(self):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(D + 3, D), nn.ReLU())

    def forward(self, xyz, feats):  # feats (B, C, N) as 3detr passes it
        inds = fps(xyz, N1)
        new_xyz = torch.gather(xyz, 1, inds[..., None].expand(-1, -1, 3))
        nn_idx = torch.cdist(new_xyz, xyz).topk(4, largest=False).indices           # (B, N1, 4)
        f = feats.transpose(1, 2)
        g = torch.stack([f[b][nn_idx[b]] for b in range(xyz.shape[0])])            # (B, N1, 4, C)
        gx = torch.stack([xyz[b][nn_idx[b]] for b in range(xyz.shape[0])]) - new_xyz[:, :, None]
        return new_xyz, self.mlp(torch.cat([gx, g], -1)).max(2).values.transpose(1, 2), inds


class MaskedTransformerEncoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([EncLayer() for _ in RADII])
        self.masking_radius, self.interim_downsampling = RADII, Downsample()

    def compute_mask(self, xyz, radius, dist=None):
        with torch.no_grad():
            if dist is None or dist.shape[1] != xyz.shape[1]:
                dist = torch.cdist(xyz, xyz, p=2)
            mask = dist >= radius
        return mask, dist

    def forward(self, src, xyz):  # src (N, B, C)
        output, xyz_dist = src, None
        for idx, layer in enumerate(self.layers):
            mask = None
            if self.masking_radius[idx] > 0:
                mask, xyz_dist = self.compute_mask(xyz, self.masking_radius[idx], xyz_dist)
                bsz, n, n = mask.shape
                mask = mask.unsqueeze(1).repeat(1, layer.nhead, 1, 1).view(bsz * layer.nhead, n, n)
            output = layer(output, src_mask=mask)
            if idx == 0 and self.interim_downsampling:
                output = output.permute(1, 2, 0)
                xyz, output, xyz_inds = self.interim_downsampling(xyz, output)
                output = output.permute(2, 0, 1)
        return xyz, output


def loop_layer(layer, x, xyz, radius):  # x (N, C) one scene; explicit neighbours
    a = layer.self_attn
    W, Bi = a.in_proj_weight, a.in_proj_bias
    h = layer.norm1(x)
    q, k, v = [(h @ W[i * D:(i + 1) * D].T + Bi[i * D:(i + 1) * D]).view(-1, NH, D // NH) for i in range(3)]
    out = torch.empty_like(x)
    for i in range(x.shape[0]):
        nb = ((xyz - xyz[i]).norm(dim=-1) < radius).nonzero().squeeze(1)
        w = torch.einsum('hd,khd->hk', q[i], k[nb]).div((D // NH) ** 0.5).softmax(-1)
        out[i] = a.out_proj(torch.einsum('hk,khd->hd', w, v[nb]).reshape(D))
    x = x + out
    return x + layer.ffn(layer.norm2(x))


enc = MaskedTransformerEncoder().eval()
xyz = torch.rand(2, N0, 3) * torch.tensor([0.8, 0.6, 0.3])
feats = torch.randn(N0, 2, D)
with torch.no_grad():
    new_xyz, out = enc(feats, xyz)
    d1 = d2 = 0.0
    for b in range(2):
        x, p = feats[:, b], xyz[b]
        for idx, layer in enumerate(enc.layers):
            x = loop_layer(layer, x, p, RADII[idx])
            if idx == 0:
                p, f, _ = enc.interim_downsampling(p[None], x.T[None])
                p, x = p[0], f[0].T
        d1 = max(d1, (x - out[:, b]).abs().max().item())
        xyz_b, out_b = enc(feats[:, b:b + 1], xyz[b:b + 1])
        d2 = max(d2, (out_b[:, 0] - out[:, b]).abs().max().item())
    frac = [(torch.cdist(xyz, xyz) < r).double().mean().item() for r in RADII]

print("visible fraction of the 48 input points per radius:", [f"{f:.2f}" for f in frac])
print(f"masked encoder vs per-point neighbour loop: max diff = {d1:.3e}")
print(f"batch vs each scene alone: max diff = {d2:.3e}")
assert d1 < 1e-12 and d2 < 1e-12
