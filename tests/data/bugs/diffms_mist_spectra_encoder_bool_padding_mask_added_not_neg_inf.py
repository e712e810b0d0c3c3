# DiffMS (MIST spectra encoder), coleygroup/DiffMS#25 (fixed by coleygroup/DiffMS#26).
# MultiheadAttention._scaled_dot_product_attention builds a -inf mask from the key padding
# mask but then adds the raw boolean mask (+1 on padded peaks), so padded peaks are attended.
import math
import sys
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn import Dropout, LayerNorm, Linear, Module, Parameter
from torch.nn.init import constant_, xavier_uniform_

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class MultiheadAttention(Module):
    def __init__(self, embed_dim, num_heads, dropout=0.0, batch_first=False):
        super().__init__()
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.dropout = dropout
        self.batch_first = batch_first
        self.head_dim = embed_dim // num_heads
        self.in_proj_weight = Parameter(torch.empty((3 * embed_dim, embed_dim)))
        self.in_proj_bias = Parameter(torch.empty(3 * embed_dim))
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=True)
        xavier_uniform_(self.in_proj_weight)
        constant_(self.in_proj_bias, 0.0)
        constant_(self.out_proj.bias, 0.0)

    def forward(self, query, key, value, key_padding_mask=None, pairwise_features=None):
        return self.multi_head_attention_forward(
            query, key, value, self.embed_dim, self.num_heads, self.in_proj_weight,
            self.in_proj_bias, self.dropout, self.out_proj.weight, self.out_proj.bias,
            training=self.training, key_padding_mask=key_padding_mask,
        )

    def multi_head_attention_forward(self, query, key, value, embed_dim_to_check, num_heads,
                                     in_proj_weight, in_proj_bias, dropout_p, out_proj_weight,
                                     out_proj_bias, training=True, key_padding_mask=None):
        tgt_len, bsz, embed_dim = query.shape
        head_dim = embed_dim // num_heads
        q, k, v = F.linear(query, in_proj_weight, in_proj_bias).chunk(3, dim=-1)
        q = q.contiguous().view(tgt_len, bsz * num_heads, head_dim).transpose(0, 1)
        k = k.contiguous().view(k.shape[0], bsz * num_heads, head_dim).transpose(0, 1)
        v = v.contiguous().view(v.shape[0], bsz * num_heads, head_dim).transpose(0, 1)
        src_len = k.size(1)

        # merge key padding and attention masks
        attn_mask = None
        if key_padding_mask is not None:
            key_padding_mask = (
                key_padding_mask.view(bsz, 1, 1, src_len)
                .expand(-1, num_heads, -1, -1)
                .reshape(bsz * num_heads, 1, src_len)
            )
            attn_mask = key_padding_mask
            assert attn_mask.dtype == torch.bool
        if not training:
            dropout_p = 0.0
        attn_output, attn_output_weights = self._scaled_dot_product_attention(
            q, k, v, attn_mask, dropout_p
        )
        attn_output = attn_output.transpose(0, 1).contiguous().view(tgt_len * bsz, embed_dim)
        attn_output = F.linear(attn_output, out_proj_weight, out_proj_bias)
        attn_output = attn_output.view(tgt_len, bsz, attn_output.size(1))
        attn_output_weights = attn_output_weights.view(bsz, num_heads, tgt_len, src_len)
        return attn_output, attn_output_weights

    def _scaled_dot_product_attention(self, q: Tensor, k: Tensor, v: Tensor,
                                      attn_mask: Optional[Tensor] = None,
                                      dropout_p: float = 0.0) -> Tuple[Tensor, Tensor]:
        B, Nt, E = q.shape
        q = q / math.sqrt(E)
        # (B, Nt, E) x (B, E, Ns) -> (B, Nt, Ns)
        attn = torch.bmm(q, k.transpose(-2, -1))
        if attn_mask is not None:
            new_attn_mask = torch.zeros_like(attn_mask, dtype=q.dtype)
            new_attn_mask.masked_fill_(attn_mask, float("-inf"))
            if FIXED:
                attn += new_attn_mask
            else:
                attn += attn_mask
        attn = F.softmax(attn, dim=-1)
        if dropout_p > 0.0:
            attn = F.dropout(attn, p=dropout_p)
        output = torch.bmm(attn, v)
        return output, attn


