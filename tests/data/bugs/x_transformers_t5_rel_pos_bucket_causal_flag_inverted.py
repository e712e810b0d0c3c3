# Citation: lucidrains/x-transformers#10 ("bug fix for _relative_position_bucket", commit 6d0c641,
# merged in a06f479, released in 0.6.x on 2021-01-03).
#
# x-transformers' RelativePositionBias (T5-style relative position buckets, `rel_pos_bias = True`) is shared by
# the Encoder (causal = False) and the Decoder (causal = True) of an XTransformer. Before the fix,
# `_relative_position_bucket` tested `if causal:` where T5 tests `if bidirectional:`: the causal decoder split its
# buckets into two halves by direction, and the bidirectional encoder clamped n = -(k - q) at 0, so every key to
# the right of a query, at any distance, fell into bucket 0, the bucket of the query itself.
# The fix: `if not causal:`.
#
# Ported from x_transformers/x_transformers.py at 6d0c641^ (RelativePositionBias, Attention, AttentionLayers,
# Encoder, Decoder, TransformerWrapper, XTransformer) and autoregressive_wrapper.py (the loss), trimmed: no
# talking heads, entmax, memory key/values, sinusoidal embeddings; einops rearranges written with view/permute.
# A copy task as examples/enc_dec_copy writes it, on a right-padded source batch (src_mask False on pads).

import math
import sys
from functools import partial
from inspect import isfunction
from collections import namedtuple

import torch
from torch import nn, einsum
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv

Intermediates = namedtuple('Intermediates', ['pre_softmax_attn', 'post_softmax_attn'])
LayerIntermediates = namedtuple('Intermediates', ['hiddens', 'attn_intermediates'])

# helpers

def exists(val):
    return val is not None

def default(val, d):
    if exists(val):
        return val
    return d() if isfunction(d) else d

def always(val):
    def inner(*args, **kwargs):
        return val
    return inner

def max_neg_value(tensor):
    return -torch.finfo(tensor.dtype).max

def pick_and_pop(keys, d):
    values = list(map(lambda key: d.pop(key), keys))
    return dict(zip(keys, values))

def group_dict_by_key(cond, d):
    return_val = [dict(), dict()]
    for key in d.keys():
        match = bool(cond(key))
        ind = int(not match)
        return_val[ind][key] = d[key]
    return (*return_val,)

def string_begins_with(prefix, str):
    return str.startswith(prefix)

def groupby_prefix_and_trim(prefix, d):
    kwargs_with_prefix, kwargs = group_dict_by_key(partial(string_begins_with, prefix), d)
    kwargs_without_prefix = dict(map(lambda x: (x[0][len(prefix):], x[1]), tuple(kwargs_with_prefix.items())))
    return kwargs_without_prefix, kwargs

# positional embeddings

class AbsolutePositionalEmbedding(nn.Module):
    def __init__(self, dim, max_seq_len):
        super().__init__()
        self.emb = nn.Embedding(max_seq_len, dim)
        nn.init.normal_(self.emb.weight, std = 0.02)

    def forward(self, x):
        n = torch.arange(x.shape[1], device = x.device)
        return self.emb(n)[None, :, :]

class RelativePositionBias(nn.Module):
    def __init__(self, causal = False, num_buckets = 32, max_distance = 128, heads = 8):
        super().__init__()
        self.causal = causal
        self.num_buckets = num_buckets
        self.max_distance = max_distance
        self.relative_attention_bias = nn.Embedding(num_buckets, heads)

    @staticmethod
    def _relative_position_bucket(relative_position, causal = True, num_buckets = 32, max_distance = 128):
        ret = 0
        n = -relative_position
        split = (not causal) if FIXED else causal
        if split:
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

    def forward(self, qk_dots):
        i, j, device = *qk_dots.shape[-2:], qk_dots.device
        q_pos = torch.arange(i, dtype = torch.long, device = device)
        k_pos = torch.arange(j, dtype = torch.long, device = device)
        rel_pos = k_pos[None, :] - q_pos[:, None]
        rp_bucket = self._relative_position_bucket(rel_pos, causal = self.causal, num_buckets = self.num_buckets)
        values = self.relative_attention_bias(rp_bucket)
        bias = values.permute(2, 0, 1).unsqueeze(0)  # 'i j h -> () h i j'
        return qk_dots + bias

# classes

