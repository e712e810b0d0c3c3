# lucidrains/hourglass-transformer-pytorch, commit d7dc1e0 ("fix attention resampling and leakage problem").
# In the causal HourglassTransformer the pre-valley attention resampling lets each pooled token attend to the
# unshifted bucket (x_residual) instead of the shifted one, so a shortened token sees bytes of its own future.
import sys
import math

import torch
from torch import nn, einsum
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv

# helpers

def exists(val):
    return val is not None

def default(val, d):
    return val if exists(val) else d

def pad_to_multiple(tensor, multiple, dim = -1):
    seq_len = tensor.shape[dim]
    m = seq_len / multiple
    if m.is_integer():
        return tensor
    remainder = math.ceil(m) * multiple - seq_len
    pad_offset = (0,) * (-1 - dim) * 2
    return F.pad(tensor, (*pad_offset, 0, remainder), value = 0)

def cast_tuple(val, depth = 1):
    return val if isinstance(val, tuple) else ((val,) * depth)

# factory

def get_hourglass_transformer(dim, *, depth, shorten_factor, attn_resampling, updown_sample_type, **kwargs):
    assert isinstance(depth, int) or (isinstance(depth, tuple) and len(depth) == 3)
    assert not (isinstance(depth, int) and shorten_factor)

    if isinstance(depth, int):
        return Transformer(dim = dim, depth = depth, **kwargs)

    return HourglassTransformer(dim = dim, depth = depth, shorten_factor = shorten_factor, attn_resampling = attn_resampling, updown_sample_type = updown_sample_type, **kwargs)

# up and down sample classes (einops reduce / repeat written with reshape)

