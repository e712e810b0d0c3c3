"""Triangle self-attention around the starting and ending node, as aqlaboratory/openfold writes it.

Follows openfold/model/triangular_attention.py (TriangleAttention, TriangleAttentionEndingNode) and
openfold/model/primitives.py (Attention with a list of additive biases, sigmoid gating). The pair representation z
is [*, I, J, C]; for each row i the J entries attend to each other (starting node) with bias b_jk from z itself.
The pair mask is seq_mask[i] * seq_mask[j] (padding residues of a shorter protein in the batch), turned into
`inf * (mask - 1)` with inf = 1e9, broadcast as [*, I, 1, 1, J]: it hides padded KEYS k in every row. The ending
node transposes z and the mask first. Padding rows i have every key masked (a finite, uniform softmax; their
outputs are multiplied by the pair mask downstream and never read).
"""
import math

import torch
import torch.nn as nn


def permute_final_dims(tensor, inds):
    zero_index = -1 * len(inds)
    first_inds = list(range(len(tensor.shape[:zero_index])))
    return tensor.permute(first_inds + [zero_index + i for i in inds])


class Attention(nn.Module):
    def __init__(self, c_q, c_k, c_v, c_hidden, no_heads, gating=True):
        super().__init__()
        self.c_hidden, self.no_heads = c_hidden, no_heads
        self.linear_q = nn.Linear(c_q, c_hidden * no_heads, bias=False)
        self.linear_k = nn.Linear(c_k, c_hidden * no_heads, bias=False)
        self.linear_v = nn.Linear(c_v, c_hidden * no_heads, bias=False)
        self.linear_o = nn.Linear(c_hidden * no_heads, c_q)
        self.linear_g = nn.Linear(c_q, c_hidden * no_heads) if gating else None

    def forward(self, q_x, kv_x, biases):
        q = self.linear_q(q_x).view(*q_x.shape[:-1], self.no_heads, -1).transpose(-2, -3)
        k = self.linear_k(kv_x).view(*kv_x.shape[:-1], self.no_heads, -1).transpose(-2, -3)
        v = self.linear_v(kv_x).view(*kv_x.shape[:-1], self.no_heads, -1).transpose(-2, -3)
        q = q / math.sqrt(self.c_hidden)
        a = torch.matmul(q, k.transpose(-1, -2))  # [*, H, Q, K]
        for b in biases:
            a = a + b
        a = torch.softmax(a, dim=-1)
        o = torch.matmul(a, v).transpose(-2, -3)  # [*, Q, H, C_hidden]
        if self.linear_g is not None:
            g = torch.sigmoid(self.linear_g(q_x)).view(*q_x.shape[:-1], self.no_heads, -1)
            o = o * g
        return self.linear_o(o.flatten(-2))


class TriangleAttention(nn.Module):
    def __init__(self, c_in, c_hidden, no_heads, starting=True, inf=1e9):
        super().__init__()
        self.starting, self.inf = starting, inf
        self.layer_norm = nn.LayerNorm(c_in)
        self.linear = nn.Linear(c_in, no_heads, bias=False)
        self.mha = Attention(c_in, c_in, c_in, c_hidden, no_heads)

    def forward(self, x, mask=None):
        if mask is None:
            mask = x.new_ones(x.shape[:-1])
        if not self.starting:
            x = x.transpose(-2, -3)
            mask = mask.transpose(-1, -2)
        x = self.layer_norm(x)
        mask_bias = (self.inf * (mask - 1))[..., :, None, None, :]  # [*, I, 1, 1, J]
        triangle_bias = permute_final_dims(self.linear(x), (2, 0, 1)).unsqueeze(-4)  # [*, 1, H, I, J]
        x = self.mha(q_x=x, kv_x=x, biases=[mask_bias, triangle_bias])
        if not self.starting:
            x = x.transpose(-2, -3)
        return x


TriangleAttentionStartingNode = TriangleAttention


class TriangleAttentionEndingNode(TriangleAttention):
    def __init__(self, c_in, c_hidden, no_heads, inf=1e9):
        super().__init__(c_in, c_hidden, no_heads, starting=False, inf=inf)


def main():
    torch.manual_seed(0)
    c_z, n_res = 16, 7
    seq_lens = [7, 4]
    seq_mask = (torch.arange(n_res)[None] < torch.tensor(seq_lens)[:, None]).float()
    pair_mask = seq_mask[..., :, None] * seq_mask[..., None, :]
    z = torch.randn(2, n_res, n_res, c_z)
    z_ref = z.clone()
    tri_att_start = TriangleAttentionStartingNode(c_z, 8, 2)
    tri_att_end = TriangleAttentionEndingNode(c_z, 8, 2)
    with torch.no_grad():
        z = z + tri_att_start(z, mask=pair_mask) * pair_mask[..., None]
        z = z + tri_att_end(z, mask=pair_mask) * pair_mask[..., None]
        # reference: each protein cropped to its own length, no mask at all
        for b, n in enumerate(seq_lens):
            zb = z_ref[b, :n, :n]
            zb = zb + tri_att_start(zb)
            zb = zb + tri_att_end(zb)
            assert torch.allclose(z[b, :n, :n], zb, atol=1e-5), b
    print(f"pair {tuple(z.shape)} ok")


if __name__ == "__main__":
    main()
