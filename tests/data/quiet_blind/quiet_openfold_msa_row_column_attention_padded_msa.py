# Citation: aqlaboratory/openfold openfold/model/msa.py (MSAAttention._prep_inputs, MSARowAttentionWithPairBias,
#   MSAColumnAttention) and openfold/model/primitives.py (Attention with gating, _attention adds biases, softmax).
# Masking: MSA mask [N_seq, N_res] (1 real / 0 padded residue or padded alignment row) becomes the additive bias
#   inf * (mask - 1) with inf=1e9, broadcast over queries; the pair bias z is added to row attention. Column attention
#   transposes m and the mask. Fully padded rows/columns get a uniform softmax (finite bias) and are masked downstream,
#   which is what OpenFold intends.
import math
import torch
import torch.nn as nn

torch.manual_seed(0)


def permute_final_dims(tensor, inds):
    zero_index = -1 * len(inds)
    first_inds = list(range(len(tensor.shape[:zero_index])))
    return tensor.permute(first_inds + [zero_index + i for i in inds])


def flatten_final_dims(t, no_dims):
    return t.reshape(t.shape[:-no_dims] + (-1,))


def _attention(query, key, value, biases):
    key = permute_final_dims(key, (1, 0))
    a = torch.matmul(query, key)
    for b in biases:
        a += b
    a = torch.softmax(a, dim=-1)
    return torch.matmul(a, value)


class Attention(nn.Module):
    def __init__(self, c_q, c_k, c_v, c_hidden, no_heads, gating=True):
        super().__init__()
        self.c_hidden, self.no_heads = c_hidden, no_heads
        self.linear_q = nn.Linear(c_q, c_hidden * no_heads, bias=False)
        self.linear_k = nn.Linear(c_k, c_hidden * no_heads, bias=False)
        self.linear_v = nn.Linear(c_v, c_hidden * no_heads, bias=False)
        self.linear_o = nn.Linear(c_hidden * no_heads, c_q)
        self.linear_g = nn.Linear(c_q, c_hidden * no_heads) if gating else None

    def _prep_qkv(self, q_x, kv_x):
        q = self.linear_q(q_x)
        k = self.linear_k(kv_x)
        v = self.linear_v(kv_x)
        q = q.view(q.shape[:-1] + (self.no_heads, -1))
        k = k.view(k.shape[:-1] + (self.no_heads, -1))
        v = v.view(v.shape[:-1] + (self.no_heads, -1))
        q = q.transpose(-2, -3)
        k = k.transpose(-2, -3)
        v = v.transpose(-2, -3)
        q /= math.sqrt(self.c_hidden)
        return q, k, v

    def _wrap_up(self, o, q_x):
        if self.linear_g is not None:
            g = torch.sigmoid(self.linear_g(q_x))
            g = g.view(g.shape[:-1] + (self.no_heads, -1))
            o = o * g
        o = flatten_final_dims(o, 2)
        return self.linear_o(o)

    def forward(self, q_x, kv_x, biases=None):
        q, k, v = self._prep_qkv(q_x, kv_x)
        o = _attention(q, k, v, biases)
        o = o.transpose(-2, -3)
        return self._wrap_up(o, q_x)


class MSAAttention(nn.Module):
    def __init__(self, c_in, c_hidden, no_heads, pair_bias=False, c_z=None, inf=1e9):
        super().__init__()
        self.pair_bias, self.inf = pair_bias, inf
        self.layer_norm_m = nn.LayerNorm(c_in)
        self.layer_norm_z = None
        self.linear_z = None
        if self.pair_bias:
            self.layer_norm_z = nn.LayerNorm(c_z)
            self.linear_z = nn.Linear(c_z, no_heads, bias=False)
        self.mha = Attention(c_in, c_in, c_in, c_hidden, no_heads)

    def _prep_inputs(self, m, z, mask):
        n_seq, n_res = m.shape[-3:-1]
        if mask is None:
            mask = m.new_ones(m.shape[:-3] + (n_seq, n_res))
        # [*, N_seq, 1, 1, N_res]
        mask_bias = (self.inf * (mask - 1))[..., :, None, None, :]
        if self.pair_bias and z is not None:
            z = self.layer_norm_z(z)
            z = self.linear_z(z)
            # [*, 1, no_heads, N_res, N_res]
            z = permute_final_dims(z, (2, 0, 1)).unsqueeze(-4)
        return m, mask_bias, z

    def forward(self, m, z=None, mask=None):
        m, mask_bias, z = self._prep_inputs(m, z, mask)
        biases = [mask_bias]
        if z is not None:
            biases.append(z)
        m = self.layer_norm_m(m)
        return self.mha(q_x=m, kv_x=m, biases=biases)


class MSARowAttentionWithPairBias(MSAAttention):
    def __init__(self, c_m, c_z, c_hidden, no_heads, inf=1e9):
        super().__init__(c_m, c_hidden, no_heads, pair_bias=True, c_z=c_z, inf=inf)


class MSAColumnAttention(nn.Module):
    def __init__(self, c_m, c_hidden, no_heads, inf=1e9):
        super().__init__()
        self._msa_att = MSAAttention(c_in=c_m, c_hidden=c_hidden, no_heads=no_heads, pair_bias=False, inf=inf)

    def forward(self, m, mask=None):
        # [*, N_res, N_seq, C_in]
        m = m.transpose(-2, -3)
        if mask is not None:
            mask = mask.transpose(-1, -2)
        m = self._msa_att(m, mask=mask)
        m = m.transpose(-2, -3)
        return m


B, N_seq, N_res, c_m, c_z = 2, 5, 12, 16, 8
m = torch.randn(B, N_seq, N_res, c_m)
z = torch.randn(B, N_res, N_res, c_z)
msa_mask = torch.ones(B, N_seq, N_res)
msa_mask[0, :, 9:] = 0  # protein 0 has 9 residues
msa_mask[1, 3:, :] = 0  # protein 1 has only 3 alignment rows
row = MSARowAttentionWithPairBias(c_m, c_z, 8, 4)
col = MSAColumnAttention(c_m, 8, 4)
m = m + row(m, z=z, mask=msa_mask) * msa_mask[..., None]
m = m + col(m, mask=msa_mask) * msa_mask[..., None]
loss = (m * msa_mask[..., None]).pow(2).sum() / msa_mask.sum()
loss.backward()
print(f"msa loss {loss.item():.4f}")
