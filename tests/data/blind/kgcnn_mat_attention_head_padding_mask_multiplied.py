# aimat-lab/gcnn_keras (kgcnn) commit a3a4482e ("Work on MAT"), prompted by aimat-lab/gcnn_keras#86
# ("masks in MAT").
#
# kgcnn's Molecule Attention Transformer casts a ragged batch of molecules to a padded dense batch
# (`ChangeTensorType(output_tensor_type="padded")`, mask (batch, max_atoms, 1)) and runs
# `MATAttentionHead`: feature-wise scores qk of shape (batch, N, N, units) with a softmax over the key
# atoms (axis 2), mixed with the distance matrix and the adjacency (lambda_a / lambda_d / lambda_g).
# Before the fix the padding mask was applied to the scores by multiplication, `qk *= qk_mask`, so a
# padded atom's score became 0 instead of being removed: it still took exp(0) of the softmax mass in
# every real atom's row, and since the padded values are zero, each real atom's update shrank by an
# amount that depends on how many padding slots its molecule got in the batch.  The fix adds
# -1/epsilon where the mask is 0 before the softmax and multiplies the probabilities by the mask after
# it (`qk += tf.where(qk_mask, 0, -1/eps)`; softmax; `qk *= qk_mask`).
#
# Ported from kgcnn/layers/conv/mat_conv.py (MATDistanceMatrix, MATReduceMask, MATAttentionHead,
# MATGlobalPool) and kgcnn/literature/MAT.py (make_model) at a3a4482e^ / a3a4482e, Keras rewritten in
# torch with the same layer names and einsum; the ragged-to-padded casts are done by hand.  The
# einsum rewrite and the default-unit change in the same commit are not mask changes and are left
# as before in both runs.
import sys

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv
EPSILON = 1e-7  # ks.backend.epsilon()

torch.manual_seed(0)


def Dense(in_units, units, use_bias=True):
    layer = nn.Linear(in_units, units, bias=use_bias)
    nn.init.xavier_uniform_(layer.weight)  # Keras glorot_uniform
    if use_bias:
        nn.init.zeros_(layer.bias)
    return layer


class MLP(nn.Module):
    def __init__(self, in_units, units, activation):
        super().__init__()
        self.layers = nn.ModuleList()
        for u in units:
            self.layers.append(Dense(in_units, u))
            in_units = u
        self.activation = activation

    def forward(self, x):
        for layer, act in zip(self.layers, self.activation):
            x = layer(x)
            if act == "relu":
                x = torch.relu(x)
        return x


class MATGlobalPool(nn.Module):
    def __init__(self, pooling_method="sum"):
        super().__init__()
        self.pooling_method = pooling_method

    def forward(self, inputs, mask=None):
        if self.pooling_method == "sum":
            return inputs.sum(dim=1)


class MATDistanceMatrix(nn.Module):
    def __init__(self, trafo="exp"):
        super().__init__()
        self.trafo = trafo

    def forward(self, inputs, mask):
        # Shape of inputs (batch, N, 3); shape of mask (batch, N, 3)
        diff = inputs.unsqueeze(1) - inputs.unsqueeze(2)
        dist = diff.square().sum(dim=-1, keepdim=True)
        # shape of dist (batch, N, N, 1)
        diff_mask = mask.unsqueeze(1) * mask.unsqueeze(2)
        dist_mask = diff_mask.prod(dim=-1, keepdim=True)
        dist = dist * dist_mask
        if self.trafo == "exp":
            dist = torch.exp(-dist)
        dist = dist * dist_mask
        return dist, dist_mask


class MATReduceMask(nn.Module):
    def __init__(self, axis, keepdims):
        super().__init__()
        self.axis = axis
        self.keepdims = keepdims

    def forward(self, inputs):
        return inputs.prod(dim=self.axis, keepdim=self.keepdims)


