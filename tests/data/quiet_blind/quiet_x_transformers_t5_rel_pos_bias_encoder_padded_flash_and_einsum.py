"""An x-transformers Encoder with T5 relative position bias (`rel_pos_bias = True`) over a padded batch.

Correct program. Port (einops / einx calls written as plain torch, trimmed to an encoder) of
lucidrains/x-transformers:
* x_transformers/x_transformers.py @003275c607ca60b850bacd6b24d7d43e8b54dda9: RelativePositionBias
  (T5 buckets, bidirectional when `causal = False`, `bias * scale` with scale = dim_head ** 0.5 as
  AttentionLayers builds it), Attention.forward (self-attention's `input_mask = mask`,
  `masks.append(~input_mask)`, `final_attn_mask = ~or_reduce(masks)`, `attn_bias = rel_pos(i, j)`),
  AttentionLayers (pre-norm residual blocks, one shared rel_pos), TransformerWrapper without an
  absolute positional embedding;
* x_transformers/attend.py @004dd51c1ba44284cdd24b1b9792c83e0039ac24: Attend.forward (einsum path:
  `sim * scale + attn_bias`, `masked_fill(~mask, -finfo.max)`, softmax) and Attend.flash_attn (bias
  expanded per batch, `attn_bias.masked_fill(~mask, mask_value // 2)` handed to SDPA as attn_mask,
  rows with no key zeroed).

Check: the batch is run right-padded and left-padded, with `attn_flash` False and True; the real
tokens' embeddings must equal each sequence run alone with no mask, and the masked-mean pooled
vector must equal the plain mean of that lone run.
"""
import math
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn, einsum
from torch.nn import Module, ModuleList

torch.manual_seed(0)


def exists(val):
    return val is not None


def default(val, d):
    return val if exists(val) else d


def or_reduce(masks):
    head, *body = masks
    for rest in body:
        head = head | rest
    return head


def masked_mean(t, mask=None, dim=1):
    if not exists(mask):
        return t.mean(dim=dim)
    dims_append = (1,) * (t.ndim - mask.ndim)
    mask = mask.reshape(*mask.shape, *dims_append)
    num = (t * mask).sum(dim=dim)
    den = mask.sum(dim=dim).clamp(min=1.)
    return num / den


# ------------------------------------------------------------------ x_transformers.py
class RelativePositionBias(Module):
    def __init__(self, scale, causal=False, num_buckets=32, max_distance=128, heads=8):
        super().__init__()
        self.scale = scale
        self.causal = causal
        self.num_buckets = num_buckets
        self.max_distance = max_distance
        self.relative_attention_bias = nn.Embedding(num_buckets, heads)

    @staticmethod
    def _relative_position_bucket(relative_position, causal=True, num_buckets=32, max_distance=128):
        ret = 0
        n = -relative_position
        if not causal:
            num_buckets //= 2
            ret += (n < 0).long() * num_buckets
            n = torch.abs(n)
        else:
            n = torch.max(n, torch.zeros_like(n))
        max_exact = num_buckets // 2
        is_small = n < max_exact
        val_if_large = max_exact + (
            torch.log(n.float() / max_exact) / math.log(max_distance / max_exact) * (num_buckets - max_exact)
        ).long()
        val_if_large = torch.min(val_if_large, torch.full_like(val_if_large, num_buckets - 1))
        ret += torch.where(is_small, n, val_if_large)
        return ret

    @property
    def device(self):
        return next(self.parameters()).device

    def forward(self, i, j):
        device = self.device
        q_pos = torch.arange(j - i, j, dtype=torch.long, device=device)
        k_pos = torch.arange(j, dtype=torch.long, device=device)
        rel_pos = k_pos[None, :] - q_pos[:, None]  # einx.subtract('j, i -> i j', k_pos, q_pos)
        rp_bucket = self._relative_position_bucket(rel_pos, causal=self.causal, num_buckets=self.num_buckets,
                                                   max_distance=self.max_distance)
        values = self.relative_attention_bias(rp_bucket)
        bias = values.permute(2, 0, 1)  # 'i j h -> h i j'
        return bias * self.scale


# ------------------------------------------------------------------ attend.py
def create_causal_mask(i, j, device):
    return torch.ones((i, j), device=device, dtype=torch.bool).triu(j - i + 1)


