# pytorch_geometric: SetTransformerAggregation (pyg-team/pytorch_geometric#6338, commit 0758c92).
# Before the fix, forward() did `x, _ = self.to_dense_batch(...)` and threw the mask away, so the SAB encoder and the
# PMA pooling attended to the zero rows that to_dense_batch pads smaller sets with; the fix passes `mask` to them.
import math
import sys
from typing import Optional

import torch
from torch import Tensor
from torch.nn import LayerNorm, Linear, MultiheadAttention, Parameter

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


def to_dense_batch(x: Tensor, batch: Tensor, fill_value: float = 0.0, batch_size: Optional[int] = None):
    # torch_geometric.utils.to_dense_batch (sorted batch vector)
    if batch_size is None:
        batch_size = int(batch.max()) + 1
    num_nodes = torch.bincount(batch, minlength=batch_size)
    cum_nodes = torch.cat([batch.new_zeros(1), num_nodes.cumsum(0)])
    max_num_nodes = int(num_nodes.max())
    idx = torch.arange(batch.size(0)) - cum_nodes[batch] + batch * max_num_nodes
    out = x.new_full((batch_size * max_num_nodes, x.size(-1)), fill_value)
    out[idx] = x
    out = out.view(batch_size, max_num_nodes, x.size(-1))
    mask = torch.zeros(batch_size * max_num_nodes, dtype=torch.bool)
    mask[idx] = True
    return out, mask.view(batch_size, max_num_nodes)


class Aggregation(torch.nn.Module):
    def to_dense_batch(self, x, index=None, ptr=None, dim_size=None, dim=-2):
        return to_dense_batch(x, index, fill_value=0.0, batch_size=dim_size)


# ---------------------------------------------------------------- before the fix: torch_geometric/nn/aggr/gmt.py
class MAB(torch.nn.Module):
    r"""Multihead-Attention Block."""
    def __init__(self, dim_Q, dim_K, dim_V, num_heads, Conv=None, layer_norm=False):
        super().__init__()
        self.dim_V = dim_V
        self.num_heads = num_heads
        self.layer_norm = layer_norm
        self.fc_q = Linear(dim_Q, dim_V)
        self.layer_k = Linear(dim_K, dim_V)
        self.layer_v = Linear(dim_K, dim_V)
        if layer_norm:
            self.ln0 = LayerNorm(dim_V)
            self.ln1 = LayerNorm(dim_V)
        self.fc_o = Linear(dim_V, dim_V)

    def forward(self, Q, K, graph=None, mask=None):
        Q = self.fc_q(Q)
        K, V = self.layer_k(K), self.layer_v(K)
        dim_split = self.dim_V // self.num_heads
        Q_ = torch.cat(Q.split(dim_split, 2), dim=0)
        K_ = torch.cat(K.split(dim_split, 2), dim=0)
        V_ = torch.cat(V.split(dim_split, 2), dim=0)
        if mask is not None:
            mask = torch.cat([mask for _ in range(self.num_heads)], 0)
            attention_score = Q_.bmm(K_.transpose(1, 2))
            attention_score = attention_score / math.sqrt(self.dim_V)
            A = torch.softmax(mask + attention_score, 1)
        else:
            A = torch.softmax(Q_.bmm(K_.transpose(1, 2)) / math.sqrt(self.dim_V), 2)
        out = torch.cat((Q_ + A.bmm(V_)).split(Q.size(0), 0), 2)
        if self.layer_norm:
            out = self.ln0(out)
        out = out + self.fc_o(out).relu()
        if self.layer_norm:
            out = self.ln1(out)
        return out


class SAB(torch.nn.Module):
    def __init__(self, in_channels, out_channels, num_heads, Conv=None, layer_norm=False):
        super().__init__()
        self.mab = MAB(in_channels, in_channels, out_channels, num_heads, Conv=Conv, layer_norm=layer_norm)

    def forward(self, x, graph=None, mask=None):
        return self.mab(x, x, graph, mask)


class PMA(torch.nn.Module):
    def __init__(self, channels, num_heads, num_seeds, Conv=None, layer_norm=False):
        super().__init__()
        self.S = torch.nn.Parameter(torch.Tensor(1, num_seeds, channels))
        self.mab = MAB(channels, channels, channels, num_heads, Conv=Conv, layer_norm=layer_norm)
        torch.nn.init.xavier_uniform_(self.S)

    def forward(self, x, graph=None, mask=None):
        return self.mab(self.S.repeat(x.size(0), 1, 1), x, graph, mask)


class SetTransformer(torch.nn.Module):
    def __init__(self, dim_input, num_outputs, dim_output, num_enc_SABs, num_dec_SABs, dim_hidden=128,
                 num_heads=4, ln=False):
        super().__init__()
        self.enc = torch.nn.Sequential(
            SAB(dim_input, dim_hidden, num_heads, layer_norm=ln), *[
                SAB(dim_hidden, dim_hidden, num_heads, layer_norm=ln) for _ in range(num_enc_SABs)])
        self.dec = torch.nn.Sequential(
            PMA(dim_hidden, num_heads, num_outputs, layer_norm=ln), *[
                SAB(dim_hidden, dim_hidden, num_heads, layer_norm=ln) for _ in range(num_dec_SABs)
            ], torch.nn.Linear(dim_hidden, dim_output))

    def forward(self, X):
        return self.dec(self.enc(X))


