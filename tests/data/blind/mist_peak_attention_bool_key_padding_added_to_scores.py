"""MIST (DiffMS) peak transformer: the boolean key padding mask is added to the scores, not -inf.

Citation: coleygroup/DiffMS#25 ("Incorrect masking for 0-padded peak-positions"; closed, a
maintainer acknowledged it and said a fix would follow). The buggy code was read in the stored
upstream source (src/mist/models/transformer_layer.py, commit 9d9f4fd); the fix is the one the
issue states (`attn += new_attn_mask`), I did not read a fix commit.

Bug: `MultiheadAttention._scaled_dot_product_attention` builds the additive mask correctly,
`new_attn_mask = zeros_like(attn_mask, dtype=q.dtype).masked_fill_(attn_mask, -inf)`, and then
adds the boolean `attn_mask` instead: padded peaks (True in the key padding mask built by the
spectrum encoder as `~(peaks_aranged[None, :] < num_peaks[:, None])`) get +1.0 on their logits
instead of -inf, so every peak attends to the zero-padded peak slots of shorter spectra.
Fix: `attn += new_attn_mask`.

This program: `TransformerEncoderLayer` / `MultiheadAttention` as upstream (sequence-first,
post-norm, no pairwise featurization, dot-product path); the peak embeddings are random stand-ins
for the formula/intensity/type embedder; two spectra with 5 and 3 peaks padded to 5.
"""
import math
import sys
from typing import Optional

import torch
from torch import Tensor
from torch.nn import Dropout, LayerNorm, Linear, Module, Parameter
from torch.nn import functional as F
from torch.nn.init import constant_, xavier_uniform_

FIXED = "--fixed" in sys.argv


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
        self.out_proj = Linear(embed_dim, embed_dim, bias=True)
        xavier_uniform_(self.in_proj_weight)
        constant_(self.in_proj_bias, 0.0)
        constant_(self.out_proj.bias, 0.0)

    def forward(self, query, key, value, key_padding_mask=None):
        return self.multi_head_attention_forward(query, key, value, self.num_heads, self.in_proj_weight,
                                                 self.in_proj_bias, self.dropout, self.out_proj.weight,
                                                 self.out_proj.bias, training=self.training,
                                                 key_padding_mask=key_padding_mask)

    def multi_head_attention_forward(self, query, key, value, num_heads, in_proj_weight, in_proj_bias,
                                     dropout_p, out_proj_weight, out_proj_bias, training=True,
                                     key_padding_mask: Optional[Tensor] = None):
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
        attn_output, attn_output_weights = self._scaled_dot_product_attention(q, k, v, attn_mask, dropout_p)
        attn_output = attn_output.transpose(0, 1).contiguous().view(tgt_len * bsz, embed_dim)
        attn_output = F.linear(attn_output, out_proj_weight, out_proj_bias)
        attn_output = attn_output.view(tgt_len, bsz, attn_output.size(1))
        return attn_output, attn_output_weights.view(bsz, num_heads, tgt_len, src_len)

    def _scaled_dot_product_attention(self, q, k, v, attn_mask=None, dropout_p=0.0):
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
    def __init__(self, d_model, nhead, dim_feedforward=2048, dropout=0.1, norm_first=False):
        super().__init__()
        self.self_attn = MultiheadAttention(d_model, nhead, dropout=dropout)
        self.linear1 = Linear(d_model, dim_feedforward)
        self.dropout = Dropout(dropout)
        self.linear2 = Linear(dim_feedforward, d_model)
        self.norm_first = norm_first
        self.norm1 = LayerNorm(d_model)
        self.norm2 = LayerNorm(d_model)
        self.dropout1 = Dropout(dropout)
        self.dropout2 = Dropout(dropout)
        self.activation = F.relu

    def forward(self, src, pairwise_features=None, src_key_padding_mask=None):
        x = src
        x = self.norm1(x + self._sa_block(x, pairwise_features, src_key_padding_mask))
        x = self.norm2(x + self._ff_block(x))
        return x, pairwise_features

    def _sa_block(self, x, pairwise_features, key_padding_mask):
        x = self.self_attn(x, x, x, key_padding_mask=key_padding_mask)[0]
        return self.dropout1(x)

    def _ff_block(self, x):
        return self.dropout2(self.linear2(self.dropout(self.activation(self.linear1(x)))))


def main():
    torch.manual_seed(0)
    hidden_size, peak_attn_layers = 32, 2
    layers = [TransformerEncoderLayer(hidden_size, nhead=4, dim_feedforward=64, dropout=0.1).eval()
              for _ in range(peak_attn_layers)]
    num_peaks = torch.tensor([5, 3])
    peak_dim = 5
    peak_tensor = torch.randn(2, peak_dim, hidden_size)
    peak_tensor[1, 3:] = 0.0  # zero-padded peak slots of the shorter spectrum
    # B x Np x d -> Np x B x d
    peak_tensor = peak_tensor.transpose(0, 1)
    peaks_aranged = torch.arange(peak_dim)
    attn_mask = ~(peaks_aranged[None, :] < num_peaks[:, None])  # batch x num peaks, True = padding
    with torch.no_grad():
        for peak_attn_layer in layers:
            peak_tensor, _ = peak_attn_layer(peak_tensor, pairwise_features=None, src_key_padding_mask=attn_mask)
    print("spectrum 1 cls peak embedding[:4]:", [round(v, 4) for v in peak_tensor[0, 1, :4].tolist()])


if __name__ == "__main__":
    main()