class NaiveDownsample(nn.Module):
    def __init__(self, shorten_factor):
        super().__init__()
        self.shorten_factor = shorten_factor

    def forward(self, x):
        b, n, d = x.shape   # reduce(x, 'b (n s) d -> b n d', 'mean', s = self.shorten_factor)
        return x.reshape(b, n // self.shorten_factor, self.shorten_factor, d).mean(dim = 2)

class NaiveUpsample(nn.Module):
    def __init__(self, shorten_factor):
        super().__init__()
        self.shorten_factor = shorten_factor

    def forward(self, x):
        return x.repeat_interleave(self.shorten_factor, dim = 1)   # repeat(x, 'b n d -> b (n s) d')

# classes

class PreNormResidual(nn.Module):
    def __init__(self, dim, fn):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fn = fn

    def forward(self, x, **kwargs):
        return self.fn(self.norm(x), **kwargs) + x

class Attention(nn.Module):
    def __init__(self, dim, heads = 8, dim_head = 64, dropout = 0., causal = False):
        super().__init__()
        self.heads = heads
        self.causal = causal
        self.scale = dim_head ** -0.5
        inner_dim = heads * dim_head

        self.to_q = nn.Linear(dim, inner_dim, bias = False)
        self.to_kv = nn.Linear(dim, inner_dim * 2, bias = False)
        self.to_out = nn.Linear(inner_dim, dim)

        self.dropout = nn.Dropout(dropout)

    def forward(self, x, context = None):
        h, device = self.heads, x.device
        kv_input = default(context, x)

        q, k, v = self.to_q(x), *self.to_kv(kv_input).chunk(2, dim = -1)
        q, k, v = map(lambda t: t.reshape(t.shape[0], t.shape[1], h, -1).transpose(1, 2), (q, k, v))

        q = q * self.scale

        sim = einsum('b h i d, b h j d -> b h i j', q, k)

        if self.causal:
            i, j = sim.shape[-2:]
            mask = torch.ones(i, j, device = device, dtype = torch.bool).triu_(j - i + 1)
            mask_value = -torch.finfo(sim.dtype).max
            mask = mask[None, None]
            sim = sim.masked_fill(mask, mask_value)

        attn = sim.softmax(dim = -1)
        attn = self.dropout(attn)

        out = einsum('b h i j, b h j d -> b h i d', attn, v)
        out = out.transpose(1, 2).reshape(out.shape[0], out.shape[2], -1)
        return self.to_out(out)

def FeedForward(dim, mult = 4, dropout = 0.):
    return nn.Sequential(
        nn.Linear(dim, dim * mult),
        nn.GELU(),
        nn.Dropout(dropout),
        nn.Linear(dim * mult, dim)
    )

class Transformer(nn.Module):
    def __init__(self, dim, *, depth, causal = False, heads = 8, dim_head = 64, attn_dropout = 0., ff_mult = 4,
                 ff_dropout = 0., norm_out = False):
        super().__init__()
        self.layers = nn.ModuleList([])

        for _ in range(depth):
            self.layers.append(nn.ModuleList([
                PreNormResidual(dim, Attention(dim, heads = heads, dim_head = dim_head, dropout = attn_dropout, causal = causal)),
                PreNormResidual(dim, FeedForward(dim, mult = ff_mult, dropout = ff_dropout))
            ]))

        self.norm = nn.LayerNorm(dim) if norm_out else nn.Identity()

    def forward(self, x, context = None):
        for attn, ff in self.layers:
            x = attn(x, context = context)
            x = ff(x)

        return self.norm(x)

class HourglassTransformer(nn.Module):
    def __init__(self, dim, *, depth, shorten_factor = 2, attn_resampling = True, updown_sample_type = 'naive',
                 heads = 8, dim_head = 64, causal = False, norm_out = False):
        super().__init__()
        assert len(depth) == 3, 'depth should be a tuple of length 3'
        assert updown_sample_type in {'naive'}

        pre_layers_depth, valley_depth, post_layers_depth = depth

        if isinstance(shorten_factor, (tuple, list)):
            shorten_factor, *rest_shorten_factor = shorten_factor
        elif isinstance(valley_depth, int):
            shorten_factor, rest_shorten_factor = shorten_factor, None
        else:
            shorten_factor, rest_shorten_factor = shorten_factor, shorten_factor

        transformer_kwargs = dict(dim = dim, heads = heads, dim_head = dim_head, causal = causal)

        self.causal = causal
        self.shorten_factor = shorten_factor

        self.downsample = NaiveDownsample(shorten_factor)
        self.upsample   = NaiveUpsample(shorten_factor)

        self.valley_transformer = get_hourglass_transformer(
            shorten_factor = rest_shorten_factor,
            depth = valley_depth,
            attn_resampling = attn_resampling,
            updown_sample_type = updown_sample_type,
            **transformer_kwargs
        )

        self.attn_resampling_pre_valley = Transformer(depth = 1, **transformer_kwargs) if attn_resampling else None
        self.attn_resampling_post_valley = Transformer(depth = 1, **transformer_kwargs) if attn_resampling else None

        self.pre_transformer = Transformer(depth = pre_layers_depth, **transformer_kwargs)
        self.post_transformer = Transformer(depth = post_layers_depth, **transformer_kwargs)
        self.norm_out = nn.LayerNorm(dim) if norm_out else nn.Identity()

    def forward(self, x):
        # b : batch, n : sequence length, d : feature dimension, s : shortening factor

        s, b, n = self.shorten_factor, *x.shape[:2]

        # top half of hourglass, pre-transformer layers

        x = self.pre_transformer(x)

        # pad to multiple of shortening factor, in preparation for pooling

        x = pad_to_multiple(x, s, dim = -2)

        # save the residual, and for "attention resampling" at downsample and upsample

        x_residual = x.clone()

        # if autoregressive, do the shift by shortening factor minus one

        if self.causal:
            shift = s - 1
            x = F.pad(x, (0, 0, shift, -shift), value = 0.)

        d = x.shape[-1]

        if not FIXED:
            # naive average pool

            x = self.downsample(x)

            # pre-valley "attention resampling" - they have the pooled token in each bucket attend to the tokens pre-pooled

            if exists(self.attn_resampling_pre_valley):
                x = self.attn_resampling_pre_valley(
                    x.reshape(-1, 1, d),                     # rearrange(x, 'b n d -> (b n) () d')
                    x_residual.reshape(-1, s, d)             # rearrange(x_residual, 'b (n s) d -> (b n) s d', s = s)
                )

                x = x.reshape(b, -1, d)                      # rearrange(x, '(b n) () d -> b n d', b = b)

            # the "valley" - either a regular transformer or another hourglass

            x = self.valley_transformer(x)
        else:
            # naive average pool

            downsampled = self.downsample(x)

            # pre-valley "attention resampling" - they have the pooled token in each bucket attend to the tokens pre-pooled

            if exists(self.attn_resampling_pre_valley):
                downsampled = self.attn_resampling_pre_valley(
                    downsampled.reshape(-1, 1, d),           # rearrange(downsampled, 'b n d -> (b n) () d')
                    x.reshape(-1, s, d)                      # rearrange(x, 'b (n s) d -> (b n) s d', s = s)
                )

                downsampled = downsampled.reshape(b, -1, d)  # rearrange(downsampled, '(b n) () d -> b n d', b = b)

            # the "valley" - either a regular transformer or another hourglass

            x = self.valley_transformer(downsampled)

        valley_out = x.clone()

        # naive repeat upsample

        x = self.upsample(x)

        # add the residual

        x = x + x_residual

        # post-valley "attention resampling"

        if exists(self.attn_resampling_post_valley):
            x = self.attn_resampling_post_valley(
                x.reshape(-1, s, d),                         # rearrange(x, 'b (n s) d -> (b n) s d', s = s)
                valley_out.reshape(-1, 1, d)                 # rearrange(valley_out, 'b n d -> (b n) () d')
            )

            x = x.reshape(b, -1, d)                          # rearrange(x, '(b n) s d -> b (n s) d', b = b)

        # bring sequence back to original length, if it were padded for pooling

        x = x[:, :n]

        # post-valley transformers

        x = self.post_transformer(x)
        return self.norm_out(x)

# main class

class HourglassTransformerLM(nn.Module):
    def __init__(self, *, num_tokens, dim, max_seq_len, depth, shorten_factor = None, heads = 8, dim_head = 64,
                 attn_resampling = True, updown_sample_type = 'naive'):
        super().__init__()
        self.max_seq_len = max_seq_len

        self.token_emb = nn.Embedding(num_tokens, dim)
        self.pos_emb = nn.Embedding(max_seq_len, dim)

        self.transformer = get_hourglass_transformer(
            dim = dim,
            depth = depth,
            shorten_factor = shorten_factor,
            attn_resampling = attn_resampling,
            updown_sample_type = updown_sample_type,
            dim_head = dim_head,
            heads = heads,
            causal = True,
            norm_out = True
        )

        self.to_logits = nn.Linear(dim, num_tokens)

    def forward(self, x):
        device = x.device
        x = self.token_emb(x)
        pos_emb = self.pos_emb(torch.arange(x.shape[-2], device = device))
        x = x + pos_emb[None]

        x = self.transformer(x)
        return self.to_logits(x)


torch.manual_seed(0)
model = HourglassTransformerLM(num_tokens = 256, dim = 32, max_seq_len = 32, depth = (1, 1, 1), shorten_factor = 4,
                               heads = 4, dim_head = 8).eval()

ids = torch.randint(0, 256, (2, 32))
t = 13   # change one byte at position 13 (inside the bucket 12..15)
ids2 = ids.clone()
ids2[:, t] = (ids2[:, t] + 1) % 256

with torch.no_grad():
    logits = model(ids)
    logits2 = model(ids2)

leak = (logits[:, :t] - logits2[:, :t]).abs().max().item()
print(f"fixed={FIXED}")
print(f"max change of logits[:, :{t}] when byte {t} changes (future leak) = {leak:.6f}")
