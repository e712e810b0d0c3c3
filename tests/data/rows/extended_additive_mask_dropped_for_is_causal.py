"""A JAX-style grouped-query decoder ported to torch: the attention builds an additive `attn_bias` laid out
(batch, 1, 1, q, k) as the port's einsum layout (batch, kv_heads, groups, q, k) broadcasts it, -1e9 where a packed
row's segments differ or a key is later; its fused path, taken when `use_fused` is set, flattens the heads for SDPA
and calls `is_causal=True` without the bias, so each packed segment sees the one before it. `--fixed` hands the bias
(squeezed to (batch, 1, q, k)). Written as a second form of MaxText#878 (the segment mask handed to a kernel whose
mask type ignores it), differently: grouped heads, a -1e9 bias named `attn_bias`, the drop in the port's own branch."""
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


def attend(q, k, v, attn_bias, use_fused):
    """q (b, kv, g, t, d); k, v (b, kv, s, d); attn_bias (b, 1, 1, t, s)."""
    b, kv, g, t, d = q.shape
    if use_fused:
        qf = q.reshape(b, kv * g, t, d)
        kf, vf = (x.repeat_interleave(g, dim=1) for x in (k, v))
        if FIXED:
            out = F.scaled_dot_product_attention(qf, kf, vf, attn_mask=attn_bias[:, :, 0])
        else:
            out = F.scaled_dot_product_attention(qf, kf, vf, is_causal=True)
        return out.reshape(b, kv, g, t, d)
    logits = torch.einsum("bkgtd,bksd->bkgts", q, k) / d ** 0.5 + attn_bias
    return torch.einsum("bkgts,bksd->bkgtd", logits.softmax(-1), v)


class GroupedAttention(nn.Module):
    def __init__(self, dim=16, kv_heads=2, groups=2, use_fused=True):
        super().__init__()
        self.kv_heads, self.groups, self.head_dim, self.use_fused = kv_heads, groups, dim // (kv_heads * groups), use_fused
        self.q = nn.Linear(dim, dim)
        self.kv = nn.Linear(dim, 2 * kv_heads * self.head_dim)
        self.o = nn.Linear(dim, dim)

    def forward(self, x, segment_ids):
        b, t, _ = x.shape
        q = self.q(x).view(b, t, self.kv_heads, self.groups, self.head_dim).permute(0, 2, 3, 1, 4)
        k, v = (z.view(b, t, self.kv_heads, self.head_dim).transpose(1, 2) for z in self.kv(x).chunk(2, -1))
        same = segment_ids[:, :, None] == segment_ids[:, None, :]
        allowed = same & torch.ones(t, t, dtype=torch.bool).tril()
        attn_bias = torch.where(allowed, 0.0, -1e9)[:, None, None]
        out = attend(q, k, v, attn_bias, self.use_fused)
        return self.o(out.permute(0, 3, 1, 2, 4).reshape(b, t, -1))


class Decoder(nn.Module):
    def __init__(self, vocab=30, dim=16):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(GroupedAttention(dim) for _ in range(2))
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens, segment_ids):
        x = self.embed(tokens)
        for block in self.blocks:
            x = x + block(x, segment_ids)
        return self.head(x)


torch.manual_seed(0)
model = Decoder()
tokens = torch.tensor([[3, 8, 12, 5, 9, 21, 7], [4, 4, 17, 2, 25, 11, 6]])
segment_ids = torch.tensor([[1, 1, 1, 2, 2, 2, 2], [1, 1, 1, 1, 1, 2, 2]])
logits = model(tokens, segment_ids)
logits.sum().backward()
print("fixed" if FIXED else "buggy", tuple(logits.shape))
