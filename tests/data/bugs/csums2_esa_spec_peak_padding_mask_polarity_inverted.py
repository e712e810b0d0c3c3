# CSU-MS2 (tingxiecsu/CSU-MS2#4, fixed in tingxiecsu/CSU-MS2 commit 0f37fc7): ESA_SPEC, the attention
# pooling over spectrum peaks, treats the peak padding mask (True = padded peak) as if True meant "keep",
# so it attends only to padded peaks and returns an all-zero embedding for an unpadded spectrum.
import math
import sys

import numpy as np
import torch
import torch.nn as nn
from torch import Tensor
from torch.nn import functional as F
from torch.nn import Module, LayerNorm, Linear, Dropout, Parameter
from torch.nn.init import xavier_uniform_, constant_

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


# ---- nn_utils/transformer_layers.py (trimmed: scaled dot product path only) ----
class TransformerEncoderLayer(Module):
    def __init__(self, d_model, nhead, dim_feedforward=2048, dropout=0.1, activation=F.relu,
                 layer_norm_eps=1e-5, batch_first=False, norm_first=False, additive_attn=False,
                 pairwise_featurization=False):
        super().__init__()
        self.pairwise_featurization = pairwise_featurization
        self.self_attn = MultiheadAttention(d_model, nhead, dropout=dropout, batch_first=batch_first,
                                            additive_attn=additive_attn,
                                            pairwise_featurization=self.pairwise_featurization)
        self.linear1 = Linear(d_model, dim_feedforward)
        self.dropout = Dropout(dropout)
        self.linear2 = Linear(dim_feedforward, d_model)
        self.norm_first = norm_first
        self.norm1 = LayerNorm(d_model, eps=layer_norm_eps)
        self.norm2 = LayerNorm(d_model, eps=layer_norm_eps)
        self.dropout1 = Dropout(dropout)
        self.dropout2 = Dropout(dropout)
        self.activation = activation

    def forward(self, src, pairwise_features=None, src_key_padding_mask=None):
        x = src
        if self.norm_first:
            x = x + self._sa_block(self.norm1(x), pairwise_features, src_key_padding_mask)
            x = x + self._ff_block(self.norm2(x))
        else:
            x = self.norm1(x + self._sa_block(x, pairwise_features, src_key_padding_mask))
            x = self.norm2(x + self._ff_block(x))
        return x, pairwise_features

    def _sa_block(self, x, pairwise_features, key_padding_mask):
        x = self.self_attn(x, x, x, key_padding_mask=key_padding_mask, pairwise_features=pairwise_features)[0]
        return self.dropout1(x)

    def _ff_block(self, x):
        x = self.linear2(self.dropout(self.activation(self.linear1(x))))
        return self.dropout2(x)