class PreNorm(nn.Module):
    def __init__(self, dim, fn, norm_class = nn.LayerNorm):
        super().__init__()
        self.fn = fn
        self.norm = norm_class(dim)

    def forward(self, x, **kwargs):
        x = self.norm(x)
        return self.fn(x, **kwargs)

class FeedForward(nn.Module):
    def __init__(self, dim, dim_out = None, mult = 4, glu = False, dropout = 0.):
        super().__init__()
        dim_out = default(dim_out, dim)
        project_in = nn.Sequential(nn.Linear(dim, dim * mult), nn.GELU())
        self.net = nn.Sequential(project_in, nn.Dropout(dropout), nn.Linear(dim * mult, dim_out))

    def forward(self, x):
        return self.net(x)

class Attention(nn.Module):
    def __init__(self, dim, dim_head = 64, heads = 8, causal = False, mask = None, dropout = 0.):
        super().__init__()
        self.scale = dim_head ** -0.5
        self.heads = heads
        self.causal = causal
        self.mask = mask

        inner_dim = dim_head * heads
        self.to_q = nn.Linear(dim, inner_dim, bias = False)
        self.to_k = nn.Linear(dim, inner_dim, bias = False)
        self.to_v = nn.Linear(dim, inner_dim, bias = False)
        self.dropout = nn.Dropout(dropout)
        self.attn_fn = F.softmax
        self.to_out = nn.Linear(inner_dim, dim)

    def forward(self, x, context = None, mask = None, context_mask = None, rel_pos = None, prev_attn = None, mem = None):
        b, n, _, h, device = *x.shape, self.heads, x.device
        kv_input = default(context, x)

        q_input = x
        k_input = kv_input
        v_input = kv_input

        if exists(mem):
            k_input = torch.cat((mem, k_input), dim = -2)
            v_input = torch.cat((mem, v_input), dim = -2)

        q = self.to_q(q_input)
        k = self.to_k(k_input)
        v = self.to_v(v_input)

        # 'b n (h d) -> b h n d'
        q, k, v = map(lambda t: t.view(t.shape[0], t.shape[1], h, -1).transpose(1, 2), (q, k, v))

        input_mask = None
        if any(map(exists, (mask, context_mask))):
            q_mask = default(mask, lambda: torch.ones((b, n), device = device).bool())
            k_mask = q_mask if not exists(context) else context_mask
            k_mask = default(k_mask, lambda: torch.ones((b, k.shape[-2]), device = device).bool())
            q_mask = q_mask[:, None, :, None]   # 'b i -> b () i ()'
            k_mask = k_mask[:, None, None, :]   # 'b j -> b () () j'
            input_mask = q_mask * k_mask

        dots = einsum('b h i d, b h j d -> b h i j', q, k) * self.scale
        mask_value = max_neg_value(dots)

        if exists(prev_attn):
            dots = dots + prev_attn

        pre_softmax_attn = dots

        if exists(rel_pos):
            dots = rel_pos(dots)

        if exists(input_mask):
            dots.masked_fill_(~input_mask, mask_value)
            del input_mask

        if self.causal:
            i, j = dots.shape[-2:]
            mask = torch.ones((i, j), device = device).triu_(j - i + 1).bool()
            dots.masked_fill_(mask, mask_value)
            del mask

        attn = self.attn_fn(dots, dim = -1)
        post_softmax_attn = attn
        attn = self.dropout(attn)

        out = einsum('b h i j, b h j d -> b h i d', attn, v)
        out = out.transpose(1, 2).reshape(b, n, -1)  # 'b h n d -> b n (h d)'

        intermediates = Intermediates(pre_softmax_attn = pre_softmax_attn, post_softmax_attn = post_softmax_attn)
        return self.to_out(out), intermediates

