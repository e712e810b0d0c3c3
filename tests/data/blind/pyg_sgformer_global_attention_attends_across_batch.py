# PyTorch Geometric SGFormer (pyg-team/pytorch_geometric#10045, commit c2bbb41): SGModule ran SGFormerAttention over the
# flat [num_nodes, F] node matrix of a mini-batch with no mask, so every node attended to nodes of the other graphs;
# the fix densifies with to_dense_batch(x, batch) and passes the node mask into the attention.
import sys
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


def to_dense_batch(x, batch):
    batch_size = int(batch.max()) + 1
    num_nodes = torch.bincount(batch, minlength=batch_size)
    max_n = int(num_nodes.max())
    cum = torch.cat([num_nodes.new_zeros(1), num_nodes.cumsum(0)[:-1]])
    idx = torch.arange(batch.numel()) - cum[batch] + batch * max_n
    out = x.new_zeros(batch_size * max_n, x.size(-1))
    out[idx] = x
    mask = torch.zeros(batch_size * max_n, dtype=torch.bool)
    mask[idx] = True
    return out.view(batch_size, max_n, -1), mask.view(batch_size, max_n)


class SGFormerAttention(torch.nn.Module):
    def __init__(self, channels: int, heads: int = 1, head_channels: int = 64, qkv_bias: bool = False) -> None:
        super().__init__()
        assert channels % heads == 0
        assert heads == 1, 'The number of heads are fixed as 1.'
        if head_channels is None:
            head_channels = channels // heads
        self.heads = heads
        self.head_channels = head_channels
        inner_channels = head_channels * heads
        self.q = torch.nn.Linear(channels, inner_channels, bias=qkv_bias)
        self.k = torch.nn.Linear(channels, inner_channels, bias=qkv_bias)
        self.v = torch.nn.Linear(channels, inner_channels, bias=qkv_bias)

    def forward(self, x: Tensor, mask: Optional[Tensor] = None) -> Tensor:
        if not FIXED:
            # feature transformation
            qs = self.q(x).reshape(-1, self.heads, self.head_channels)
            ks = self.k(x).reshape(-1, self.heads, self.head_channels)
            vs = self.v(x).reshape(-1, self.heads, self.head_channels)
            # normalize input
            qs = qs / torch.norm(qs, p=2)  # [N, H, M]
            ks = ks / torch.norm(ks, p=2)  # [L, H, M]
            N = qs.shape[0]
            # numerator
            kvs = torch.einsum("lhm,lhd->hmd", ks, vs)
            attention_num = torch.einsum("nhm,hmd->nhd", qs, kvs)  # [N, H, D]
            attention_num += N * vs
            # denominator
            all_ones = torch.ones([ks.shape[0]]).to(ks.device)
            ks_sum = torch.einsum("lhm,l->hm", ks, all_ones)
            attention_normalizer = torch.einsum("nhm,hm->nh", qs, ks_sum)  # [N, H]
            attention_normalizer = torch.unsqueeze(attention_normalizer, len(attention_normalizer.shape))  # [N, H, 1]
            attention_normalizer += torch.ones_like(attention_normalizer) * N
            attn_output = attention_num / attention_normalizer  # [N, H, D]
            return attn_output.mean(dim=1)

        B, N, *_ = x.shape
        qs, ks, vs = self.q(x), self.k(x), self.v(x)
        qs, ks, vs = map(lambda t: t.reshape(B, N, self.heads, self.head_channels), (qs, ks, vs))
        if mask is not None:
            mask = mask[:, :, None, None]
            vs.masked_fill_(~mask, 0.)
        # replace 0's with epsilon
        epsilon = 1e-6
        qs[qs == 0] = epsilon
        ks[ks == 0] = epsilon
        # normalize input, shape not changed
        qs, ks = map(lambda t: t / torch.linalg.norm(t, ord=2, dim=-1, keepdim=True), (qs, ks))
        # numerator
        kvs = torch.einsum("blhm,blhd->bhmd", ks, vs)
        attention_num = torch.einsum("bnhm,bhmd->bnhd", qs, kvs)
        attention_num += N * vs
        # denominator
        all_ones = torch.ones([B, N]).to(ks.device)
        ks_sum = torch.einsum("blhm,bl->bhm", ks, all_ones)
        attention_normalizer = torch.einsum("bnhm,bhm->bnh", qs, ks_sum)
        attention_normalizer = torch.unsqueeze(attention_normalizer, len(attention_normalizer.shape))
        attention_normalizer += torch.ones_like(attention_normalizer) * N
        attn_output = attention_num / attention_normalizer
        return attn_output.mean(dim=2)


class SGModule(torch.nn.Module):
    def __init__(self, in_channels, hidden_channels, num_layers=2, num_heads=1, dropout=0.5):
        super().__init__()
        self.attns = torch.nn.ModuleList()
        self.fcs = torch.nn.ModuleList()
        self.fcs.append(torch.nn.Linear(in_channels, hidden_channels))
        self.bns = torch.nn.ModuleList()
        self.bns.append(torch.nn.LayerNorm(hidden_channels))
        for _ in range(num_layers):
            self.attns.append(SGFormerAttention(hidden_channels, num_heads, hidden_channels))
            self.bns.append(torch.nn.LayerNorm(hidden_channels))
        self.dropout = dropout
        self.activation = F.relu

    def forward(self, x: Tensor, batch: Tensor):
        mask = None
        if FIXED:
            # to dense batch expects sorted batch
            batch, indices = batch.sort(stable=True)
            x = x[indices]
            x, mask = to_dense_batch(x, batch)
        layer_ = []
        x = self.fcs[0](x)
        x = self.bns[0](x)
        x = self.activation(x)
        x = F.dropout(x, p=self.dropout, training=self.training)
        layer_.append(x)
        for i, attn in enumerate(self.attns):
            x = attn(x, mask) if FIXED else attn(x)
            x = (x + layer_[i]) / 2.
            x = self.bns[i + 1](x)
            x = self.activation(x)
            x = F.dropout(x, p=self.dropout, training=self.training)
            layer_.append(x)
        if FIXED:
            x_mask = x[mask]
            # reverse the sorting
            return x_mask[indices.argsort()]
        return x


model = SGModule(in_channels=16, hidden_channels=32, num_layers=2).eval()

# a mini-batch of three graphs with 7, 4 and 5 nodes (PyG batch vector)
sizes = [7, 4, 5]
batch = torch.cat([torch.full((s,), g) for g, s in enumerate(sizes)])
x = torch.randn(batch.numel(), 16)

with torch.no_grad():
    out = model(x, batch)
    # change only graph 2's node features; graphs 0 and 1 must not move
    x2 = x.clone()
    x2[batch == 2] = torch.randn(int((batch == 2).sum()), 16)
    out2 = model(x2, batch)
    leak = (out2[batch != 2] - out[batch != 2]).abs().max().item()

print(f"max change in graphs 0/1 outputs after editing graph 2 only: {leak:.6f}")
