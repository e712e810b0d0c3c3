# lucidrains/taylor-series-linear-attention commit c415e23 ("mask after expansion", v0.0.3 -> v0.0.4).
# TaylorSeriesLinearAttn zeroed the padded keys and values (k.masked_fill(~mask, 0.)) *before* the second-order
# Taylor feature map phi(x) = [1, x, x x^T / sqrt(2)]. phi(0) is not zero: its constant term is 1, so every padded
# key still adds 1 to the normaliser sum_m phi(q_n) . phi(k_m) of every query. The values are zeroed, so the pads
# add nothing to the numerator, but each real query's output is divided by a sum that counts the padding.
# Fix: apply second_taylor_expansion to q and k first, then mask k and v.
# (Non-causal self attention over a right-padded batch and cross attention to a padded context, as in the README;
# einops rearrange / pack / unpack written out with torch.)
import sys

import torch
from torch import nn, einsum
from torch.nn import Module

FIXED = "--fixed" in sys.argv

# functions

def exists(v):
    return v is not None

def default(v, d):
    return v if exists(v) else d

# they use 2nd taylor expansion for exp(x)
# https://arxiv.org/abs/2209.04881
# in a linear attention formulation

def second_taylor_expansion(x):
    dtype, device, dim = x.dtype, x.device, x.shape[-1]

    lead_shape = x.shape[:-1]
    x = x.reshape(-1, dim)                      # pack([x], '* d')

    lead_dims = x.shape[0]

    # exp(qk) = 1 + qk + (qk)^2 / 2

    x0 = x.new_ones((lead_dims,))
    x1 = x
    x2 = einsum('... i, ... j -> ... i j', x, x) * (0.5 ** 0.5)

    # concat - dimension D now becomes (1 + D + D ^2)
    # in paper, they had to heavily reduce the attention head dimension to make this work

    out = torch.cat([x0[:, None], x1, x2.reshape(lead_dims, -1)], dim = -1)   # pack([x0, x1, x2], 'b *')
    out = out.reshape(*lead_shape, out.shape[-1])                               # unpack(out, ps, '* d')
    return out

class RearrangeBNHD(Module):
    # Rearrange('b n (h d) -> b h n d', h = heads)
    def __init__(self, heads):
        super().__init__()
        self.heads = heads

    def forward(self, t):
        b, n, hd = t.shape
        return t.reshape(b, n, self.heads, hd // self.heads).transpose(1, 2)

class RearrangeKV(Module):
    # Rearrange('b n (kv h d) -> kv b h n d', kv = 2, h = heads)
    def __init__(self, heads):
        super().__init__()
        self.heads = heads

    def forward(self, t):
        b, n, khd = t.shape
        return t.reshape(b, n, 2, self.heads, khd // (2 * self.heads)).permute(2, 0, 3, 1, 4)

class MergeHeads(Module):
    # Rearrange('b h n d -> b n (h d)')
    def forward(self, t):
        b, h, n, d = t.shape
        return t.transpose(1, 2).reshape(b, n, h * d)

# main class

class TaylorSeriesLinearAttn(Module):
    def __init__(
        self,
        dim,
        *,
        dim_head = 16,
        heads = 8
    ):
        super().__init__()
        self.scale = dim_head ** -0.5
        dim_inner = dim_head * heads

        self.to_q = nn.Sequential(
            nn.Linear(dim, dim_inner, bias = False),
            RearrangeBNHD(heads)
        )

        self.to_kv = nn.Sequential(
            nn.Linear(dim, dim_inner * 2, bias = False),
            RearrangeKV(heads)
        )

        self.to_out = nn.Sequential(
            MergeHeads(),
            nn.Linear(dim_inner, dim, bias = False)
        )

    def forward(
        self,
        x,
        mask = None,
        context = None,
        eps = 1e-5
    ):
        """
        einops
        b - batch
        h - heads
        d - query / key head dimension
        e - value head dimension
        n - source query sequence length
        m - target key / value sequence length
        """

        q = self.to_q(x)
        k, v = self.to_kv(default(context, x))

        # scale

        q = q * self.scale

        if FIXED:
            # 2nd taylor expansion for exp(qk)

            q, k = map(second_taylor_expansion, (q, k))

        # masking

        if exists(mask):
            mask = mask[:, None, :, None]       # rearrange(mask, 'b n -> b 1 n 1')
            k = k.masked_fill(~mask, 0.)
            v = v.masked_fill(~mask, 0.)

        if not FIXED:
            # 2nd taylor expansion for exp(qk)

            q, k = map(second_taylor_expansion, (q, k))

        # linear attention

        kv = einsum('b h n d, b h n e -> b h d e', k, v)

        qk_inv = 1. / einsum('b h n d, b h m d -> b h n', q, k).clamp(min = eps)

        out = einsum('b h n d, b h d e, b h n -> b h n e', q, kv, qk_inv)

        # combine heads

        return self.to_out(out)


def main():
    torch.manual_seed(0)
    dim, num_tokens, pad_id = 32, 50, 0

    emb = nn.Embedding(num_tokens, dim)
    attn = TaylorSeriesLinearAttn(dim = dim, dim_head = 4, heads = 4)
    cross_attn = TaylorSeriesLinearAttn(dim = dim, dim_head = 4, heads = 4)

    # a right-padded batch of two token sequences (lengths 12 and 7)
    seqs = [torch.randint(1, num_tokens, (12,)), torch.randint(1, num_tokens, (7,))]
    n = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), n), pad_id, dtype = torch.long)
    for i, s in enumerate(seqs):
        ids[i, :len(s)] = s
    mask = ids != pad_id

    # a right-padded context (lengths 9 and 4) for cross attention
    ctx_seqs = [torch.randint(1, num_tokens, (9,)), torch.randint(1, num_tokens, (4,))]
    m = max(len(s) for s in ctx_seqs)
    ctx_ids = torch.full((len(ctx_seqs), m), pad_id, dtype = torch.long)
    for i, s in enumerate(ctx_seqs):
        ctx_ids[i, :len(s)] = s
    context_mask = ctx_ids != pad_id

    with torch.no_grad():
        x = emb(ids)
        context = emb(ctx_ids)

        h = x + attn(x, mask = mask)
        h = h + cross_attn(h, context = context, mask = context_mask)

        # mean pool over the real tokens
        pooled = (h * mask[..., None]).sum(dim = 1) / mask.sum(dim = 1, keepdim = True)

    print("pooled[1][:6]:", [round(v, 5) for v in pooled[1, :6].tolist()])
    print("first real token of row 1 [:6]:", [round(v, 5) for v in h[1, 0, :6].tolist()])


if __name__ == "__main__":
    main()