class Attend(Module):
    def __init__(self, *, dropout=0., causal=False, scale=None, flash=False):
        super().__init__()
        self.scale = scale
        self.causal = causal
        self.create_causal_mask = create_causal_mask
        self.attn_fn = partial(F.softmax, dim=-1, dtype=torch.float32)
        self.dropout = dropout
        self.attn_dropout = nn.Dropout(dropout)
        self.flash = flash

    def flash_attn(self, q, k, v, mask=None, attn_bias=None):
        batch, heads, q_len, _, k_len, device = *q.shape, k.shape[-2], q.device
        if exists(self.scale):
            default_scale = q.shape[-1] ** -0.5
            q = q * (self.scale / default_scale)
        causal = self.causal
        if q_len == 1 and causal:
            causal = False
        if exists(mask):
            assert mask.ndim == 4
            mask = mask.expand(batch, heads, q_len, k_len)
        if k_len > q_len and causal:
            causal_mask = self.create_causal_mask(q_len, k_len, device=device)
            mask = ~causal_mask if not exists(mask) else mask & ~causal_mask
            causal = False
        if exists(mask) and causal:
            causal_mask = self.create_causal_mask(q_len, k_len, device=device)
            mask = mask & ~causal_mask
            causal = False
        row_is_entirely_masked = None
        if exists(mask):
            row_is_entirely_masked = ~mask.any(dim=-1)
        if exists(attn_bias):
            attn_bias = attn_bias[None].expand(batch, heads, -1, -1)  # 'h i j -> 1 h i j'
            mask_value = -torch.finfo(q.dtype).max
            if exists(mask):
                attn_bias = attn_bias.masked_fill(~mask, mask_value // 2)
            elif causal:
                causal_mask = self.create_causal_mask(q_len, k_len, device=device)
                attn_bias = attn_bias.masked_fill(causal_mask, mask_value // 2)
                causal = False
            mask = attn_bias
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=self.dropout if self.training else 0., is_causal=causal)
        if exists(row_is_entirely_masked) and row_is_entirely_masked.any():
            out = out.masked_fill(row_is_entirely_masked[..., None], 0.)
        return out

    def forward(self, q, k, v, mask=None, attn_bias=None):
        n, device = q.shape[-2], q.device
        scale = default(self.scale, q.shape[-1] ** -0.5)
        causal = self.causal
        if exists(mask) and mask.ndim == 2:
            mask = mask[:, None, None, :]
        if n == 1 and causal:
            causal = False
        if self.flash:
            return self.flash_attn(q, k, v, mask=mask, attn_bias=attn_bias)
        sim = einsum('b h i d, b h j d -> b h i j', q, k)
        sim = sim * scale
        if exists(attn_bias):
            sim = sim + attn_bias
        i, j, dtype = *sim.shape[-2:], sim.dtype
        mask_value = -torch.finfo(sim.dtype).max
        if exists(mask):
            sim = sim.masked_fill(~mask, mask_value)
        if causal:
            causal_mask = self.create_causal_mask(i, j, device=device)
            sim = sim.masked_fill(causal_mask, mask_value)
        row_is_entirely_masked = None
        if exists(mask):
            row_is_entirely_masked = ~mask.any(dim=-1)
        attn = self.attn_fn(sim).type(dtype)
        attn = self.attn_dropout(attn)
        out = einsum('b h i j, b h j d -> b h i d', attn, v)
        if exists(row_is_entirely_masked) and row_is_entirely_masked.any():
            out = out.masked_fill(row_is_entirely_masked[..., None], 0.)
        return out


# ------------------------------------------------------------------ x_transformers.py (Attention, layers)
class Attention(Module):
    def __init__(self, dim, dim_head=16, heads=4, causal=False, flash=False):
        super().__init__()
        self.heads = heads
        self.causal = causal
        inner = dim_head * heads
        self.to_q = nn.Linear(dim, inner, bias=False)
        self.to_k = nn.Linear(dim, inner, bias=False)
        self.to_v = nn.Linear(dim, inner, bias=False)
        self.attend = Attend(causal=causal, flash=flash)
        self.to_out = nn.Linear(inner, dim, bias=False)

    def forward(self, x, context=None, mask=None, context_mask=None, attn_mask=None, rel_pos=None):
        b, n, h = x.shape[0], x.shape[1], self.heads
        has_context = exists(context)
        kv_input = default(context, x)
        q, k, v = self.to_q(x), self.to_k(kv_input), self.to_v(kv_input)
        q, k, v = (t.view(b, t.shape[1], h, -1).transpose(1, 2) for t in (q, k, v))  # 'b n (h d) -> b h n d'
        input_mask = context_mask if has_context else mask
        i, j = q.shape[-2], k.shape[-2]

        masks = []
        final_attn_mask = None
        if exists(input_mask):
            input_mask = input_mask[:, None, None, :]  # 'b j -> b 1 1 j'
            masks.append(~input_mask)
        if exists(attn_mask):
            if attn_mask.ndim == 2:
                attn_mask = attn_mask[None, None]
            masks.append(~attn_mask)
        if len(masks) > 0:
            final_attn_mask = ~or_reduce(masks)

        attn_bias = None
        if exists(rel_pos):
            attn_bias = rel_pos(i, j)

        out = self.attend(q, k, v, mask=final_attn_mask, attn_bias=attn_bias)
        out = out.transpose(1, 2).reshape(b, n, -1)  # 'b h n d -> b n (h d)'
        return self.to_out(out)


class FeedForward(Module):
    def __init__(self, dim, mult=4):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(dim, dim * mult), nn.GELU(), nn.Linear(dim * mult, dim))

    def forward(self, x):
        return self.net(x)