class AttentionLayers(nn.Module):
    def __init__(self, dim, depth, heads = 8, causal = False, cross_attend = False, only_cross = False,
                 rel_pos_bias = False, pre_norm = True, **kwargs):
        super().__init__()
        self.dim = dim
        self.depth = depth
        self.layers = nn.ModuleList([])

        self.has_pos_emb = rel_pos_bias
        self.rel_pos = RelativePositionBias(causal = causal) if rel_pos_bias else None

        self.pre_norm = pre_norm

        norm_fn = partial(nn.LayerNorm, dim)

        ff_kwargs, kwargs = groupby_prefix_and_trim('ff_', kwargs)
        attn_kwargs, _ = groupby_prefix_and_trim('attn_', kwargs)

        if cross_attend and not only_cross:
            default_block = ('a', 'c', 'f')
        elif cross_attend and only_cross:
            default_block = ('c', 'f')
        else:
            default_block = ('a', 'f')

        layer_types = default_block * depth
        self.layer_types = layer_types
        self.default_mems = ([None] * len(list(filter(lambda t: t == 'a', layer_types))))

        for layer_type in self.layer_types:
            if layer_type == 'a':
                layer = Attention(dim, heads = heads, causal = causal, **attn_kwargs)
            elif layer_type == 'c':
                layer = Attention(dim, heads = heads, **attn_kwargs)
            elif layer_type == 'f':
                layer = FeedForward(dim, **ff_kwargs)
            else:
                raise Exception(f'invalid layer type {layer_type}')

            self.layers.append(nn.ModuleList([norm_fn(), layer]))

    def forward(self, x, context = None, mask = None, context_mask = None, mems = None, return_hiddens = False):
        hiddens = []
        intermediates = []
        prev_attn = None
        prev_cross_attn = None

        mems = mems.copy() if exists(mems) else self.default_mems.copy()  # as 208d70d keeps the defaults

        for ind, (layer_type, (norm, block)) in enumerate(zip(self.layer_types, self.layers)):
            is_last = ind == (len(self.layers) - 1)

            if layer_type == 'a':
                hiddens.append(x)
                layer_mem = mems.pop(0)

            if self.pre_norm:
                x = norm(x)

            if layer_type == 'a':
                out, inter = block(x, mask = mask, rel_pos = self.rel_pos, prev_attn = prev_attn, mem = layer_mem)
            elif layer_type == 'c':
                out, inter = block(x, context = context, mask = mask, context_mask = context_mask, prev_attn = prev_cross_attn)
            elif layer_type == 'f':
                out = block(x)

            x = x + out

            if layer_type in ('a', 'c'):
                intermediates.append(inter)

            if not self.pre_norm and not is_last:
                x = norm(x)

        if return_hiddens:
            return x, LayerIntermediates(hiddens = hiddens, attn_intermediates = intermediates)
        return x

class Encoder(AttentionLayers):
    def __init__(self, **kwargs):
        assert 'causal' not in kwargs, 'cannot set causality on encoder'
        super().__init__(causal = False, **kwargs)

class Decoder(AttentionLayers):
    def __init__(self, **kwargs):
        assert 'causal' not in kwargs, 'cannot set causality on decoder'
        super().__init__(causal = True, **kwargs)

class TransformerWrapper(nn.Module):
    def __init__(self, *, num_tokens, max_seq_len, attn_layers, emb_dropout = 0., use_pos_emb = True):
        super().__init__()
        dim = attn_layers.dim
        self.max_seq_len = max_seq_len
        self.token_emb = nn.Embedding(num_tokens, dim)
        self.pos_emb = AbsolutePositionalEmbedding(dim, max_seq_len) if (use_pos_emb and not attn_layers.has_pos_emb) else always(0)
        self.emb_dropout = nn.Dropout(emb_dropout)
        self.attn_layers = attn_layers
        self.norm = nn.LayerNorm(dim)
        nn.init.normal_(self.token_emb.weight, std = 0.02)
        self.to_logits = lambda t: t @ self.token_emb.weight.t()

    def forward(self, x, return_embeddings = False, mask = None, mems = None, **kwargs):
        x = self.token_emb(x)
        x += self.pos_emb(x)
        x = self.emb_dropout(x)
        x, intermediates = self.attn_layers(x, mask = mask, mems = mems, return_hiddens = True, **kwargs)
        x = self.norm(x)
        return self.to_logits(x) if not return_embeddings else x

class AutoregressiveWrapper(nn.Module):
    def __init__(self, net, ignore_index = -100, pad_value = 0):
        super().__init__()
        self.pad_value = pad_value
        self.ignore_index = ignore_index
        self.net = net
        self.max_seq_len = net.max_seq_len

    @torch.no_grad()
    def generate(self, start_tokens, seq_len, **kwargs):
        out = start_tokens
        for _ in range(seq_len):
            x = out[:, -self.max_seq_len:]
            logits = self.net(x, **kwargs)[:, -1, :]
            sample = logits.argmax(dim = -1, keepdim = True)
            out = torch.cat((out, sample), dim = -1)
        return out[:, start_tokens.shape[1]:]

    def forward(self, x, **kwargs):
        xi = x[:, :-1]
        xo = x[:, 1:]
        mask = kwargs.pop('mask', None)
        if mask is not None and mask.shape[1] == x.shape[1]:
            mask = mask[:, :-1]
            kwargs.update(mask = mask)
        out = self.net(xi, **kwargs)
        return F.cross_entropy(out.transpose(1, 2), xo, ignore_index = self.ignore_index)

