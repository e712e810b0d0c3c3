# lucidrains/perceiver-pytorch commit c8c5f57 ("make sure variable lengthed sequences are dropped out correctly").
# PerceiverIO's structured sequence dropout (dropout_seq) keeps the same num_keep slots for every row, so the input
# padding mask handed to the latent cross-attention lets a short (padded) sequence keep all its tokens instead of keep_prob.
import math
import sys

import torch
from torch import nn, einsum
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)

# helpers (einops rearrange/repeat written out in torch; same shapes as upstream)

def exists(val):
    return val is not None

def default(val, d):
    return val if exists(val) else d

# structured dropout, more effective than traditional attention dropouts

def dropout_seq(seq, mask, dropout):
    b, n, *_, device = *seq.shape, seq.device
    logits = torch.randn(b, n, device = device)

    if exists(mask):
        logits = logits.masked_fill(~mask, -torch.finfo(logits.dtype).max)

    if FIXED:
        keep_prob = 1. - dropout
        num_keep = max(1,  int(keep_prob * n))
    else:
        num_keep = max(1,  int((1 - dropout) * n))
    keep_indices = logits.topk(num_keep, dim = 1).indices

    batch_indices = torch.arange(b, device = device)
    batch_indices = batch_indices[:, None]                      # rearrange(batch_indices, 'b -> b 1')

    seq = seq[batch_indices, keep_indices]

    if exists(mask):
        if FIXED:
            seq_counts = mask.sum(dim = -1)
            seq_keep_counts = torch.ceil(seq_counts * keep_prob).int()
            keep_mask = torch.arange(num_keep, device = device) < seq_keep_counts[:, None]  # rearrange 'b -> b 1'

            mask = mask[batch_indices, keep_indices] & keep_mask
        else:
            mask = mask[batch_indices, keep_indices]

    return seq, mask

# helper classes

class PreNorm(nn.Module):
    def __init__(self, dim, fn, context_dim = None):
        super().__init__()
        self.fn = fn
        self.norm = nn.LayerNorm(dim)
        self.norm_context = nn.LayerNorm(context_dim) if exists(context_dim) else None

    def forward(self, x, **kwargs):
        x = self.norm(x)

        if exists(self.norm_context):
            context = kwargs['context']
            normed_context = self.norm_context(context)
            kwargs.update(context = normed_context)

        return self.fn(x, **kwargs)

class GEGLU(nn.Module):
    def forward(self, x):
        x, gates = x.chunk(2, dim = -1)
        return x * F.gelu(gates)

class FeedForward(nn.Module):
    def __init__(self, dim, mult = 4):
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(dim, dim * mult * 2),
            GEGLU(),
            nn.Linear(dim * mult, dim)
        )

    def forward(self, x):
        return self.net(x)

class Attention(nn.Module):
    def __init__(self, query_dim, context_dim = None, heads = 8, dim_head = 64):
        super().__init__()
        inner_dim = dim_head * heads
        context_dim = default(context_dim, query_dim)
        self.scale = dim_head ** -0.5
        self.heads = heads

        self.to_q = nn.Linear(query_dim, inner_dim, bias = False)
        self.to_kv = nn.Linear(context_dim, inner_dim * 2, bias = False)
        self.to_out = nn.Linear(inner_dim, query_dim)

    def forward(self, x, context = None, mask = None):
        h = self.heads

        q = self.to_q(x)
        context = default(context, x)
        k, v = self.to_kv(context).chunk(2, dim = -1)

        # rearrange(t, 'b n (h d) -> (b h) n d', h = h)
        q, k, v = map(lambda t: t.reshape(t.shape[0], t.shape[1], h, -1).permute(0, 2, 1, 3).reshape(t.shape[0] * h, t.shape[1], -1), (q, k, v))

        sim = einsum('b i d, b j d -> b i j', q, k) * self.scale

        if exists(mask):
            mask = mask.reshape(mask.shape[0], -1)              # rearrange(mask, 'b ... -> b (...)')
            max_neg_value = -torch.finfo(sim.dtype).max
            mask = mask.repeat_interleave(h, dim = 0)[:, None, :]  # repeat(mask, 'b j -> (b h) () j', h = h)
            sim.masked_fill_(~mask, max_neg_value)

        # attention, what we cannot get enough of
        attn = sim.softmax(dim = -1)

        out = einsum('b i j, b j d -> b i d', attn, v)
        out = out.reshape(-1, h, out.shape[1], out.shape[2]).permute(0, 2, 1, 3).reshape(-1, out.shape[1], h * out.shape[2])  # '(b h) n d -> b n (h d)'
        return self.to_out(out)

