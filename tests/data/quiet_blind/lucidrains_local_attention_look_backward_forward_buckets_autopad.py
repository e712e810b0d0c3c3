"""lucidrains local-attention, non-causal: the sequence is autopadded to a multiple of window_size,
cut into buckets, and each bucket's queries attend to keys of (look_backward, look_forward) neighbour
buckets gathered by look_around; bucket positions that fall off the ends carry pad_value = -1 and are
masked, the user's input_mask (padding) is gathered the same way with pad_value=False.

Follows lucidrains/local-attention local_attention/local_attention.py (look_around, pad_to_multiple,
LocalAttention.forward: `pad_mask = bq_k == pad_value`, `sim.masked_fill(~mask, mask_value)` with
mask_value = -finfo.max, outputs cut back to orig_seq_len) and local_attention/transformer.py
(LocalMHA: `look_forward = default(look_forward, 0 if causal else 1)`).  einops rearranges are
written as reshape/permute.

Mask meant: query i sees key j iff j is real (input_mask) and j's bucket is within one bucket before
or after i's bucket (window_size=4, look_backward=1, look_forward=1: a band of whole buckets).
Queries on padding positions may see no real key at all; they get a uniform finite row and their
outputs are not used.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F


def exists(val):
    return val is not None


def default(value, d):
    return d if not exists(value) else value


def max_neg_value(tensor):
    return -torch.finfo(tensor.dtype).max


def pad_to_multiple(tensor, multiple, dim=-1, value=0):
    seqlen = tensor.shape[dim]
    m = seqlen / multiple
    if m.is_integer():
        return False, tensor
    remainder = int(-(-seqlen // multiple)) * multiple - seqlen
    pad_offset = (0,) * (-1 - dim) * 2
    return True, F.pad(tensor, (*pad_offset, 0, remainder), value=value)


def look_around(x, backward=1, forward=0, pad_value=-1, dim=2):
    t = x.shape[1]
    dims = (len(x.shape) - dim) * (0, 0)
    padded_x = F.pad(x, (*dims, backward, forward), value=pad_value)
    tensors = [padded_x[:, ind:(ind + t), ...] for ind in range(forward + backward + 1)]
    return torch.cat(tensors, dim=dim)


class LocalAttention(nn.Module):
    def __init__(self, window_size, causal=False, look_backward=1, look_forward=None, dropout=0.0,
                 autopad=False, exact_windowsize=False):
        super().__init__()
        look_forward = default(look_forward, 0 if causal else 1)
        assert not (causal and look_forward > 0), "you cannot look forward if causal"
        self.window_size, self.causal = window_size, causal
        self.look_backward, self.look_forward = look_backward, look_forward
        self.exact_windowsize, self.autopad = exact_windowsize, autopad
        self.dropout = nn.Dropout(dropout)

    def forward(self, q, k, v, input_mask=None):
        mask = input_mask
        pad_value, window_size = -1, self.window_size
        lead = q.shape[:-2]
        q, k, v = (t.reshape(-1, *t.shape[-2:]) for t in (q, k, v))  # pack '* n d'
        if self.autopad:
            orig_seq_len = q.shape[1]
            (_, q), (_, k), (_, v) = (pad_to_multiple(t, window_size, dim=-2) for t in (q, k, v))
        b, n, dim_head = q.shape
        scale = dim_head ** -0.5
        assert (n % window_size) == 0, f"sequence length {n} must be divisible by window size {window_size}"
        windows = n // window_size
        seq = torch.arange(n)
        b_t = seq.reshape(1, windows, window_size)
        bq, bk, bv = (t.reshape(b, windows, window_size, dim_head) for t in (q, k, v))
        bq = bq * scale
        look_around_kwargs = dict(backward=self.look_backward, forward=self.look_forward, pad_value=pad_value)
        bk = look_around(bk, **look_around_kwargs)
        bv = look_around(bv, **look_around_kwargs)
        bq_t = b_t
        bq_k = look_around(b_t, **look_around_kwargs)
        bq_t = bq_t[..., :, None]
        bq_k = bq_k[..., None, :]
        pad_mask = bq_k == pad_value
        sim = torch.einsum("bhie,bhje->bhij", bq, bk)
        mask_value = max_neg_value(sim)
        if self.causal:
            causal_mask = bq_t < bq_k
            if self.exact_windowsize:
                causal_mask = causal_mask | (bq_t > (bq_k + self.window_size * self.look_backward))
            sim = sim.masked_fill(causal_mask, mask_value)
        if not self.causal and self.exact_windowsize:
            max_backward_window_size = self.window_size * self.look_backward
            max_forward_window_size = self.window_size * self.look_forward
            window_mask = ((bq_k - max_forward_window_size) > bq_t) | (bq_t > (bq_k + max_backward_window_size)) | pad_mask
            sim = sim.masked_fill(window_mask, mask_value)
        else:
            sim = sim.masked_fill(pad_mask, mask_value)
        if exists(mask):
            batch = mask.shape[0]
            assert (b % batch) == 0
            h = b // batch
            if self.autopad:
                _, mask = pad_to_multiple(mask, window_size, dim=-1, value=False)
            mask = mask.reshape(-1, windows, window_size)
            mask = look_around(mask, **{**look_around_kwargs, "pad_value": False})
            mask = mask[..., None, :]
            mask = mask.repeat_interleave(h, dim=0)  # repeat 'b ... -> (b h) ...'
            sim = sim.masked_fill(~mask, mask_value)
        attn = sim.softmax(dim=-1)
        attn = self.dropout(attn)
        out = torch.einsum("bhij,bhje->bhie", attn, bv)
        out = out.reshape(b, n, dim_head)
        if self.autopad:
            out = out[:, :orig_seq_len, :]
        return out.reshape(*lead, *out.shape[-2:])


class LocalMHA(nn.Module):
    def __init__(self, *, dim, window_size, dim_head=8, heads=4, dropout=0.0, causal=False, prenorm=True, **kwargs):
        super().__init__()
        inner_dim = dim_head * heads
        self.norm = nn.LayerNorm(dim) if prenorm else None
        self.heads = heads
        self.to_qkv = nn.Linear(dim, inner_dim * 3, bias=False)
        self.attn_fn = LocalAttention(window_size=window_size, causal=causal, dropout=dropout, autopad=True, **kwargs)
        self.to_out = nn.Linear(inner_dim, dim, bias=False)

    def forward(self, x, mask=None):
        if exists(self.norm):
            x = self.norm(x)
        b, n, _ = x.shape
        q, k, v = self.to_qkv(x).chunk(3, dim=-1)
        q, k, v = (t.reshape(b, n, self.heads, -1).transpose(1, 2) for t in (q, k, v))  # 'b n (h d) -> b h n d'
        out = self.attn_fn(q, k, v, input_mask=mask)
        out = out.transpose(1, 2).reshape(b, n, -1)
        return self.to_out(out)


if __name__ == "__main__":
    torch.manual_seed(0)
    attn = LocalMHA(dim=32, window_size=4, causal=False, look_backward=1, look_forward=1).eval()
    x = torch.randn(2, 22, 32)  # 22 is not a multiple of 4: autopad to 24
    mask = torch.zeros(2, 22, dtype=torch.bool)
    mask[0, :] = True   # no padding
    mask[1, :1] = True  # a single real token, the rest padding
    with torch.no_grad():
        out = attn(x, mask=mask)
        # position 0 of row 1 has only itself as a real key: attention returns its own value
        v0 = attn.to_qkv(attn.norm(x[1:, :1])).chunk(3, dim=-1)[2]
        expect = attn.to_out(v0)
    assert torch.isfinite(out).all()
    assert torch.allclose(out[1, 0], expect[0, 0], atol=1e-5)
    print("out", tuple(out.shape))