class Encoder(Module):
    """AttentionLayers(causal = False) with rel_pos_bias = True, pre-norm, layers ('a', 'f') * depth."""

    def __init__(self, dim, depth, heads=4, attn_dim_head=16, rel_pos_num_buckets=32, rel_pos_max_distance=128,
                 attn_flash=False):
        super().__init__()
        self.rel_pos = RelativePositionBias(scale=attn_dim_head ** 0.5, causal=False, heads=heads,
                                            num_buckets=rel_pos_num_buckets, max_distance=rel_pos_max_distance)
        self.layers = ModuleList([])
        for _ in range(depth):
            self.layers.append(ModuleList([nn.LayerNorm(dim), Attention(dim, attn_dim_head, heads, flash=attn_flash)]))
            self.layers.append(ModuleList([nn.LayerNorm(dim), FeedForward(dim)]))
        self.final_norm = nn.LayerNorm(dim)

    def forward(self, x, mask=None):
        for norm, block in self.layers:
            residual = x
            x = norm(x)
            if isinstance(block, Attention):
                out = block(x, mask=mask, rel_pos=self.rel_pos)
            else:
                out = block(x)
            x = out + residual
        return self.final_norm(x)


class TransformerWrapper(Module):
    def __init__(self, *, num_tokens, max_seq_len, attn_layers, dim):
        super().__init__()
        self.max_seq_len = max_seq_len
        self.token_emb = nn.Embedding(num_tokens, dim)
        self.attn_layers = attn_layers  # use_abs_pos_emb = False: position only through rel_pos

    def forward(self, x, mask=None, return_embeddings=True):
        x = self.token_emb(x)
        return self.attn_layers(x, mask=mask)


# ------------------------------------------------------------------ run and check
def build(flash):
    torch.manual_seed(1)
    enc = Encoder(dim=32, depth=2, heads=4, attn_dim_head=8, rel_pos_num_buckets=16, rel_pos_max_distance=20,
                  attn_flash=flash)
    return TransformerWrapper(num_tokens=50, max_seq_len=64, attn_layers=enc, dim=32).eval()


def pad(seqs, side, pad_id=0):
    n = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), n), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), n), dtype=torch.bool)
    for b, s in enumerate(seqs):
        sl = slice(0, len(s)) if side == "right" else slice(n - len(s), n)
        ids[b, sl] = s
        mask[b, sl] = True
    return ids, mask


seqs = [torch.randint(1, 50, (n,)) for n in (7, 25, 12, 3)]

with torch.no_grad():
    for flash in (False, True):
        model = build(flash)
        reference = build(False)
        reference.load_state_dict(model.state_dict())
        refs = [reference(s[None])[0] for s in seqs]  # each sequence alone, no mask
        for side in ("right", "left"):
            ids, mask = pad(seqs, side)
            emb = model(ids, mask=mask)
            pooled = masked_mean(emb, mask, dim=1)
            n = ids.shape[1]
            for b, s in enumerate(seqs):
                sl = slice(0, len(s)) if side == "right" else slice(n - len(s), n)
                err = (emb[b, sl] - refs[b]).abs().max().item()
                assert err < 1e-5, (flash, side, b, err)
                assert torch.allclose(pooled[b], refs[b].mean(dim=0), atol=1e-5), (flash, side, b)

print("x-transformers rel_pos_bias encoder: padded batches match per-sequence unmasked runs")