class TransformerEncoderLayer(Module):
    def __init__(self, d_model, nhead, dim_feedforward=64, dropout=0.1, activation=F.relu):
        super().__init__()
        self.self_attn = MultiheadAttention(d_model, nhead, dropout=dropout)
        self.linear1 = Linear(d_model, dim_feedforward)
        self.dropout = Dropout(dropout)
        self.linear2 = Linear(dim_feedforward, d_model)
        self.norm_first = False
        self.norm1 = LayerNorm(d_model)
        self.norm2 = LayerNorm(d_model)
        self.dropout1 = Dropout(dropout)
        self.dropout2 = Dropout(dropout)
        self.activation = activation

    def forward(self, src, pairwise_features=None, src_key_padding_mask=None):
        x = src
        x = self.norm1(x + self._sa_block(x, pairwise_features, src_key_padding_mask))
        x = self.norm2(x + self._ff_block(x))
        return x, pairwise_features

    def _sa_block(self, x, pairwise_features, key_padding_mask):
        x = self.self_attn(x, x, x, key_padding_mask=key_padding_mask,
                           pairwise_features=pairwise_features)[0]
        return self.dropout1(x)

    def _ff_block(self, x):
        x = self.linear2(self.dropout(self.activation(self.linear1(x))))
        return self.dropout2(x)


class FormulaTransformer(nn.Module):
    """Trimmed MIST spectra encoder: peak embeddings -> peak attention layers -> cls pooling."""

    def __init__(self, hidden_size=32, attn_heads=4, peak_attn_layers=2, cls_type=1):
        super().__init__()
        self.hidden_size = hidden_size
        self.cls_type = cls_type
        self.intermediate_layer = nn.Sequential(nn.Linear(hidden_size, hidden_size), nn.ReLU())
        self.peak_attn_layers = nn.ModuleList(
            [TransformerEncoderLayer(hidden_size, attn_heads) for _ in range(peak_attn_layers)]
        )

    def forward(self, batch):
        num_peaks = batch["num_peaks"]
        peak_types = batch["types"]
        device = num_peaks.device
        batch_dim = num_peaks.shape[0]
        peak_tensor = self.intermediate_layer(batch["input_vec"])
        # B x Np x d -> Np x B x d
        peak_tensor = peak_tensor.transpose(0, 1)
        peak_dim = peak_tensor.shape[0]
        peaks_aranged = torch.arange(peak_dim).to(device)
        # batch x num peaks
        attn_mask = ~(peaks_aranged[None, :] < num_peaks[:, None])
        pairwise_features = None
        for peak_attn_layer in self.peak_attn_layers:
            peak_tensor, pairwise_features = peak_attn_layer(
                peak_tensor, pairwise_features=pairwise_features, src_key_padding_mask=attn_mask
            )
        return self._pool_out(peak_tensor, peak_types, attn_mask)

    def _pool_out(self, peak_tensor, peak_types, attn_mask):
        zero_mask = attn_mask[:, :, None].repeat(1, 1, self.hidden_size).transpose(0, 1)
        peak_tensor[zero_mask] = 0
        pool_factor = (peak_types == self.cls_type).float()
        output = torch.einsum("nbd,bn->bd", peak_tensor, pool_factor)
        return output


model = FormulaTransformer().eval()
lengths = [10, 4, 7]  # peaks per spectrum (cls peak first)
Np = max(lengths)
input_vec = torch.randn(len(lengths), Np, 32)
types = torch.zeros(len(lengths), Np, dtype=torch.long)
types[:, 0] = 1
for i, n in enumerate(lengths):
    input_vec[i, n:] = 0.0
    types[i, n:] = 2  # padding peak type
batch = {"num_peaks": torch.tensor(lengths), "types": types, "input_vec": input_vec}

with torch.no_grad():
    batched = model(batch)
    max_diff = 0.0
    for i, n in enumerate(lengths):
        single = {"num_peaks": torch.tensor([n]), "types": types[i:i + 1, :n],
                  "input_vec": input_vec[i:i + 1, :n]}
        alone = model(single)
        max_diff = max(max_diff, (batched[i] - alone[0]).abs().max().item())
print(f"max |batched - per-spectrum| cls embedding: {max_diff:.6f}")
