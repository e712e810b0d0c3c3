# Follows dauparas/ProteinMPNN protein_mpnn_utils.py, ProteinMPNN.forward: a random decoding_order gives
# order_mask_backward; mask_attend = gather on neighbours; mask_bw = mask_1D*mask_attend sees decoded sequence,
# mask_fw = mask_1D*(1-mask_attend) sees structure only; padded residues (mask=0) are excluded everywhere.
import torch
import torch.nn.functional as F

torch.manual_seed(0)
B, L, K, H = 2, 14, 6, 16
dt = torch.float64
lens = [14, 10]
mask = torch.zeros(B, L, dtype=dt)
for b, n in enumerate(lens):
    mask[b, :n] = 1.0                                   # right padding (chain end)
X = torch.randn(B, L, 3, dtype=dt) * 3
h_V = torch.randn(B, L, H, dtype=dt)                    # encoder node features
h_S = torch.randn(B, L, H, dtype=dt)                    # sequence embeddings
W_q = torch.randn(H, H, dtype=dt) / 4
W_k = torch.randn(2 * H, H, dtype=dt) / 4
W_v = torch.randn(2 * H, H, dtype=dt) / 4

# k nearest neighbours (ProteinMPNN ProteinFeatures._dist): padded residues pushed far away
D = torch.cdist(X, X)
mask_2D = mask[:, :, None] * mask[:, None, :]
D_adj = D + (1.0 - mask_2D) * 1e6
_, E_idx = torch.topk(D_adj, K, dim=-1, largest=False)


def gather_nodes(nodes, idx):
    b, l, k = idx.shape
    flat = idx.reshape(b, -1)[..., None].expand(-1, -1, nodes.size(-1))
    return torch.gather(nodes, 1, flat).view(b, l, k, -1)


# decoding order as in ProteinMPNN: argsort((chain_M + 1e-4) * |randn|), padded ones last
randn = torch.randn(B, L, dtype=dt)
decoding_order = torch.argsort((mask + 1e-4) * torch.abs(randn), dim=-1)
permutation_matrix_reverse = F.one_hot(decoding_order, num_classes=L).to(dt)
order_mask_backward = torch.einsum('ij, biq, bjp->bqp', (1 - torch.triu(torch.ones(L, L, dtype=dt))),
                                   permutation_matrix_reverse, permutation_matrix_reverse)
mask_attend = torch.gather(order_mask_backward, 2, E_idx).unsqueeze(-1)
mask_1D = mask.view(B, L, 1, 1)
mask_bw = mask_1D * mask_attend
mask_fw = mask_1D * (1.0 - mask_attend)

h_ES = torch.cat([gather_nodes(h_S, E_idx), gather_nodes(h_V, E_idx)], -1)
h_EX = torch.cat([torch.zeros_like(gather_nodes(h_S, E_idx)), gather_nodes(h_V, E_idx)], -1)
h_ESV = mask_bw * h_ES + mask_fw * h_EX                 # (B, L, K, 2H)

# neighbour attention; neighbour key padding from mask_attend-independent residue mask
nb_mask = gather_nodes(mask[..., None], E_idx)[..., 0]  # (B, L, K)
q = h_V @ W_q
k = h_ESV @ W_k
v = h_ESV @ W_v
logits = torch.einsum('blh,blkh->blk', q, k) / H ** 0.5
logits = logits.masked_fill(nb_mask == 0, torch.finfo(dt).min)
out = torch.einsum('blk,blkh->blh', logits.softmax(-1), v) * mask[..., None]

# reference: explicit per-residue loop with positions in decoding order
pos = torch.empty(B, L, dtype=torch.long)
for b in range(B):
    pos[b, decoding_order[b]] = torch.arange(L)
diff = 0.0
for b, n in enumerate(lens):
    for i in range(n):
        ks, vs = [], []
        for j in E_idx[b, i].tolist():
            if j >= n:
                continue
            seen = pos[b, j] < pos[b, i]                 # j decoded before i
            feat = torch.cat([h_S[b, j] if seen else torch.zeros(H, dtype=dt), h_V[b, j]])
            ks.append(feat @ W_k)
            vs.append(feat @ W_v)
        ks, vs = torch.stack(ks), torch.stack(vs)
        a = ((ks @ q[b, i]) / H ** 0.5).softmax(-1)
        diff = max(diff, (a @ vs - out[b, i]).abs().max().item())
    diff = max(diff, out[b, n:].abs().max().item() if n < L else 0.0)
print("max |masked decoder - per-residue loop| =", diff)
assert diff < 1e-12
