"""alphafold3-pytorch: sequence-local atom attention never looks back to the previous window.

Citation: lucidrains/alphafold3-pytorch commit 308c470 ("fix local windowed attention to be
overlapping"), in `Attend.local_attn` (alphafold3_pytorch/attention.py); read as the commit's
diff and its parent's file.

Bug: after breaking q, k, v into windows (`'b h (n w) d -> b h n w d'`) the code meant to give
every window the keys of the previous window plus its own ("simple local attention with a radius
of 1 window size"). It padded and shifted along dim -2, the token axis INSIDE a window, instead
of dim -3, the window axis, and did the same to the key mask on its last axis. Each window's
2w keys were therefore its own tokens shifted by one plus its own tokens again: an atom at the
start of a window sees nothing of the atoms just before it. Fix: pad / shift along the window
axis (`dim = -3` for k, v; `dim = -2` for the (b, n, w) mask), so window i attends windows i-1
and i, the first window's lookback masked as padding.

This program is the atom encoder's call path in small: `Attention(window_size=4)` with a batch
of two atom sequences (11 and 7 atoms, padded by `mask`), sim = q @ k.T over the windowed keys,
masked with the windowed key mask, softmax. Plain torch (the project's einops / einx calls are
written out as reshape / torch.where).
"""
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


def exists(v):
    return v is not None


def pad_at_dim(t, pad, *, dim=-1, value=0.0):
    dims_from_right = (-dim - 1) if dim < 0 else (t.ndim - dim - 1)
    zeros = (0, 0) * dims_from_right
    return F.pad(t, (*zeros, *pad), value=value)


def max_neg_value(t):
    return -torch.finfo(t.dtype).max


class Attend(nn.Module):
    def __init__(self, window_size=None):
        super().__init__()
        self.is_local_attn = exists(window_size)
        self.window_size = window_size

    def local_attn(self, q, k, v, mask=None):
        """simple local attention with a radius of 1 window size"""
        window_size, batch, seq_len = self.window_size, q.shape[0], q.shape[-2]
        if not exists(mask):
            mask = torch.ones((batch, seq_len), dtype=torch.bool)

        padding_needed = (window_size - (seq_len % window_size)) % window_size
        if padding_needed > 0:
            q, k, v = tuple(pad_at_dim(t, (0, padding_needed), value=0.0, dim=-2) for t in (q, k, v))
            mask = F.pad(mask, (0, padding_needed), value=False)

        # break into windows: 'b h (n w) d -> b h n w d'
        b, h, n, d = q.shape
        q, k, v = tuple(t.reshape(b, h, n // window_size, window_size, d) for t in (q, k, v))
        mask = mask.reshape(b, n // window_size, window_size)

        if FIXED:
            k, v = tuple(pad_at_dim(t, (1, 0), dim=-3) for t in (k, v))
            mask = pad_at_dim(mask, (1, 0), dim=-2, value=False)
            k, v = tuple(torch.cat((t[..., :-1, :, :], t[..., 1:, :, :]), dim=-2) for t in (k, v))
            mask = torch.cat((mask[..., :-1, :], mask[..., 1:, :]), dim=-1)
        else:
            k, v = tuple(pad_at_dim(t, (1, 0), dim=-2) for t in (k, v))
            mask = F.pad(mask, (1, 0), value=False)
            k, v = tuple(torch.cat((t[..., :-1, :], t[..., 1:, :]), dim=-2) for t in (k, v))
            mask = torch.cat((mask[..., :-1], mask[..., 1:]), dim=-1)

        q = q * q.shape[-1] ** -0.5
        sim = q @ k.transpose(-1, -2)
        # mask out buckets of padding: 'b n j, b h n i j'
        sim = torch.where(mask[:, None, :, None, :], sim, max_neg_value(sim))
        attn = sim.softmax(dim=-1)
        out = attn @ v
        out = out.reshape(b, h, n, d)  # 'b h n w d -> b h (n w) d'
        return out[..., :seq_len, :]

    def forward(self, q, k, v, mask=None):
        if self.is_local_attn:
            return self.local_attn(q, k, v, mask=mask)
        raise NotImplementedError


class Attention(nn.Module):
    def __init__(self, dim, heads=2, dim_head=8, window_size=None):
        super().__init__()
        self.heads = heads
        dim_inner = heads * dim_head
        self.attend = Attend(window_size=window_size)
        self.to_q = nn.Linear(dim, dim_inner, bias=True)
        self.to_kv = nn.Linear(dim, dim_inner * 2, bias=False)
        self.to_out = nn.Linear(dim_inner, dim, bias=False)

    def forward(self, seq, mask=None):
        b, n, _ = seq.shape
        q = self.to_q(seq)
        k, v = self.to_kv(seq).chunk(2, dim=-1)
        q, k, v = tuple(t.reshape(b, n, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        out = self.attend(q, k, v, mask=mask)
        return self.to_out(out.transpose(1, 2).reshape(b, n, -1))


def main():
    torch.manual_seed(0)
    atom_seq_len, dim = 11, 16
    atom_attn = Attention(dim, window_size=4).eval()
    atom_feats = torch.randn(2, atom_seq_len, dim)
    atom_lens = torch.tensor([11, 7])
    atom_mask = torch.arange(atom_seq_len)[None, :] < atom_lens[:, None]
    with torch.no_grad():
        out = atom_attn(atom_feats, mask=atom_mask)
    print("atom feats", tuple(out.shape), "%.4f" % out.abs().mean().item())


if __name__ == "__main__":
    main()
