# Citation: datamol-io/graphium (then named "goli") commit 30026f95a853f2aebeba5b3c11d524d929ca5d21
#   "fix a few bugs when adding transformer and 3D bias".
# Upstream: goli/nn/pyg_layers/utils.py PreprocessPositions.forward + GaussianLayer,
#   goli/nn/encoders/gaussian_kernel_pos_encoder.py GaussianKernelPosEncoder.forward,
#   goli/ipu/to_dense_batch.py to_dense_batch / to_sparse_batch,
#   goli/nn/base_layers.py MultiheadAttentionMup.forward (biased_attention path),
#   goli/nn/pyg_layers/gps_pyg.py GPSLayerPyg._self_attention_block / _sa_block.
# Bug: the 3D Gaussian-kernel encoder (GPS++ on PCQM4Mv2) builds an attention bias and a 3D node
#   feature from a padded dense batch of molecules. Before the fix the padding mask on
#   `distance_feature` used the out-of-place `masked_fill` (result discarded), so padded atoms were
#   summed into every atom's 3D node feature; the "no conformer" mask was built per atom
#   ([batch, nodes]) and filled the bias with 0.0 over keys, and its fill on the node feature was
#   also out of place (the NaNs of molecules without conformers stayed in the features).
#   MultiheadAttentionMup filled padded keys with -inf.
# Fix: nan_mask = isnan(pos)[:, 0, 0] per molecule, applied as [batch,1,1,1] with -1000 on the bias
#   and [batch,1,1] in place on the node feature; `distance_feature.masked_fill_` (in place) over
#   padded key atoms; key_padding_mask filled with -10000 instead of -inf.
# Shrunk: tiny dims, the local MPNN of the GPS layer is left out (attention block only), mup init
#   replaced by torch defaults; torch_scatter.scatter_add replaced by index_add.
import sys
import math
from typing import Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor
from torch.nn.functional import linear

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


# ---------------------------------------------------------------- goli/ipu/to_dense_batch.py
def to_sparse_batch(x: Tensor, mask_idx: Tensor):
    return torch.index_select(x.reshape(-1, x.shape[-1]), 0, mask_idx)


def to_dense_batch(
    x: Tensor,
    batch: Optional[Tensor] = None,
    fill_value: float = 0.0,
    max_num_nodes_per_graph: Optional[int] = None,
    batch_size: Optional[int] = None,
    drop_nodes_last_graph=False,
):
    if batch is None:
        batch = x.new_zeros(x.size(0), dtype=torch.long)
    if batch_size is None:
        batch_size = int(batch.max()) + 1

    num_nodes = torch.zeros(batch_size, dtype=torch.long).index_add_(0, batch, batch.new_ones(x.size(0)))
    cum_nodes = torch.cat([batch.new_zeros(1), num_nodes.cumsum(dim=0)])

    if max_num_nodes_per_graph is None:
        max_num_nodes_per_graph = int(num_nodes.max())

    idx = torch.arange(batch.size(0), dtype=torch.long, device=x.device)
    idx = (idx - cum_nodes[batch]) + (batch * max_num_nodes_per_graph)

    size = [batch_size * max_num_nodes_per_graph] + list(x.size())[1:]
    out = x.new_full(size, fill_value)

    if drop_nodes_last_graph:
        num_nodes = num_nodes[:-1]
        idx[idx >= size[0]] = size[0] - 1

    out[idx] = x
    out = out.view([batch_size, max_num_nodes_per_graph] + list(x.size())[1:])

    mask_sz = batch_size * max_num_nodes_per_graph
    mask = torch.zeros(mask_sz, dtype=torch.bool, device=x.device)
    mask[idx] = 1
    mask = mask.view(batch_size, max_num_nodes_per_graph)
    return out, mask, idx


# ---------------------------------------------------------------- goli/nn/base_layers.py (MLP, shrunk)
class MLP(nn.Module):
    def __init__(self, in_dim, hidden_dims, out_dim, depth, activation="gelu", last_layer_is_readout=True):
        super().__init__()
        dims = [in_dim] + [hidden_dims] * (depth - 1) + [out_dim]
        layers = []
        for i in range(depth):
            layers.append(nn.Linear(dims[i], dims[i + 1]))
            if i < depth - 1 or not last_layer_is_readout:
                layers.append(nn.GELU())
        self.net = nn.Sequential(*layers)

    def forward(self, x):
        return self.net(x)


