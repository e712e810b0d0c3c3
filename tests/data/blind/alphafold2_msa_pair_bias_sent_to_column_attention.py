# lucidrains/alphafold2#89 (fixed in commit 2c57480): MsaAttentionBlock passed the pairwise representation
# (the residue-residue attention bias) to the MSA *column* attention, which has no edge projection, so the
# row attention over residues ran without its pair bias (Algorithm 7 of AF2 puts the pair bias on row attention).
import sys

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class Attention(nn.Module):
    def __init__(self, dim, heads=4, dim_head=8):
        super().__init__()
        inner_dim = dim_head * heads
        self.heads = heads
        self.scale = dim_head ** -0.5
        self.to_q = nn.Linear(dim, inner_dim, bias=False)
        self.to_kv = nn.Linear(dim, inner_dim * 2, bias=False)
        self.to_out = nn.Linear(inner_dim, dim)
        self.gating = nn.Linear(dim, inner_dim)

    def forward(self, x, mask=None, attn_bias=None):
        b, n, _ = x.shape
        h = self.heads
        q, k, v = (self.to_q(x), *self.to_kv(x).chunk(2, dim=-1))
        q, k, v = (t.view(b, n, h, -1).transpose(1, 2) for t in (q, k, v))
        q = q * self.scale
        dots = torch.einsum("bhid,bhjd->bhij", q, k)
        # add attention bias, if supplied (for pairwise to msa attention communication)
        if attn_bias is not None:
            dots = dots + attn_bias
        if mask is not None:
            mask_value = -torch.finfo(dots.dtype).max
            mask = mask[:, None, :, None] * mask[:, None, None, :]
            dots = dots.masked_fill(~mask, mask_value)
        attn = dots.softmax(dim=-1)
        out = torch.einsum("bhij,bhjd->bhid", attn, v)
        out = out.transpose(1, 2).reshape(b, n, -1)
        out = out * self.gating(x).sigmoid()
        return self.to_out(out)


class AxialAttention(nn.Module):
    def __init__(self, dim, heads, row_attn=True, col_attn=True, accept_edges=False):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads)
        self.heads = heads
        self.edges_to_attn_bias = nn.Linear(dim, heads, bias=False) if accept_edges else None
        self.row_attn, self.col_attn = row_attn, col_attn

    def forward(self, x, edges=None, mask=None):
        b, hh, w, d = x.shape  # (batch, msa rows, residues, dim)
        x = self.norm(x)
        attn_bias = None
        if self.edges_to_attn_bias is not None and edges is not None:
            attn_bias = self.edges_to_attn_bias(edges).permute(0, 3, 1, 2)  # b h i j
        if self.col_attn:
            w_x = x.permute(0, 2, 1, 3).reshape(b * w, hh, d)
            w_mask = mask.permute(0, 2, 1).reshape(b * w, hh) if mask is not None else None
            if attn_bias is not None:
                attn_bias = attn_bias.repeat_interleave(w, dim=0)
            out = self.attn(w_x, mask=w_mask, attn_bias=attn_bias)
            return out.view(b, w, hh, d).permute(0, 2, 1, 3)
        h_x = x.reshape(b * hh, w, d)
        h_mask = mask.reshape(b * hh, w) if mask is not None else None
        if attn_bias is not None:
            attn_bias = attn_bias.repeat_interleave(hh, dim=0)
        out = self.attn(h_x, mask=h_mask, attn_bias=attn_bias)
        return out.view(b, hh, w, d)


class MsaAttentionBlock(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.row_attn = AxialAttention(dim, heads, row_attn=True, col_attn=False, accept_edges=True)
        self.col_attn = AxialAttention(dim, heads, row_attn=False, col_attn=True)

    def forward(self, x, mask=None, pairwise_repr=None):
        if FIXED:
            x = self.row_attn(x, mask=mask, edges=pairwise_repr) + x
            x = self.col_attn(x, mask=mask) + x
        else:
            x = self.row_attn(x, mask=mask) + x
            x = self.col_attn(x, mask=mask, edges=pairwise_repr) + x
        return x


dim, heads, n_seq, n_res = 16, 4, 3, 10
block = MsaAttentionBlock(dim, heads).eval()
msa = torch.randn(2, n_seq, n_res, dim)
pairwise_repr = torch.randn(2, n_res, n_res, dim) * 3.0
msa_mask = torch.ones(2, n_seq, n_res, dtype=torch.bool)
msa_mask[1, :, 7:] = False  # second protein is 7 residues long

with torch.no_grad():
    out = block(msa, mask=msa_mask, pairwise_repr=pairwise_repr)
    out_other_pair = block(msa, mask=msa_mask, pairwise_repr=torch.randn_like(pairwise_repr) * 3.0)
sens = (out - out_other_pair)[msa_mask].abs().max().item()
print(f"fixed={FIXED} max change of MSA output when the pair representation changes = {sens:.4e}")