class XTransformer(nn.Module):
    def __init__(self, *, dim, tie_token_emb = False, **kwargs):
        super().__init__()
        enc_kwargs, kwargs = groupby_prefix_and_trim('enc_', kwargs)
        dec_kwargs, kwargs = groupby_prefix_and_trim('dec_', kwargs)

        enc_transformer_kwargs = pick_and_pop(['num_tokens', 'max_seq_len'], enc_kwargs)
        dec_transformer_kwargs = pick_and_pop(['num_tokens', 'max_seq_len'], dec_kwargs)

        self.encoder = TransformerWrapper(**enc_transformer_kwargs, attn_layers = Encoder(dim = dim, **enc_kwargs))
        self.decoder = TransformerWrapper(**dec_transformer_kwargs, attn_layers = Decoder(dim = dim, cross_attend = True, **dec_kwargs))

        if tie_token_emb:
            self.decoder.token_emb = self.encoder.token_emb

        self.decoder = AutoregressiveWrapper(self.decoder)

    @torch.no_grad()
    def generate(self, seq_in, seq_out_start, seq_len, src_mask = None):
        encodings = self.encoder(seq_in, return_embeddings = True, mask = src_mask)
        return self.decoder.generate(seq_out_start, seq_len, context = encodings, context_mask = src_mask)

    def forward(self, src, tgt, src_mask = None, tgt_mask = None):
        enc = self.encoder(src, mask = src_mask, return_embeddings = True)
        return self.decoder(tgt, context = enc, mask = tgt_mask, context_mask = src_mask)


def main():
    torch.manual_seed(0)
    NUM_TOKENS = 16 + 2
    ENC_SEQ_LEN = 12
    DEC_SEQ_LEN = 12 + 1

    model = XTransformer(
        dim = 32,
        tie_token_emb = True,
        enc_num_tokens = NUM_TOKENS,
        enc_depth = 2,
        enc_heads = 8,
        enc_attn_dim_head = 8,
        enc_max_seq_len = ENC_SEQ_LEN,
        enc_rel_pos_bias = True,
        dec_num_tokens = NUM_TOKENS,
        dec_depth = 2,
        dec_heads = 8,
        dec_attn_dim_head = 8,
        dec_max_seq_len = DEC_SEQ_LEN,
        dec_rel_pos_bias = True,
    )
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, RelativePositionBias):
                m.relative_attention_bias.weight.normal_(0., 1.)

    # copy task: the target is 1 (start) followed by the source; sources right-padded with 0
    lengths = [12, 8, 5]
    src = torch.zeros(len(lengths), ENC_SEQ_LEN, dtype = torch.long)
    src_mask = torch.zeros(len(lengths), ENC_SEQ_LEN, dtype = torch.bool)
    for b, L in enumerate(lengths):
        src[b, :L] = torch.randint(2, NUM_TOKENS, (L,))
        src_mask[b, :L] = True
    tgt = torch.cat((torch.ones(len(lengths), 1, dtype = torch.long), src), dim = 1)
    tgt_mask = torch.cat((torch.ones(len(lengths), 1, dtype = torch.bool), src_mask), dim = 1)

    optim = torch.optim.Adam(model.parameters(), lr = 3e-3)
    for step in range(10):
        model.train()
        loss = model(src, tgt, src_mask = src_mask, tgt_mask = tgt_mask)
        optim.zero_grad()
        loss.backward()
        optim.step()
    print(f"train loss after 10 steps: {loss.item():.6f}")

    model.eval()
    with torch.no_grad():
        enc = model.encoder(src, mask = src_mask, return_embeddings = True)
        print("encoder output, row 1, first real token:", [round(v, 4) for v in enc[1, 0, :6].tolist()])
        start = torch.ones(len(lengths), 1, dtype = torch.long)
        out = model.generate(src, start, ENC_SEQ_LEN, src_mask = src_mask)
    for b, L in enumerate(lengths):
        print(f"row {b}: src {src[b, :L].tolist()} -> {out[b, :L].tolist()}")


if __name__ == "__main__":
    main()