# ---------------------------------------------------------------- goli/nn/pyg_layers/utils.py
class PreprocessPositions(nn.Module):
    def __init__(self, num_heads, embed_dim, num_kernel, in_dim=3, num_layers=2, activation="gelu",
                 first_normalization="none"):
        super().__init__()
        self.num_heads = num_heads
        self.num_kernel = num_kernel
        self.embed_dim = embed_dim
        self.first_normalization = None  # "none"

        self.gaussian = GaussianLayer(self.num_kernel, in_dim=in_dim)
        self.gaussian_proj = MLP(
            in_dim=self.num_kernel,
            hidden_dims=self.num_kernel,
            out_dim=self.num_heads,
            depth=num_layers,
            activation=activation,
            last_layer_is_readout=True,
        )
        self.node_proj = nn.Linear(self.num_kernel, self.embed_dim)

    def forward(self, batch: dict, max_num_nodes_per_graph: int, on_ipu: bool, positions_3d_key: str):
        pos = batch[positions_3d_key]
        if self.first_normalization is not None:
            pos = self.first_normalization(pos)
        batch_size = None
        # pos: [batch, nodes, 3]  mask: [batch, nodes]  idx: [total_nodes]
        pos, mask, idx = to_dense_batch(
            pos,
            batch=batch["batch"],
            batch_size=batch_size,
            max_num_nodes_per_graph=max_num_nodes_per_graph,
            drop_nodes_last_graph=on_ipu,
        )
        if FIXED:
            # [batch]
            nan_mask = torch.isnan(pos)[:, 0, 0]
        else:
            # [batch, nodes]
            nan_mask = torch.isnan(pos)[:, :, 0]
        padding_mask = ~mask
        batch, n_node, _ = pos.shape
        # [batch, nodes, nodes, 3]
        delta_pos = pos.unsqueeze(1) - pos.unsqueeze(2)
        # [batch, nodes, nodes]
        distance = delta_pos.norm(dim=-1).view(-1, n_node, n_node)
        # [batch, nodes, nodes, num_kernel]
        distance_feature = self.gaussian(distance)
        # [batch, nodes, nodes, num_heads]
        attn_bias = self.gaussian_proj(distance_feature)
        # [batch, num_heads, nodes, nodes]
        attn_bias = attn_bias.permute(0, 3, 1, 2).contiguous()
        # padding_mask as [batch, 1, 1, nodes] on [batch, num_heads, nodes, nodes]
        attn_bias.masked_fill_(
            padding_mask.unsqueeze(1).unsqueeze(2),
            float("-1000"),
        )
        if FIXED:
            attn_bias.masked_fill_(
                nan_mask.unsqueeze(1).unsqueeze(2).unsqueeze(3),
                float("-1000"),
            )
            # padding_mask as [batch, 1, nodes, 1] on [batch, nodes, nodes, num_kernel]
            distance_feature.masked_fill_(padding_mask.unsqueeze(1).unsqueeze(-1).to(torch.bool), 0.0)
        else:
            attn_bias.masked_fill_(
                nan_mask.unsqueeze(1).unsqueeze(2),
                0.0,
            )
            distance_feature.masked_fill(padding_mask.unsqueeze(1).unsqueeze(-1).to(torch.bool), 0.0)
        # [batch, nodes, num_kernel]
        distance_feature_sum = distance_feature.sum(dim=-2)
        distance_feature_sum = distance_feature_sum.to(self.node_proj.weight.dtype)
        # [batch, nodes, embed_dim]
        node_feature = self.node_proj(distance_feature_sum)
        if FIXED:
            node_feature.masked_fill_(nan_mask.unsqueeze(1).unsqueeze(2).to(torch.bool), 0.0)
        else:
            node_feature.masked_fill(nan_mask.unsqueeze(-1).to(torch.bool), 0.0)
        # [total_nodes, embed_dim]
        node_feature = to_sparse_batch(node_feature, idx)
        return attn_bias, node_feature


