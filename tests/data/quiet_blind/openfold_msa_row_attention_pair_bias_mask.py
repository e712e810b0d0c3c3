"""OpenFold (aqlaboratory/openfold) Evoformer MSA row-wise gated self-attention with pair bias.

Follows openfold/model/msa.py (MSAAttention._prep_inputs: `mask_bias = (self.inf * (mask - 1))[..., :,
None, None, :]`, pair bias from layer_norm_z + linear_z, MSARowAttentionWithPairBias) and
openfold/model/primitives.py (Attention with a list of `biases` summed onto q @ k.T, gating, inf=1e9).
An MSA of N_seq aligned sequences over N_res residues, padded in both dimensions (msa_mask from the
feature pipeline). Row attention: within one sequence, residue i attends to residue j with a bias
shared by all sequences (from the pair representation z[i, j]), padded residue columns get -1e9. A fully
padded MSA row has -1e9 on every key, so its softmax falls back to the pair bias alone; its output is
multiplied by msa_mask and never used.
"""
import math

import torch
import torch.nn as nn


def _attention(query, key, value, biases):
    key = key.transpose(-1, -2)  # [*, H, C_hidden, K]
    a = torch.matmul(query, key)  # [*, H, Q, K]
    for b in biases:
        a += b
    a = torch.softmax(a, dim=-1)
    return torch.matmul(a, value)


class Attention(nn.Module):
    def __init__(self, c_q, c_k, c_v, c_hidden, no_heads, gating=True):
        super().__init__()
        self.c_hidden, self.no_heads, self.gating = c_hidden, no_heads, gating
        self.linear_q = nn.Linear(c_q, c_hidden * no_heads, bias=False)
        self.linear_k = nn.Linear(c_k, c_hidden * no_heads, bias=False)
        self.linear_v = nn.Linear(c_v, c_hidden * no_heads, bias=False)
        self.linear_o = nn.Linear(c_hidden * no_heads, c_q)
        self.linear_g = nn.Linear(c_q, c_hidden * no_heads) if gating else None

    def forward(self, q_x, kv_x, biases=None):
        q = self.linear_q(q_x).view(q_x.shape[:-1] + (self.no_heads, -1)).transpose(-2, -3)  # [*, H, Q, C]
        k = self.linear_k(kv_x).view(kv_x.shape[:-1] + (self.no_heads, -1)).transpose(-2, -3)
        v = self.linear_v(kv_x).view(kv_x.shape[:-1] + (self.no_heads, -1)).transpose(-2, -3)
        q = q / math.sqrt(self.c_hidden)
        o = _attention(q, k, v, biases or []).transpose(-2, -3)  # [*, Q, H, C]
        if self.linear_g is not None:
            g = torch.sigmoid(self.linear_g(q_x))
            o = o * g.view(g.shape[:-1] + (self.no_heads, -1))
        return self.linear_o(o.reshape(o.shape[:-2] + (-1,)))


class MSARowAttentionWithPairBias(nn.Module):
    def __init__(self, c_m, c_z, c_hidden, no_heads, inf=1e9):
        super().__init__()
        self.no_heads, self.inf = no_heads, inf
        self.layer_norm_m = nn.LayerNorm(c_m)
        self.layer_norm_z = nn.LayerNorm(c_z)
        self.linear_z = nn.Linear(c_z, no_heads, bias=False)
        self.mha = Attention(c_m, c_m, c_m, c_hidden, no_heads)

    def _prep_inputs(self, m, z, mask):
        n_seq, n_res = m.shape[-3:-1]
        if mask is None:
            mask = m.new_ones(m.shape[:-3] + (n_seq, n_res))
        # [*, N_seq, 1, 1, N_res]
        mask_bias = (self.inf * (mask - 1))[..., :, None, None, :]
        z = self.layer_norm_z(z)
        z = self.linear_z(z)  # [*, N_res, N_res, no_heads]
        z = z.permute(*range(z.dim() - 3), -1, -3, -2).unsqueeze(-4)  # [*, 1, no_heads, N_res, N_res]
        return m, mask_bias, z

    def forward(self, m, z, mask=None):
        m, mask_bias, z = self._prep_inputs(m, z, mask)
        m = self.layer_norm_m(m)
        return self.mha(q_x=m, kv_x=m, biases=[mask_bias, z])


def main():
    torch.manual_seed(0)
    c_m, c_z, n_seq_max, n_res_max = 16, 8, 6, 12
    # two proteins cropped / padded to the same shapes by the data pipeline
    msa_feats = [(4, 12), (6, 9)]  # (N_seq, N_res) actually present
    m = torch.randn(2, n_seq_max, n_res_max, c_m)
    z = torch.randn(2, n_res_max, n_res_max, c_z)
    msa_mask = torch.zeros(2, n_seq_max, n_res_max)
    for b, (s, r) in enumerate(msa_feats):
        msa_mask[b, :s, :r] = 1.0
    row_attn = MSARowAttentionWithPairBias(c_m, c_z, c_hidden=8, no_heads=4).eval()
    with torch.no_grad():
        m = m + row_attn(m, z, mask=msa_mask) * msa_mask[..., None]
    print("msa update", tuple(m.shape), f"{(m * msa_mask[..., None]).abs().sum().item() / msa_mask.sum().item():.4f}")


if __name__ == "__main__":
    main()
