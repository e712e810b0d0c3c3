# Follows ardigen/MAT src/transformer.py: attention() (scores.masked_fill(mask == 0, -1e12), then p_attn mixed with
# row-normalised adjacency and softmax(-distance) with padded distances set to +inf) and GraphTransformer's
# mask = sum(|atom features|) != 0. Padded atoms get zero weight in all three matrices; their own rows are discarded.
import math
import numpy as np
import torch
import torch.nn.functional as F
torch.manual_seed(6)
dt = torch.float64
d_atom, d_model, h = 10, 32, 4
lambdas = (0.3, 0.3, 0.4)
n_atoms = [9, 5, 3]
N = max(n_atoms)

def attention(query, key, value, adj_matrix, p_dist, mask, eps=1e-6, inf=1e12):
    d_k = query.size(-1)
    scores = torch.matmul(query, key.transpose(-2, -1)) / math.sqrt(d_k)
    scores = scores.masked_fill(mask.unsqueeze(1).repeat(1, query.shape[1], query.shape[2], 1) == 0, -inf)
    p_attn = F.softmax(scores, dim=-1)
    adj_matrix = adj_matrix / (adj_matrix.sum(dim=-1).unsqueeze(2) + eps)
    p_adj = adj_matrix.unsqueeze(1).repeat(1, query.shape[1], 1, 1)
    la, ld, lj = lambdas
    p_weighted = la * p_attn + ld * p_dist + lj * p_adj
    return torch.matmul(p_weighted, value)

lin = [torch.nn.Linear(d_model, d_model, dtype=dt) for _ in range(4)]
emb = torch.nn.Linear(d_atom, d_model, dtype=dt)

def mha(x, adj, dist, mask):
    mask = mask.unsqueeze(1)
    nb = x.size(0)
    q, k, v = [l(x).view(nb, -1, h, d_model // h).transpose(1, 2) for l in lin[:3]]
    dist = dist.masked_fill(mask.repeat(1, mask.shape[-1], 1) == 0, np.inf)
    dist = F.softmax(-dist, dim=-1)
    p_dist = dist.unsqueeze(1).repeat(1, q.shape[1], 1, 1)
    out = attention(q, k, v, adj, p_dist, mask)
    return lin[3](out.transpose(1, 2).contiguous().view(nb, -1, d_model))

def model(src, adj, dist):
    mask = torch.sum(torch.abs(src), dim=-1) != 0
    x = emb(src)
    for _ in range(2):
        x = x + mha(x, adj, dist, mask)
    return x

mols = []
for n in n_atoms:
    feats = torch.randn(n, d_atom, dtype=dt)
    feats[0] = 0; feats[0, -1] = 1.0          # MAT's dummy node: only its own flag set
    pos = torch.randn(n, 3, dtype=dt) * 2
    dist = torch.cdist(pos, pos); dist[0, 1:] = 1e6; dist[1:, 0] = 1e6
    adj = (torch.rand(n, n) < 0.4).to(dt); adj = ((adj + adj.T + torch.eye(n, dtype=dt)) > 0).to(dt)
    mols.append((feats, adj, dist))

src = torch.zeros(len(mols), N, d_atom, dtype=dt)   # padded atoms: all-zero features -> mask 0
adj = torch.zeros(len(mols), N, N, dtype=dt)
dist = torch.full((len(mols), N, N), 1e6, dtype=dt)
for i, (f, a, d) in enumerate(mols):
    n = len(f); src[i, :n] = f; adj[i, :n, :n] = a; dist[i, :n, :n] = d
out = model(src, adj, dist)

diff = 0.0
for i, (f, a, d) in enumerate(mols):
    r = model(f[None], a[None], d[None])
    diff = max(diff, (out[i, :len(f)] - r[0]).abs().max().item())
print("max diff", diff)
assert diff < 1e-12
