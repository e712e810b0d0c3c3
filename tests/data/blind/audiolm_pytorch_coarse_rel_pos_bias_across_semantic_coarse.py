# lucidrains/audiolm-pytorch commit 0491eaa ("in coarse transformer, make sure that coarse tokens attending to
# semantic tokens (cross attention) does not use relative positions"). CoarseTransformer runs one causal
# transformer over [semantic start, semantic tokens, coarse start, coarse tokens]; the Transformer built one
# continuous relative position bias over the whole joined sequence, so a coarse token's attention to the semantic
# prefix was biased by its distance in the flattened (n q) order. Fix: CoarseTransformer engineers the bias itself,
# replacing every semantic<->coarse cell with a learned per-head `cross_attn_bias`, and hands it as `attn_bias`.
# (einops calls written out with torch; T5 text conditioning left out.)
import math
import sys
from functools import partial

import torch
from torch import nn, einsum
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


def exists(val):
    return val is not None


def default(val, d):
    return val if exists(val) else d


def maybe(fn):
    def inner(x, *args, **kwargs):
        if not exists(fn):
            return None
        return fn(x, *args, **kwargs)
    return inner


def ceil_div(numer, denom):
    return (numer + denom - 1) // denom


def round_down_nearest_multiple(val, mult):
    return (val // mult) * mult


def grad_shrink(t, alpha=0.1):
    return t * alpha + t.detach() * (1 - alpha)


def l2norm(t):
    return F.normalize(t, dim=-1)


class LayerNorm(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.gamma = nn.Parameter(torch.ones(dim))
        self.register_buffer("beta", torch.zeros(dim))

    def forward(self, x):
        return F.layer_norm(x, x.shape[-1:], self.gamma, self.beta)


class RelativePositionBias(nn.Module):
    """ from https://arxiv.org/abs/2111.09883 """

    def __init__(self, *, dim, heads, layers=3):
        super().__init__()
        self.net = nn.ModuleList([])
        self.net.append(nn.Sequential(nn.Linear(1, dim), nn.SiLU()))
        for _ in range(layers - 1):
            self.net.append(nn.Sequential(nn.Linear(dim, dim), nn.SiLU()))
        self.net.append(nn.Linear(dim, heads))

    def forward(self, n, device=torch.device('cpu')):
        pos = torch.arange(n, device=device)
        rel_pos = pos[:, None] - pos[None, :]
        rel_pos += (n - 1)

        x = torch.arange(-n + 1, n, device=device).float()
        x = x[..., None]
        for layer in self.net:
            x = layer(x)

        x = x[rel_pos]                   # i j h
        return x.permute(2, 0, 1)        # h i j


class CausalDSConv(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.ds_conv = nn.Conv1d(dim, dim, 3, bias=False, groups=dim)

    def forward(self, x):
        x = x.transpose(1, 2)
        x = F.pad(x, (2, 0))
        x = self.ds_conv(x)
        return x.transpose(1, 2)


class GEGLU(nn.Module):
    def forward(self, x):
        x, gate = x.chunk(2, dim=-1)
        return F.gelu(gate) * x


def FeedForward(dim, mult=4, dropout=0.1):
    inner_dim = int(dim * 2 * mult / 3)
    return nn.Sequential(
        LayerNorm(dim),
        nn.Linear(dim, inner_dim * 2, bias=False),
        CausalDSConv(inner_dim * 2),
        GEGLU(),
        LayerNorm(inner_dim),
        nn.Dropout(dropout),
        nn.Linear(inner_dim, dim, bias=False),
    )


class Attention(nn.Module):
    def __init__(self, dim, causal=False, dim_head=64, dim_context=None, heads=8, norm_context=False,
                 num_null_kv=0, dropout=0.1, scale=8):
        super().__init__()
        self.heads = heads
        self.scale = scale
        self.causal = causal
        inner_dim = dim_head * heads
        dim_context = default(dim_context, dim)

        self.norm = LayerNorm(dim)
        self.context_norm = LayerNorm(dim_context) if norm_context else nn.Identity()
        self.attn_dropout = nn.Dropout(dropout)

        self.num_null_kv = num_null_kv
        self.null_kv = nn.Parameter(torch.randn(2, num_null_kv, dim_head))

        self.to_q = nn.Linear(dim, inner_dim, bias=False)
        self.to_kv = nn.Linear(dim_context, dim_head * 2, bias=False)

        self.q_scale = nn.Parameter(torch.ones(dim_head))
        self.k_scale = nn.Parameter(torch.ones(dim_head))

        self.to_out = nn.Sequential(nn.Linear(inner_dim, dim, bias=False), nn.Dropout(dropout))

    def forward(self, x, context=None, mask=None, attn_bias=None):
        b, n, _ = x.shape

        if exists(context):
            context = self.context_norm(context)
        kv_input = default(context, x)

        x = self.norm(x)
        q, k, v = self.to_q(x), *self.to_kv(kv_input).chunk(2, dim=-1)

        if self.num_null_kv > 0:
            null_k, null_v = self.null_kv[:, None].expand(-1, b, -1, -1).unbind(dim=0)
            k = torch.cat((null_k, k), dim=-2)
            v = torch.cat((null_v, v), dim=-2)

        q = q.view(b, n, self.heads, -1).transpose(1, 2)          # b h n d

        q, k = map(l2norm, (q, k))
        q = q * self.q_scale
        k = k * self.k_scale

        sim = einsum('b h i d, b j d -> b h i j', q, k) * self.scale

        if exists(attn_bias):
            attn_bias = F.pad(attn_bias, (self.num_null_kv, 0), value=0.)
            sim = sim + attn_bias

        if exists(mask):
            mask = F.pad(mask, (self.num_null_kv, 0), value=True)
            mask = mask[:, None, None, :]
            sim = sim.masked_fill(~mask, -torch.finfo(sim.dtype).max)

        if self.causal:
            i, j = sim.shape[-2:]
            causal_mask = torch.ones((i, j), dtype=torch.bool, device=x.device).triu(j - i + 1)
            sim = sim.masked_fill(causal_mask, -torch.finfo(sim.dtype).max)

        attn = sim.softmax(dim=-1)
        attn = self.attn_dropout(attn)

        out = einsum('b h i j, b j d -> b h i d', attn, v)
        out = out.transpose(1, 2).reshape(b, n, -1)
        return self.to_out(out)


class Transformer(nn.Module):
    def __init__(self, *, dim, depth, heads, attn_dropout=0., ff_dropout=0., grad_shrink_alpha=0.1,
                 rel_pos_bias=True, **kwargs):
        super().__init__()
        self.grad_shrink = partial(grad_shrink, alpha=grad_shrink_alpha)
        self.layers = nn.ModuleList([])
        self.rel_pos_bias = RelativePositionBias(dim=dim // 2, heads=heads) if rel_pos_bias else None

        for _ in range(depth):
            self.layers.append(nn.ModuleList([
                Attention(dim=dim, heads=heads, dropout=attn_dropout, causal=True, **kwargs),
                FeedForward(dim=dim, dropout=ff_dropout),
            ]))
        self.norm = LayerNorm(dim)

    def forward(self, x, self_attn_mask=None, attn_bias=None):
        n, device = x.shape[1], x.device
        x = self.grad_shrink(x)

        if exists(attn_bias):
            rel_pos_bias = attn_bias
        else:
            rel_pos_bias = maybe(self.rel_pos_bias)(n, device=device)

        for attn, ff in self.layers:
            x = attn(x, attn_bias=rel_pos_bias, mask=self_attn_mask) + x
            x = ff(x) + x

        return self.norm(x)


class CoarseTransformer(nn.Module):
    def __init__(self, *, codebook_size, num_coarse_quantizers, dim, depth, num_semantic_tokens, heads=8,
                 attn_dropout=0., ff_dropout=0., grad_shrink_alpha=0.1, **kwargs):
        super().__init__()
        self.num_semantic_tokens = num_semantic_tokens

        self.semantic_start_token = nn.Parameter(torch.randn(dim))
        self.coarse_start_token = nn.Parameter(torch.randn(dim))

        self.semantic_eos_id = num_semantic_tokens
        self.semantic_embedding = nn.Embedding(num_semantic_tokens + 1, dim)

        self.coarse_eos_id = codebook_size
        codebook_size_with_eos = codebook_size + 1

        self.coarse_embedding = nn.Embedding(num_coarse_quantizers * codebook_size_with_eos, dim)
        self.coarse_quantize_embedding = nn.Embedding(num_coarse_quantizers, dim)

        if FIXED:
            self.cross_attn_bias = nn.Parameter(torch.zeros(heads, 1, 1))

        self.transformer = Transformer(dim=dim, depth=depth, heads=heads, attn_dropout=attn_dropout,
                                       ff_dropout=ff_dropout, grad_shrink_alpha=grad_shrink_alpha, **kwargs)

        self.codebook_size = codebook_size
        self.num_coarse_quantizers = num_coarse_quantizers

        self.to_semantic_logits = nn.Linear(dim, num_semantic_tokens + 1)
        self.coarse_logit_weights = nn.Parameter(torch.randn(num_coarse_quantizers, codebook_size_with_eos, dim))

    def forward(self, *, semantic_token_ids, coarse_token_ids, self_attn_mask=None):
        b, device = semantic_token_ids.shape[0], semantic_token_ids.device
        arange = partial(torch.arange, device=device)

        coarse_token_ids = coarse_token_ids.reshape(b, -1)            # b n q -> b (n q)
        semantic_token_ids = semantic_token_ids.reshape(b, -1)

        offsets = self.codebook_size * arange(self.num_coarse_quantizers)
        offsets = offsets.repeat(ceil_div(coarse_token_ids.shape[-1], self.num_coarse_quantizers))[None]
        offsets = offsets[:, :coarse_token_ids.shape[-1]]
        coarse_token_ids = coarse_token_ids + offsets

        semantic_tokens = self.semantic_embedding(semantic_token_ids)
        coarse_tokens = self.coarse_embedding(coarse_token_ids)

        coarse_quantize_tokens = self.coarse_quantize_embedding.weight.repeat(
            ceil_div(coarse_token_ids.shape[-1], self.num_coarse_quantizers), 1)
        coarse_quantize_tokens = coarse_quantize_tokens[:coarse_token_ids.shape[-1], ...]
        coarse_tokens = coarse_tokens + coarse_quantize_tokens

        semantic_seq_len = semantic_tokens.shape[1]

        semantic_start_tokens = self.semantic_start_token[None, None].expand(b, 1, -1)
        coarse_start_tokens = self.coarse_start_token[None, None].expand(b, 1, -1)

        tokens = torch.cat((semantic_start_tokens, semantic_tokens, coarse_start_tokens, coarse_tokens), dim=1)

        if FIXED:
            # engineer the attention bias so that cross attention is not dominated by relative positions
            seq_len = tokens.shape[-2]
            attn_bias = self.transformer.rel_pos_bias(seq_len, device=device)

            is_semantic = arange(seq_len) < (semantic_seq_len + 1)   # semantic seq len + start token
            is_cross_attn = is_semantic[:, None] ^ is_semantic[None, :]

            attn_bias = torch.where(is_cross_attn, self.cross_attn_bias, attn_bias)

            tokens = self.transformer(tokens, attn_bias=attn_bias, self_attn_mask=self_attn_mask)
        else:
            tokens = self.transformer(tokens, self_attn_mask=self_attn_mask)

        pred_semantic_tokens, pred_coarse_tokens = tokens[:, :semantic_seq_len], tokens[:, (semantic_seq_len + 1):]

        semantic_logits = self.to_semantic_logits(pred_semantic_tokens)

        n = pred_coarse_tokens.shape[1]
        nq = round_down_nearest_multiple(n, self.num_coarse_quantizers)
        groupable, remainder = pred_coarse_tokens[:, :nq], pred_coarse_tokens[:, nq:]
        groupable = groupable.reshape(b, -1, self.num_coarse_quantizers, groupable.shape[-1])
        coarse_logits = einsum('q c d, b n q d -> b n q c', self.coarse_logit_weights, groupable).reshape(b, nq, -1)

        if remainder.shape[1] > 0:
            coarse_logits_remainder = einsum('q c d, b q d -> b q c',
                                             self.coarse_logit_weights[:remainder.shape[1]], remainder)
            coarse_logits = torch.cat((coarse_logits, coarse_logits_remainder), dim=1)

        return semantic_logits, coarse_logits


def main():
    torch.manual_seed(0)
    model = CoarseTransformer(num_semantic_tokens=50, codebook_size=32, num_coarse_quantizers=3,
                              dim=64, depth=2, heads=4, dim_head=16).eval()

    semantic_token_ids = torch.randint(0, 50, (2, 12))
    coarse_token_ids = torch.randint(0, 32, (2, 5, 3))          # b n q

    with torch.no_grad():
        semantic_logits, coarse_logits = model(semantic_token_ids=semantic_token_ids,
                                               coarse_token_ids=coarse_token_ids)

    # greedy next coarse token after each position
    print("coarse logits", tuple(coarse_logits.shape))
    print("coarse argmax", coarse_logits.argmax(-1)[0].tolist())
    print("coarse logits[0, -1, :4]", [round(v, 4) for v in coarse_logits[0, -1, :4].tolist()])


if __name__ == "__main__":
    main()