class MultiheadAttention(Module):
    def __init__(self, embed_dim, num_heads, dropout=0.0, batch_first=False, additive_attn=False,
                 pairwise_featurization=False):
        super().__init__()
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.dropout = dropout
        self.batch_first = batch_first
        self.additive_attn = additive_attn
        self.pairwise_featurization = pairwise_featurization
        self.in_proj_weight = Parameter(torch.empty((3 * embed_dim, embed_dim)))
        self.in_proj_bias = Parameter(torch.empty(3 * embed_dim))
        self.out_proj = nn.Linear(embed_dim, embed_dim)
        xavier_uniform_(self.in_proj_weight)
        constant_(self.in_proj_bias, 0.0)
        constant_(self.out_proj.bias, 0.0)

    def forward(self, query, key, value, key_padding_mask=None, pairwise_features=None):
        attn_output, attn_output_weights = self.multi_head_attention_forward(
            query, key, value, self.embed_dim, self.num_heads, self.in_proj_weight, self.in_proj_bias,
            self.dropout, self.out_proj.weight, self.out_proj.bias, training=self.training,
            key_padding_mask=key_padding_mask, pairwise_features=pairwise_features)
        return attn_output, attn_output_weights

    def multi_head_attention_forward(self, query, key, value, embed_dim_to_check, num_heads, in_proj_weight,
                                     in_proj_bias, dropout_p, out_proj_weight, out_proj_bias, training=True,
                                     key_padding_mask=None, pairwise_features=None):
        tgt_len, bsz, embed_dim = query.shape
        head_dim = embed_dim // num_heads
        q, k, v = F.linear(query, in_proj_weight, in_proj_bias).chunk(3, dim=-1)
        q = q.contiguous().view(tgt_len, bsz * num_heads, head_dim).transpose(0, 1)
        k = k.contiguous().view(k.shape[0], bsz * num_heads, head_dim).transpose(0, 1)
        v = v.contiguous().view(v.shape[0], bsz * num_heads, head_dim).transpose(0, 1)
        src_len = k.size(1)
        attn_mask = None
        if key_padding_mask is not None:
            key_padding_mask = (key_padding_mask.view(bsz, 1, 1, src_len)
                                .expand(-1, num_heads, -1, -1).reshape(bsz * num_heads, 1, src_len))
            attn_mask = key_padding_mask
        if not training:
            dropout_p = 0.0
        attn_output, attn_output_weights = self._scaled_dot_product_attention(q, k, v, attn_mask, dropout_p)
        attn_output = attn_output.transpose(0, 1).contiguous().view(tgt_len * bsz, embed_dim)
        attn_output = F.linear(attn_output, out_proj_weight, out_proj_bias)
        attn_output = attn_output.view(tgt_len, bsz, attn_output.size(1))
        return attn_output, attn_output_weights.view(bsz, num_heads, tgt_len, src_len)

    def _scaled_dot_product_attention(self, q, k, v, attn_mask=None, dropout_p=0.0, pairwise_features=None):
        B, Nt, E = q.shape
        q = q / math.sqrt(E)
        attn = torch.bmm(q, k.transpose(-2, -1))
        if attn_mask is not None:
            new_attn_mask = torch.zeros_like(attn_mask, dtype=q.dtype)
            new_attn_mask.masked_fill_(attn_mask, float("-inf"))
            attn += attn_mask  # upstream code as written at this commit (not part of this bug)
        attn = F.softmax(attn, dim=-1)
        if dropout_p > 0.0:
            attn = F.dropout(attn, p=dropout_p)
        output = torch.bmm(attn, v)
        return output, attn


def get_clones(module, N):
    import copy
    return nn.ModuleList([copy.deepcopy(module) for _ in range(N)])


# ---- CSU-MS2/model.py ----
class FourierEmbedder(nn.Module):
    def __init__(self, spec_embed_dim, logmin=2.5, logmax=3.3):
        super().__init__()
        self.d = spec_embed_dim
        lambda_min = np.power(10, -logmin)
        lambda_max = np.power(10, logmax)
        index = torch.arange(np.ceil(self.d / 2))
        exp = torch.pow(lambda_max / lambda_min, (2 * index) / (self.d - 2))
        freqs = 2 * np.pi * (lambda_min * exp) ** (-1)
        self.freqs = nn.Parameter(freqs.float(), requires_grad=False)

    def forward(self, mz):
        freq_input = torch.einsum("bi,j->bij", mz, self.freqs)
        embedded = torch.cat([torch.sin(freq_input), torch.cos(freq_input)], -1)
        return embedded[:, :, : self.d]


class MSModel(nn.Module):
    def __init__(self, spec_embed_dim, dropout, layers):
        super().__init__()
        self.mz_embedder = FourierEmbedder(spec_embed_dim)
        self.input_compress = nn.Linear(spec_embed_dim + 1, spec_embed_dim)
        peak_attn_layer = TransformerEncoderLayer(d_model=spec_embed_dim, nhead=8,
                                                  dim_feedforward=spec_embed_dim * 4, dropout=dropout,
                                                  additive_attn=False, pairwise_featurization=False)
        self.peak_attn_layers = get_clones(peak_attn_layer, layers)

    def forward(self, mzs, intens, num_peaks):
        embedded_mz = self.mz_embedder(mzs)
        peak_tensor = torch.cat([embedded_mz, intens[:, :, None]], -1)
        peak_tensor = self.input_compress(peak_tensor)
        peak_dim = peak_tensor.shape[1]
        peaks_aranged = torch.arange(peak_dim).to(mzs.device)
        # batch x num peaks  (True = padded peak)
        attn_mask = ~(peaks_aranged[None, :] < num_peaks[:, None])
        peak_tensor = peak_tensor.transpose(0, 1)
        for peak_attn_layer in self.peak_attn_layers:
            peak_tensor, _ = peak_attn_layer(peak_tensor, src_key_padding_mask=attn_mask)
        peak_tensor = peak_tensor.transpose(0, 1)
        return peak_tensor, attn_mask