class SetTransformerAggregationBefore(Aggregation):
    def __init__(self, in_channels, out_channels, num_PMA_outputs, num_enc_SABs, num_dec_SABs, dim_hidden,
                 num_heads, ln=False):
        super().__init__()
        self.set_transformer_agg = SetTransformer(in_channels, num_PMA_outputs, out_channels, num_enc_SABs,
                                                  num_dec_SABs, dim_hidden, num_heads, ln)

    def forward(self, x, index=None, ptr=None, dim_size=None, dim=-2):
        x, _ = self.to_dense_batch(x, index, ptr, dim_size, dim)
        x = self.set_transformer_agg(x)
        return x.mean(dim=1)


# ---------------------------------------------------------------- after the fix: torch_geometric/nn/aggr/utils.py
class MultiheadAttentionBlock(torch.nn.Module):
    def __init__(self, channels, heads=1, layer_norm=True):
        super().__init__()
        self.channels = channels
        self.heads = heads
        self.attn = MultiheadAttention(channels, heads, batch_first=True)
        self.lin = Linear(channels, channels)
        self.layer_norm1 = LayerNorm(channels) if layer_norm else None
        self.layer_norm2 = LayerNorm(channels) if layer_norm else None

    def forward(self, x, y, x_mask=None, y_mask=None):
        if y_mask is not None:
            y_mask = ~y_mask
        out, _ = self.attn(x, y, y, y_mask, need_weights=False)
        if x_mask is not None:
            out[~x_mask] = 0.
        out = out + x
        if self.layer_norm1 is not None:
            out = self.layer_norm1(out)
        out = out + self.lin(out).relu()
        if self.layer_norm2 is not None:
            out = self.layer_norm2(out)
        return out


class SetAttentionBlock(torch.nn.Module):
    def __init__(self, channels, heads=1, layer_norm=True):
        super().__init__()
        self.mab = MultiheadAttentionBlock(channels, heads, layer_norm)

    def forward(self, x, mask=None):
        return self.mab(x, x, mask, mask)


class PoolingByMultiheadAttention(torch.nn.Module):
    def __init__(self, channels, num_seed_points=1, heads=1, layer_norm=True):
        super().__init__()
        self.lin = Linear(channels, channels)
        self.seed = Parameter(torch.Tensor(1, num_seed_points, channels))
        self.mab = MultiheadAttentionBlock(channels, heads, layer_norm)
        torch.nn.init.xavier_uniform_(self.seed)

    def forward(self, x, mask=None):
        x = self.lin(x).relu()
        return self.mab(self.seed.expand(x.size(0), -1, -1), x, y_mask=mask)


class SetTransformerAggregation(Aggregation):
    def __init__(self, channels, num_seed_points=1, num_encoder_blocks=1, num_decoder_blocks=1, heads=1,
                 concat=True, layer_norm=False):
        super().__init__()
        self.concat = concat
        self.encoders = torch.nn.ModuleList([
            SetAttentionBlock(channels, heads, layer_norm) for _ in range(num_encoder_blocks)])
        self.pma = PoolingByMultiheadAttention(channels, num_seed_points, heads, layer_norm)
        self.decoders = torch.nn.ModuleList([
            SetAttentionBlock(channels, heads, layer_norm) for _ in range(num_decoder_blocks)])

    def forward(self, x, index=None, ptr=None, dim_size=None, dim=-2):
        x, mask = self.to_dense_batch(x, index, ptr, dim_size, dim)
        for encoder in self.encoders:
            x = encoder(x, mask)
        x = self.pma(x, mask)
        for decoder in self.decoders:
            x = decoder(x)
        return x.flatten(1, 2) if self.concat else x.mean(dim=1)


# The upstream fix rewrote the module (new blocks in aggr/utils.py); both versions are kept, trimmed, and
# --fixed selects the one after the fix. Same depth: 2 SABs in the encoder, PMA with 2 seeds, 1 SAB decoder.
C = 16
if FIXED:
    aggr = SetTransformerAggregation(C, num_seed_points=2, num_encoder_blocks=2, num_decoder_blocks=1, heads=4)
else:
    aggr = SetTransformerAggregationBefore(C, C, 2, 1, 1, C, 4)
aggr.eval()

# three sets (e.g. the neighbourhoods / graphs being pooled) of different sizes, flattened with a sorted index
sizes = [7, 3, 5]
x = torch.randn(sum(sizes), C)
index = torch.cat([torch.full((n,), i, dtype=torch.long) for i, n in enumerate(sizes)])

with torch.no_grad():
    batched = aggr(x, index, dim_size=len(sizes))
    diffs = []
    start = 0
    for i, n in enumerate(sizes):
        alone = aggr(x[start:start + n], torch.zeros(n, dtype=torch.long), dim_size=1)
        diffs.append((batched[i] - alone[0]).abs().max().item())
        start += n

print("per-set max |batched - alone|:", [f"{d:.3e}" for d in diffs])
print(f"max diff padded batch vs each set alone: {max(diffs):.6e}")