# main class

class PerceiverIO(nn.Module):
    def __init__(self, *, depth, dim, queries_dim, logits_dim = None, num_latents = 512, latent_dim = 512,
                 cross_heads = 1, latent_heads = 8, cross_dim_head = 64, latent_dim_head = 64, decoder_ff = False,
                 seq_dropout_prob = 0.):
        super().__init__()
        self.seq_dropout_prob = seq_dropout_prob

        self.latents = nn.Parameter(torch.randn(num_latents, latent_dim))

        self.cross_attend_blocks = nn.ModuleList([
            PreNorm(latent_dim, Attention(latent_dim, dim, heads = cross_heads, dim_head = cross_dim_head), context_dim = dim),
            PreNorm(latent_dim, FeedForward(latent_dim))
        ])

        self.layers = nn.ModuleList([])
        for i in range(depth):
            self.layers.append(nn.ModuleList([
                PreNorm(latent_dim, Attention(latent_dim, heads = latent_heads, dim_head = latent_dim_head)),
                PreNorm(latent_dim, FeedForward(latent_dim))
            ]))

        self.decoder_cross_attn = PreNorm(queries_dim, Attention(queries_dim, latent_dim, heads = cross_heads, dim_head = cross_dim_head), context_dim = latent_dim)
        self.decoder_ff = PreNorm(queries_dim, FeedForward(queries_dim)) if decoder_ff else None

        self.to_logits = nn.Linear(queries_dim, logits_dim) if exists(logits_dim) else nn.Identity()

    def forward(self, data, mask = None, queries = None):
        b, *_, device = *data.shape, data.device

        x = self.latents[None].expand(b, -1, -1)                # repeat(self.latents, 'n d -> b n d', b = b)

        cross_attn, cross_ff = self.cross_attend_blocks

        # structured dropout (as done in perceiver AR https://arxiv.org/abs/2202.07765)

        if self.training and self.seq_dropout_prob > 0.:
            data, mask = dropout_seq(data, mask, self.seq_dropout_prob)

        # cross attention only happens once for Perceiver IO

        x = cross_attn(x, context = data, mask = mask) + x
        x = cross_ff(x) + x

        for self_attn, self_ff in self.layers:
            x = self_attn(x) + x
            x = self_ff(x) + x

        if not exists(queries):
            return x

        if queries.ndim == 2:
            queries = queries[None].expand(b, -1, -1)

        latents = self.decoder_cross_attn(queries, context = x)

        if exists(self.decoder_ff):
            latents = latents + self.decoder_ff(latents)

        return self.to_logits(latents)


seq_dropout_prob = 0.5
model = PerceiverIO(depth = 2, dim = 32, queries_dim = 32, logits_dim = 10, num_latents = 8, latent_dim = 32,
                    cross_heads = 1, latent_heads = 4, cross_dim_head = 16, latent_dim_head = 8,
                    seq_dropout_prob = seq_dropout_prob)
model.train()

# batch of 2 variable-length inputs, right-padded to 24: lengths 24 and 6
n = 24
lengths = torch.tensor([24, 6])
data = torch.randn(2, n, 32)
mask = torch.arange(n)[None, :] < lengths[:, None]
queries = torch.randn(4, 32)

seen = {}
def grab_mask(module, args, kwargs):
    seen['mask'] = kwargs['mask']
model.cross_attend_blocks[0].register_forward_pre_hook(grab_mask, with_kwargs = True)

# one training step
opt = torch.optim.SGD(model.parameters(), lr = 1e-2)
logits = model(data, mask = mask, queries = queries)
loss = logits.pow(2).mean()
loss.backward()
opt.step()

attended = seen['mask'].sum(dim = -1)
expected = torch.ceil(lengths * (1 - seq_dropout_prob)).int()
frac_short = attended[1].item() / lengths[1].item()
print(f"fixed={FIXED}  tokens the latents cross-attend per row: {attended.tolist()} (keep_prob share: {expected.tolist()})")
print(f"share of the padded row's real tokens kept (should be keep_prob={1 - seq_dropout_prob}): {frac_short:.3f}")