class ESA_SPEC(nn.Module):
    def __init__(self, feature_dim, out_dim):
        super().__init__()
        self.ln_f = nn.LayerNorm(feature_dim)
        self.linear = nn.Linear(feature_dim, out_dim)
        self.linear1 = nn.Linear(out_dim, out_dim)

    def forward(self, hidden_states, attention_mask):
        logits = self.ln_f(hidden_states)  # (B, N, C)
        cap_embes = self.linear(logits)  # Q
        features_in = self.linear1(cap_embes)  # M
        mask = attention_mask.unsqueeze(-1)  # (B, N, 1)
        if FIXED:
            features_in = features_in.masked_fill(mask == 1, -1e4)  # (B, N, C)
        else:
            features_in = features_in.masked_fill(mask == 0, -1e4)  # (B, N, C)
        features_k_softmax = nn.Softmax(dim=1)(features_in)
        if FIXED:
            attn = features_k_softmax.masked_fill(mask == 1, 0)
        else:
            attn = features_k_softmax.masked_fill(mask == 0, 0)
        self.last_attn = attn
        spec_feature = torch.sum(attn * cap_embes, dim=1)  # (B, C)
        return spec_feature


class SpecEncoder(nn.Module):
    """The spectrum branch of ModelCLR: ms_encoder -> spec_esa -> spec_proj."""

    def __init__(self, spec_embed_dim=32, dropout=0.0, layers=2, embed_dim=32):
        super().__init__()
        self.MS_model = MSModel(spec_embed_dim, dropout, layers)
        self.spec_esa = ESA_SPEC(spec_embed_dim, embed_dim)
        self.spec_proj = nn.Linear(embed_dim, embed_dim)

    def forward(self, mzs, intens, num_peaks):
        zls, attn_mask = self.MS_model(mzs, intens, num_peaks)
        zls_feat = self.spec_esa(zls, attn_mask)
        return self.spec_proj(zls_feat), zls, attn_mask


model = SpecEncoder().eval()

# a batch of 3 MS/MS spectra with 12, 7 and 4 peaks, zero-padded to 12 (as the dataloader does)
num_peaks = torch.tensor([12, 7, 4])
P = int(num_peaks.max())
mzs = torch.zeros(3, P)
intens = torch.zeros(3, P)
for b, n in enumerate(num_peaks.tolist()):
    mzs[b, :n] = torch.sort(torch.rand(n) * 500 + 50).values
    intens[b, :n] = torch.rand(n)

with torch.no_grad():
    emb, zls, pad = model(mzs, intens, num_peaks)
    attn = model.spec_esa.last_attn  # (B, N, C)
    # reference pooling: the same ESA_SPEC computed over each spectrum's real peaks only
    esa = model.spec_esa
    ref = []
    for b, n in enumerate(num_peaks.tolist()):
        h = esa.linear(esa.ln_f(zls[b:b + 1, :n]))
        w = torch.softmax(esa.linear1(h), dim=1)
        ref.append(model.spec_proj(torch.sum(w * h, dim=1)))
    ref = torch.cat(ref)

mass_on_padding = float((attn * pad.unsqueeze(-1)).sum(dim=1).mean(dim=-1).max())
print(f"fixed={FIXED}")
print(f"attention mass on padded peaks (max over spectra): {mass_on_padding:.4f}")
print(f"total ESA attention weight of the unpadded 12-peak spectrum (C channels): {float(esa.last_attn[0].sum()):.4f}")
print(f"max |embedding - real-peaks-only pooling|: {float((emb - ref).abs().max()):.6f}")