class GaussianLayer(nn.Module):
    def __init__(self, num_kernels=128, in_dim=3):
        super().__init__()
        self.num_kernels = num_kernels
        self.means = nn.Embedding(1, num_kernels)
        self.stds = nn.Embedding(1, num_kernels)
        nn.init.uniform_(self.means.weight, 0, in_dim)
        nn.init.uniform_(self.stds.weight, 0, in_dim)

    def forward(self, input: Tensor) -> Tensor:
        input = input.unsqueeze(-1)
        expanded_input = input.expand(-1, -1, -1, self.num_kernels)
        mean = self.means.weight.float().view(-1)
        std = self.stds.weight.float().view(-1).abs() + 0.01
        pre_exp_factor = (2 * math.pi) ** 0.5
        tensor_with_kernel = torch.exp(-0.5 * (((expanded_input - mean) / std) ** 2)) / (pre_exp_factor * std)
        return tensor_with_kernel


# ---------------------------------------------------------------- goli/nn/encoders/gaussian_kernel_pos_encoder.py
class GaussianKernelPosEncoder(nn.Module):
    def __init__(self, input_keys, output_keys, in_dim, out_dim, embed_dim, num_layers, num_heads=1):
        super().__init__()
        self.input_keys = input_keys
        self.output_keys = output_keys
        self.preprocess_3d_positions = PreprocessPositions(
            num_heads=num_heads, embed_dim=embed_dim, num_kernel=out_dim, in_dim=in_dim,
            num_layers=num_layers, activation="gelu", first_normalization="none",
        )

    def forward(self, batch):
        on_ipu = False
        max_num_nodes_per_graph = None
        attn_bias_3d, node_feature_3d = self.preprocess_3d_positions(
            batch, max_num_nodes_per_graph, on_ipu, positions_3d_key=self.input_keys[0]
        )
        output = {}
        for key in self.output_keys:
            if key.startswith("graph_"):
                output[key] = attn_bias_3d
            else:
                output[key] = node_feature_3d
        return output


# ---------------------------------------------------------------- goli/nn/base_layers.py
class MultiheadAttentionMup(nn.MultiheadAttention):
    def __init__(self, biased_attention, **kwargs):
        super().__init__(**kwargs)
        self.biased_attention = biased_attention

    def forward(self, query, key, value, key_padding_mask=None, attn_bias=None, *args, **kwargs):
        if self.biased_attention and attn_bias is not None:
            batch, nodes, hidden = query.size()
            head_dim = self.embed_dim // self.num_heads
            scaling_factor = 1 / head_dim
            b_q, b_k, b_v = self.in_proj_bias.chunk(3)
            q_proj_weight, k_proj_weight, v_proj_weight = self.in_proj_weight.chunk(3)
            q = linear(query, q_proj_weight, b_q).view(batch, nodes, self.num_heads, -1).transpose(1, 2)
            k = linear(key, k_proj_weight, b_k).view(batch, nodes, self.num_heads, -1).transpose(1, 2)
            v = linear(value, v_proj_weight, b_v).view(batch, nodes, self.num_heads, -1).transpose(1, 2)
            q = q * scaling_factor
            attn_weights = q @ k.transpose(-1, -2)
            attn_weights += attn_bias
            if key_padding_mask is not None:
                masked_attn_weights = attn_weights.masked_fill(
                    key_padding_mask.unsqueeze(1).unsqueeze(2),
                    float("-10000") if FIXED else float("-inf"),
                )
            masked_attn_weights = F.softmax(masked_attn_weights, dim=-1)
            attn_probs = F.dropout(masked_attn_weights, p=self.dropout, training=self.training)
            attn = attn_probs @ v
            attn = attn.transpose(1, 2).contiguous().view(batch, nodes, self.embed_dim)
            out = (self.out_proj(attn), None)
        else:
            out = super().forward(query=query, key=key, value=value, key_padding_mask=key_padding_mask,
                                  *args, **kwargs)
        return out