class MATAttentionHead(nn.Module):
    def __init__(self, in_units, units=8, lambda_a=1.0, lambda_g=0.5, lambda_d=0.5):
        super().__init__()
        self.units = int(units)
        self.lambda_a = lambda_a
        self.lambda_g = lambda_g
        self.lambda_d = lambda_d
        self.scale = self.units ** -0.5
        self.dense_q = Dense(in_units, units)
        self.dense_k = Dense(in_units, units)
        self.dense_v = Dense(in_units, units)

    def forward(self, inputs, mask):
        h, a_d, a_g = inputs
        h_mask, a_d_mask, a_g_mask = mask
        q = self.dense_q(h).unsqueeze(2)
        k = self.dense_k(h).unsqueeze(1)
        v = self.dense_v(h) * h_mask
        qk = q * k / self.scale
        # Apply mask on self-attention
        qk_mask = h_mask.unsqueeze(1) * h_mask.unsqueeze(2)  # (b, 1, n, ...) * (b, n, 1, ...)
        if FIXED:
            qk = qk + torch.where(qk_mask.bool(), torch.zeros_like(qk), -torch.ones_like(qk) / EPSILON)
            qk = torch.softmax(qk, dim=2)
            qk = qk * qk_mask
        else:
            qk = qk * qk_mask
            qk = torch.softmax(qk, dim=2)
        # Weights
        qk = self.lambda_a * qk
        a_d = self.lambda_d * a_d.to(h.dtype)
        a_g = self.lambda_g * a_g.to(h.dtype)
        att = qk + a_d + a_g
        hp = torch.einsum("bij...,bjk...->bik...", att, v.unsqueeze(2))
        hp = hp.squeeze(2)
        hp = hp * h_mask
        return hp


class MAT(nn.Module):
    """kgcnn.literature.MAT.make_model, graph output, edge weights of shape (None, 1)."""

    def __init__(self, input_embedding_dim=95, embedding_units=32, depth=2, heads=4,
                 attention_units=8, ff_units=(32, 32, 32)):
        super().__init__()
        self.node_embedding = nn.Embedding(input_embedding_dim, embedding_units)
        self.distance_matrix = MATDistanceMatrix(trafo="exp")
        self.adj_dense = Dense(1, 1, use_bias=False)  # has_edge_dim: reduce adjacency features to one
        self.reduce_mask = MATReduceMask(axis=-1, keepdims=True)
        self.h_in = Dense(embedding_units, embedding_units, use_bias=False)
        self.blocks = nn.ModuleList()
        for _ in range(depth):
            self.blocks.append(nn.ModuleDict({
                "norm1": nn.LayerNorm(embedding_units, eps=1e-3),
                "heads": nn.ModuleList([MATAttentionHead(embedding_units, attention_units)
                                        for _ in range(heads)]),
                "merge": Dense(heads * attention_units, embedding_units, use_bias=False),
                "norm2": nn.LayerNorm(embedding_units, eps=1e-3),
                "mlp": MLP(embedding_units, list(ff_units), ["relu", "relu", "linear"]),
                "ff_out": Dense(ff_units[-1], embedding_units, use_bias=False),
            }))
        self.out_norm = nn.LayerNorm(embedding_units, eps=1e-3)
        self.pool = MATGlobalPool()
        self.output_mlp = MLP(embedding_units, [32, 16, 1], ["relu", "relu", "linear"])

    def forward(self, n, n_mask_f, xyz, xyz_mask, adj, adj_mask):
        n_mask = self.reduce_mask(n_mask_f)  # (batch, max_atoms, 1)
        dist, dist_mask = self.distance_matrix(xyz, xyz_mask)
        adj = self.adj_dense(adj)
        adj_mask = self.reduce_mask(adj_mask)

        h_mask = n_mask
        h = self.h_in(n)
        for blk in self.blocks:
            hn = blk["norm1"](h)
            hs = [head([hn, dist, adj], mask=[n_mask, dist_mask, adj_mask]) for head in blk["heads"]]
            hu = blk["merge"](torch.cat(hs, dim=-1))
            h = h + hu
            hn = blk["norm2"](h)
            hu = blk["ff_out"](blk["mlp"](hn))
            hu = hu * h_mask
            h = h + hu
        out = self.out_norm(h)
        out = out * h_mask
        out = self.pool(out, mask=h_mask)
        return self.output_mlp(out)


