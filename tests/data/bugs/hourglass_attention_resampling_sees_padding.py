# lucidrains/hourglass-transformer-pytorch commit 674ede1 ("fix masking for non-autoregressive case"):
# the pre-valley "attention resampling", where each pooled (shortened) token attends to the tokens of
# its own bucket, was called without the padding mask, so pooled tokens attended to padding.
import sys

import torch
import torch.nn.functional as F
from torch import nn, einsum

FIXED = "--fixed" in sys.argv


def exists(val):
    return val is not None


def default(val, d):
    return val if exists(val) else d


class PreNormResidual(nn.Module):
    def __init__(self, dim, fn):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fn = fn

    def forward(self, x, **kwargs):
        return self.fn(self.norm(x), **kwargs) + x


class Attention(nn.Module):
    def __init__(self, dim, heads=4, dim_head=8, causal=False):
        super().__init__()
        self.heads = heads
        self.causal = causal
        self.scale = dim_head ** -0.5
        inner_dim = heads * dim_head
        self.to_q = nn.Linear(dim, inner_dim, bias=False)
        self.to_kv = nn.Linear(dim, inner_dim * 2, bias=False)
        self.to_out = nn.Linear(inner_dim, dim)

    def forward(self, x, context=None, mask=None):
        h = self.heads
        kv_input = default(context, x)
        q, k, v = self.to_q(x), *self.to_kv(kv_input).chunk(2, dim=-1)
        q, k, v = map(lambda t: t.reshape(*t.shape[:2], h, -1).transpose(1, 2), (q, k, v))
        q = q * self.scale
        sim = einsum('b h i d, b h j d -> b h i j', q, k)
        mask_value = -torch.finfo(sim.dtype).max
        if exists(mask):
            mask = mask[:, None, None, :]
            sim = sim.masked_fill(~mask, mask_value)
        attn = sim.softmax(dim=-1)
        out = einsum('b h i j, b h j d -> b h i d', attn, v)
        return self.to_out(out.transpose(1, 2).reshape(out.shape[0], out.shape[2], -1))


class Transformer(nn.Module):
    def __init__(self, dim, depth, heads=4, dim_head=8):
        super().__init__()
        self.layers = nn.ModuleList([nn.ModuleList([
            PreNormResidual(dim, Attention(dim, heads=heads, dim_head=dim_head)),
            PreNormResidual(dim, nn.Sequential(nn.Linear(dim, dim * 4), nn.GELU(), nn.Linear(dim * 4, dim)))
        ]) for _ in range(depth)])

    def forward(self, x, context=None, mask=None):
        for attn, ff in self.layers:
            x = attn(x, context=context, mask=mask)
            x = ff(x)
        return x


class HourglassTransformer(nn.Module):
    def __init__(self, dim, depth=(1, 1, 1), shorten_factor=4, attn_resampling=True):
        super().__init__()
        pre, valley, post = depth
        self.shorten_factor = shorten_factor
        self.valley_transformer = Transformer(dim, valley)
        self.attn_resampling_pre_valley = Transformer(dim, 1) if attn_resampling else None
        self.attn_resampling_post_valley = Transformer(dim, 1) if attn_resampling else None
        self.pre_transformer = Transformer(dim, pre)
        self.post_transformer = Transformer(dim, post)

    def forward(self, x, mask=None):
        s, b, n = self.shorten_factor, *x.shape[:2]
        x = self.pre_transformer(x, mask=mask)
        x_residual = x.clone()

        # naive average pool
        downsampled = x.reshape(b, -1, s, x.shape[-1]).mean(dim=2)
        downsampled_mask = mask.reshape(b, -1, s).sum(dim=-1) > 0 if exists(mask) else None

        # pre-valley "attention resampling" - the pooled token in each bucket attends to the tokens pre-pooled
        if exists(self.attn_resampling_pre_valley):
            if FIXED and exists(mask):
                attn_resampling_mask = mask.reshape(-1, s)
            else:
                attn_resampling_mask = None
            downsampled = self.attn_resampling_pre_valley(
                downsampled.reshape(-1, 1, downsampled.shape[-1]),
                x.reshape(-1, s, x.shape[-1]),
                mask=attn_resampling_mask
            )
            downsampled = downsampled.reshape(b, -1, downsampled.shape[-1])

        x = self.valley_transformer(downsampled, mask=downsampled_mask)
        valley_out = x.clone()
        x = x.repeat_interleave(s, dim=1) + x_residual

        if exists(self.attn_resampling_post_valley):
            x = self.attn_resampling_post_valley(
                x.reshape(-1, s, x.shape[-1]),
                valley_out.reshape(-1, 1, valley_out.shape[-1])
            )
            x = x.reshape(b, -1, x.shape[-1])

        return self.post_transformer(x[:, :n], mask=mask)


torch.manual_seed(0)
emb = nn.Embedding(100, 32)
model = HourglassTransformer(32).eval()
ids = torch.randint(1, 100, (2, 16))
mask = torch.ones(2, 16, dtype=torch.bool)
mask[1, 10:] = False  # second sequence has 10 real tokens, then padding
ids[1, 10:] = 0

with torch.no_grad():
    out = model(emb(ids), mask=mask)
    ids2 = ids.clone()
    ids2[1, 10:] = torch.randint(1, 100, (6,))  # other contents under the padding
    out2 = model(emb(ids2), mask=mask)
# (the naive mean pool of the shortening step also averages the pads, so this is not 0 after the fix)
print(f"{'fixed' if FIXED else 'buggy'}: change of the real tokens' outputs when only padded positions change = "
      f"{(out[1, :10] - out2[1, :10]).abs().max().item():.4f}")