# ---------------------------------------------------------------- goli/nn/pyg_layers/gps_pyg.py (attention block)
class GPSLayerPyg(nn.Module):
    def __init__(self, in_dim, num_heads, biased_attention_key="graph_gaussian_bias_3d"):
        super().__init__()
        self.biased_attention_key = biased_attention_key
        self.attn_layer = MultiheadAttentionMup(
            biased_attention=True, embed_dim=in_dim, num_heads=num_heads, dropout=0.0, batch_first=True
        )
        self.norm_layer_attn = nn.LayerNorm(in_dim)
        self.mlp = nn.Sequential(nn.Linear(in_dim, 2 * in_dim), nn.GELU(), nn.Linear(2 * in_dim, in_dim))
        self.norm_layer_ff = nn.LayerNorm(in_dim)

    def _to_dense_batch(self, h, batch, batch_size=None, max_num_nodes_per_graph=None, on_ipu=False):
        attn_mask = None
        h_dense, key_padding_mask, idx = to_dense_batch(
            h, batch=batch["batch"], batch_size=batch_size,
            max_num_nodes_per_graph=max_num_nodes_per_graph, drop_nodes_last_graph=on_ipu,
        )
        key_padding_mask = ~key_padding_mask
        return h_dense, attn_mask, key_padding_mask, idx

    def _sa_block(self, x, attn_bias, attn_mask=None, key_padding_mask=None):
        x = self.attn_layer(x, x, x, attn_bias=attn_bias, attn_mask=attn_mask,
                            key_padding_mask=key_padding_mask, need_weights=False)[0]
        return x

    def _self_attention_block(self, feat, feat_in, batch):
        feat_dense, attn_mask, key_padding_mask, idx = self._to_dense_batch(feat, batch=batch)
        attn_bias = None
        if self.biased_attention_key is not None:
            attn_bias = batch[self.biased_attention_key]
        feat_attn = self._sa_block(feat_dense, attn_bias=attn_bias, attn_mask=attn_mask,
                                   key_padding_mask=key_padding_mask)
        feat_attn = to_sparse_batch(feat_attn, idx)
        feat_attn = feat_in + feat_attn
        feat_attn = self.norm_layer_attn(feat_attn)
        return feat_attn

    def forward(self, batch):
        feat = batch["feat"]
        feat = self._self_attention_block(feat, feat, batch)
        feat = self.norm_layer_ff(feat + self.mlp(feat))
        batch["feat"] = feat
        return batch


class TinyGPSPlusPlus(nn.Module):
    def __init__(self, num_atom_types=10, hidden=16, num_heads=2, num_kernel=8, depth=2):
        super().__init__()
        self.atom_emb = nn.Embedding(num_atom_types, hidden)
        self.pe_encoder = GaussianKernelPosEncoder(
            input_keys=["positions_3d"], output_keys=["feat_3d", "graph_gaussian_bias_3d"],
            in_dim=3, out_dim=num_kernel, embed_dim=hidden, num_layers=2, num_heads=num_heads,
        )
        self.layers = nn.ModuleList([GPSLayerPyg(hidden, num_heads) for _ in range(depth)])
        self.head = nn.Linear(hidden, 1)

    def forward(self, batch):
        pe = self.pe_encoder(batch)
        batch["graph_gaussian_bias_3d"] = pe["graph_gaussian_bias_3d"]
        batch["feat"] = self.atom_emb(batch["atom_type"]) + pe["feat_3d"]
        for layer in self.layers:
            batch = layer(batch)
        # global mean pool
        n_graphs = int(batch["batch"].max()) + 1
        summed = torch.zeros(n_graphs, batch["feat"].shape[-1]).index_add_(0, batch["batch"], batch["feat"])
        counts = torch.bincount(batch["batch"], minlength=n_graphs).unsqueeze(-1).float()
        return self.head(summed / counts).squeeze(-1)


def make_batch():
    g = torch.Generator().manual_seed(1)
    sizes = [6, 3, 4, 5]  # atoms per molecule
    has_conformer = [True, True, True, False]  # PCQM4Mv2 valid/test molecules have no 3D conformer
    pos, atom, bvec = [], [], []
    for gi, (n, hc) in enumerate(zip(sizes, has_conformer)):
        p = torch.randn(n, 3, generator=g) * 1.3
        if not hc:
            p = torch.full((n, 3), float("nan"))
        pos.append(p)
        atom.append(torch.randint(0, 10, (n,), generator=g))
        bvec.append(torch.full((n,), gi, dtype=torch.long))
    return {
        "positions_3d": torch.cat(pos),
        "atom_type": torch.cat(atom),
        "batch": torch.cat(bvec),
    }


model = TinyGPSPlusPlus()
model.eval()
batch = make_batch()
targets = torch.tensor([4.1, 5.3, 3.7, 6.0])  # HOMO-LUMO gap style regression targets
with torch.no_grad():
    pred = model(dict(batch))
loss = F.l1_loss(pred, targets)
print("mode:", "fixed" if FIXED else "original")
print("per-molecule prediction:", [round(v, 4) for v in pred.tolist()])
print("MAE loss:", round(loss.item(), 4) if torch.isfinite(loss) else loss.item())