def to_padded(molecules, model):
    """ChangeTensorType(output_tensor_type="padded") and CastEdgeIndicesToDenseAdjacency by hand."""
    max_atoms = max(len(m["node_number"]) for m in molecules)
    b = len(molecules)
    emb_dim = model.node_embedding.embedding_dim
    n = torch.zeros(b, max_atoms, emb_dim)
    n_mask_f = torch.zeros(b, max_atoms, emb_dim)
    xyz = torch.zeros(b, max_atoms, 3)
    xyz_mask = torch.zeros(b, max_atoms, 3)
    adj = torch.zeros(b, max_atoms, max_atoms, 1)
    adj_mask = torch.zeros(b, max_atoms, max_atoms, 1)
    for i, m in enumerate(molecules):
        na = len(m["node_number"])
        n[i, :na] = model.node_embedding(torch.tensor(m["node_number"]))
        n_mask_f[i, :na] = 1.0
        xyz[i, :na] = torch.tensor(m["node_coordinates"])
        xyz_mask[i, :na] = 1.0
        for (s, t), w in zip(m["edge_indices"], m["edge_weights"]):
            adj[i, s, t, 0] = w
            adj_mask[i, s, t, 0] = 1.0
    return n, n_mask_f, xyz, xyz_mask, adj, adj_mask


def bonds(pairs, orders):
    idx, w = [], []
    for (s, t), o in zip(pairs, orders):
        idx += [(s, t), (t, s)]
        w += [o, o]
    return idx, w


# three small molecules (atomic numbers, coordinates in Angstrom, bonds with bond order)
water_idx, water_w = bonds([(0, 1), (0, 2)], [1.0, 1.0])
methanol_idx, methanol_w = bonds([(0, 1), (1, 2), (0, 3), (0, 4), (0, 5)], [1.0, 1.0, 1.0, 1.0, 1.0])
acetaldehyde_idx, acetaldehyde_w = bonds([(0, 1), (1, 2), (0, 3), (0, 4), (0, 5), (1, 6)],
                                         [1.0, 2.0, 1.0, 1.0, 1.0, 1.0])
molecules = [
    {"node_number": [8, 1, 1],
     "node_coordinates": [[0.0, 0.0, 0.0], [0.96, 0.0, 0.0], [-0.24, 0.93, 0.0]],
     "edge_indices": water_idx, "edge_weights": water_w},
    {"node_number": [6, 8, 1, 1, 1, 1],
     "node_coordinates": [[0.0, 0.0, 0.0], [1.43, 0.0, 0.0], [1.75, 0.9, 0.0],
                          [-0.36, -1.03, 0.0], [-0.36, 0.51, 0.89], [-0.36, 0.51, -0.89]],
     "edge_indices": methanol_idx, "edge_weights": methanol_w},
    {"node_number": [6, 6, 8, 1, 1, 1, 1],
     "node_coordinates": [[0.0, 0.0, 0.0], [1.5, 0.0, 0.0], [2.1, 1.05, 0.0], [-0.36, -1.03, 0.0],
                          [-0.36, 0.51, 0.89], [-0.36, 0.51, -0.89], [2.05, -0.95, 0.0]],
     "edge_indices": acetaldehyde_idx, "edge_weights": acetaldehyde_w},
]

model = MAT()
model.eval()
with torch.no_grad():
    pred = model(*to_padded(molecules, model)).squeeze(-1)

print("MAT graph predictions (water, methanol, acetaldehyde):", pred.numpy().round(5))
