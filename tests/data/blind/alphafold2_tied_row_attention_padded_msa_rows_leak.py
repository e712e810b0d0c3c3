# lucidrains/alphafold2 commit 5e8e00a: in tied MSA row attention the logits are summed over all MSA rows, but MSA rows
# that are entirely padding (msa_mask all False) were not masked out, so padded sequences still shaped every row's attention.
import sys

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


def exists(val):
    return val is not None


def default(val, d):
    return val if exists(val) else (d() if callable(d) else d)


class Attention(nn.Module):
    def __init__(self, dim, heads=2, dim_head=8):
        super().__init__()
        inner_dim = dim_head * heads
        self.heads = heads
        self.scale = dim_head ** -0.5
        self.to_q = nn.Linear(dim, inner_dim, bias=False)
        self.to_kv = nn.Linear(dim, inner_dim * 2, bias=False)
        self.to_out = nn.Linear(inner_dim, dim)

    def forward(self, x, mask=None, tie_attn_dim=None):
        device, h = x.device, self.heads
        q, k, v = (self.to_q(x), *self.to_kv(x).chunk(2, dim=-1))
        i, j = q.shape[-2], k.shape[-2]
        q, k, v = map(lambda t: t.reshape(t.shape[0], t.shape[1], h, -1).transpose(1, 2), (q, k, v))

        # for tying row-attention, for MSA axial self-attention
        if exists(tie_attn_dim):
            q, k, v = map(lambda t: t.reshape(-1, tie_attn_dim, *t.shape[1:]), (q, k, v))
            if exists(mask):
                mask = mask.reshape(-1, tie_attn_dim, mask.shape[-1])
                has_rows = mask.any(dim=-1)
                num_rows = has_rows.sum(dim=-1)
                num_rows = num_rows[:, None, None, None]
                mask = mask.any(dim=1)
                if FIXED:
                    # mask out the rows that have nothing as 0
                    row_mask = ~has_rows[:, :, None, None, None]
                    q.masked_fill_(row_mask, 0.0)
            else:
                num_rows = tie_attn_dim
            dots = torch.einsum("b r h i d, b r h j d -> b h i j", q, k) * self.scale * (num_rows ** -0.5)
        else:
            dots = torch.einsum("b h i d, b h j d -> b h i j", q, k) * self.scale

        if exists(mask):
            context_mask = mask
            mask_value = -torch.finfo(dots.dtype).max
            mask = mask[:, None, :, None] * context_mask[:, None, None, :]
            dots.masked_fill_(~mask, mask_value)

        attn = dots.softmax(dim=-1)

        if exists(tie_attn_dim):
            out = torch.einsum("b h i j, b r h j d -> b r h i d", attn, v)
            out = out.reshape(-1, *out.shape[2:])
        else:
            out = torch.einsum("b h i j, b h j d -> b h i d", attn, v)
        out = out.transpose(1, 2).reshape(out.shape[0], out.shape[2], -1)
        return self.to_out(out)


class MsaRowAttention(nn.Module):
    """Row-wise (tied) axial attention over an MSA of shape (b, rows, residues, dim)."""

    def __init__(self, dim, heads=2):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads=heads)

    def forward(self, m, mask=None):
        b, r, n, d = m.shape
        x = self.norm(m).reshape(b * r, n, d)
        mask = mask.reshape(b * r, n) if exists(mask) else None
        out = self.attn(x, mask=mask, tie_attn_dim=r)
        return m + out.reshape(b, r, n, d)


if __name__ == "__main__":
    b, rows, n, dim = 2, 4, 6, 16
    layer = MsaRowAttention(dim).eval()
    msa = torch.randn(b, rows, n, dim)
    msa_mask = torch.ones(b, rows, n, dtype=torch.bool)
    msa_mask[1, 2:] = False  # the second alignment has only 2 sequences: rows 2-3 are padding
    msa_mask[1, :, 5:] = False  # ... and is one residue shorter

    msa_other_pad = msa.clone()
    msa_other_pad[1, 2:] = torch.randn(rows - 2, n, dim) * 3.0  # different content in the padded rows only

    with torch.no_grad():
        out_a = layer(msa, mask=msa_mask)
        out_b = layer(msa_other_pad, mask=msa_mask)
    real = msa_mask[1].unsqueeze(-1)
    diff = ((out_a[1] - out_b[1]) * real).abs().max().item()
    print(f"fixed={FIXED} real MSA positions change with padded-row content by {diff:.4f}")
