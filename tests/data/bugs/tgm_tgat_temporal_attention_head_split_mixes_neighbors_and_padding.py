# tgm-team/tgm#168 (commit a706f75d, "Update Temporal Attention"): TemporalAttention split K/V/Q into heads with
# K.reshape(B, n_heads, -1, head_dim) on a (B, num_nbrs, out_dim) tensor, so each head's "neighbor n" row was cut
# from other neighbors' features while nbr_mask still masked slot n: padded neighbors leaked into valid slots.
# The fix reshapes to (B, -1, n_heads, head_dim) and permutes (plus a residual to the query and bias-free Q/KV).
import sys

import torch
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class TemporalAttention(torch.nn.Module):
    def __init__(self, n_heads, node_dim, edge_dim, time_dim, out_dim=None, dropout=0.1):
        super().__init__()
        if FIXED:
            out_dim = node_dim + time_dim
            self.pad_dim = 0
            if out_dim % n_heads != 0:
                self.pad_dim = n_heads - out_dim % n_heads
                out_dim += self.pad_dim
        elif out_dim % n_heads != 0:
            raise ValueError(f'out_dim: ({out_dim}) % n_heads: ({n_heads}) != 0')

        self.n_heads = n_heads
        self.head_dim = out_dim // n_heads
        self.out_dim = out_dim

        if FIXED:
            key_dim = node_dim + edge_dim + time_dim
            self.W_Q = torch.nn.Linear(out_dim, out_dim, bias=False)
            self.W_KV = torch.nn.Linear(key_dim, out_dim * 2, bias=False)
        else:
            self.W_Q = torch.nn.Linear(node_dim + time_dim, out_dim)
            self.W_KV = torch.nn.Linear(node_dim + edge_dim + time_dim, out_dim * 2)
        self.W_O = torch.nn.Linear(out_dim, out_dim)

        self.dropout = torch.nn.Dropout(dropout)
        self.layer_norm = torch.nn.LayerNorm(out_dim)

    def forward(self, node_feat, time_feat, edge_feat, nbr_node_feat, nbr_time_feat, nbr_mask):
        if FIXED:
            node_feat = F.pad(node_feat, (0, self.pad_dim)) if self.pad_dim else node_feat
            Q = R = torch.cat([node_feat, time_feat], dim=1).unsqueeze(1)  # (B, 1, out_dim)
        else:
            Q = torch.cat([node_feat, time_feat], dim=-1)  # (batch, node_dim + time_dim)
        Q = self.W_Q(Q)

        Z = torch.cat([nbr_node_feat, edge_feat, nbr_time_feat], dim=-1)
        Z = self.W_KV(Z)
        K = Z[:, :, : self.out_dim]  # (batch, num_nbrs, out_dim)
        V = Z[:, :, self.out_dim :]  # (batch, num_nbrs, out_dim)

        if FIXED:
            Q = Q.reshape(Q.shape[0], -1, self.n_heads, self.head_dim).permute(0, 2, 1, 3)
            K = K.reshape(K.shape[0], -1, self.n_heads, self.head_dim).permute(0, 2, 1, 3)
            V = V.reshape(V.shape[0], -1, self.n_heads, self.head_dim).permute(0, 2, 1, 3)
        else:
            Q = Q.reshape(Q.shape[0], self.n_heads, 1, self.head_dim)
            K = K.reshape(K.shape[0], self.n_heads, -1, self.head_dim)
            V = V.reshape(V.shape[0], self.n_heads, -1, self.head_dim)
        del Z

        A = torch.einsum('bhld,bhnd->bhln', Q, K)  # (batch, n_heads, 1, num_nbrs)
        A *= self.head_dim**-0.5
        del Q, K

        nbr_mask = nbr_mask == 0
        nbr_mask = nbr_mask.reshape(nbr_mask.shape[0], 1, 1, -1)
        nbr_mask = nbr_mask.repeat(1, self.n_heads, 1, 1)

        # If a node has no neighbors (nbr_mask all zero), setting masks to -np.inf will cause softmax nans
        # Choose a very large negative number (-1e10 following TGAT) instead
        A = A.masked_fill(nbr_mask, -1e10)
        A = torch.softmax(A, dim=-1)
        A = self.dropout(A)

        O = torch.einsum('bhln,bhnd->bhld', A, V)  # (batch, n_heads, 1, head_dim)
        O = O.flatten(start_dim=1)  # (batch, out_dim)
        del A

        out = self.W_O(O)  # (batch, out_dim)
        out = self.dropout(out)
        if FIXED:
            out = self.layer_norm(out + R.squeeze(1))
        else:
            out = self.layer_norm(out)
        return out


class Time2Vec(torch.nn.Module):  # TGAT cosine time encoding
    def __init__(self, time_dim):
        super().__init__()
        self.w = torch.nn.Linear(1, time_dim)

    def forward(self, t):
        return torch.cos(self.w(t.unsqueeze(-1)))


node_dim, edge_dim, time_dim, n_heads = 32, 8, 32, 4
num_nodes, num_nbrs, batch_size = 50, 10, 16

node_x = torch.randn(num_nodes, node_dim)
time_encoder = Time2Vec(time_dim)
attn = TemporalAttention(n_heads, node_dim, edge_dim, time_dim, node_dim + time_dim)
link_head = torch.nn.Sequential(torch.nn.Linear(2 * attn.out_dim, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
opt = torch.optim.Adam(list(time_encoder.parameters()) + list(attn.parameters()) + list(link_head.parameters()), lr=1e-3)

# recency-sampled neighborhoods: each node has a different number of real neighbors; the rest are padded slots
src = torch.randint(0, num_nodes, (batch_size,))
dst = torch.randint(0, num_nodes, (batch_size,))
neg = torch.randint(0, num_nodes, (batch_size,))
t_now = torch.rand(batch_size) * 100 + 100


def embed(nodes):
    n_real = (nodes % num_nbrs) + 1
    nbr_mask = (torch.arange(num_nbrs)[None, :] < n_real[:, None]).float()
    nbr_ids = torch.randint(0, num_nodes, (len(nodes), num_nbrs))
    nbr_t = t_now[:, None] - torch.rand(len(nodes), num_nbrs) * 100
    nbr_node_feat = node_x[nbr_ids] * nbr_mask[..., None]
    edge_feat = torch.randn(len(nodes), num_nbrs, edge_dim) * nbr_mask[..., None]
    nbr_time_feat = time_encoder(t_now[:, None] - nbr_t)
    time_feat = time_encoder(torch.zeros(len(nodes)))
    return attn(node_x[nodes], time_feat, edge_feat, nbr_node_feat, nbr_time_feat, nbr_mask)


attn.train()
z_src, z_dst, z_neg = embed(src), embed(dst), embed(neg)
pos = link_head(torch.cat([z_src, z_dst], -1))
negs = link_head(torch.cat([z_src, z_neg], -1))
loss = F.binary_cross_entropy_with_logits(pos, torch.ones_like(pos)) + \
    F.binary_cross_entropy_with_logits(negs, torch.zeros_like(negs))
opt.zero_grad()
loss.backward()
opt.step()
print(f"loss {loss.item():.5f}  z_src-norm {z_src.norm().item():.4f}")
