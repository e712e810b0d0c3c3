"""Correct program (quiet batch quiet-r78a).

Ported from lucidrains/x-transformers @9252ed7838021ee61e6c5be0930b3a9a88efdf06, trimmed to a pre-norm Decoder
with absolute positions and no extras:
x_transformers/autoregressive_wrapper.py (align_right, pad_at_dim, AutoregressiveWrapper.generate with a list of
prompts: pad_sequence, prompt_lens, `seq_start_pos = t - prompt_lens`, cache_kv=True, greedy at temperature 0),
x_transformers/x_transformers.py (TokenEmbedding, AbsolutePositionalEmbedding with `(pos - seq_start_pos).clamp(min
= 0)`, Attention's cached_kv concat and `masks.append(~input_mask)`, AttentionLayers.forward's `left_pad_mask =
seq_arange >= seq_start_pos[..., None]` handed to the self-attention as context_mask and `x[:, -cache_age:]` over a
cache, LayerIntermediates.cache_length, TransformerWrapper.forward), x_transformers/attend.py (create_causal_mask,
Attend.forward: causal off for one query, masked_fill with -finfo.max, rows with no key zeroed).

The wrapper right-pads the prompts, then right-aligns them (left padding with pad_value 0); each call re-embeds the
whole sequence, the attention layers keep only the newest token once a cache exists, and every call masks the
left-pad keys of each row.

Self-check: the batched cached greedy generation of three prompts of different lengths equals, token by token
and logit by logit, each prompt generated alone (no padding, no cache, no seq_start_pos: a plain causal forward).
"""
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import arange, cat, tensor
from torch.nn.utils.rnn import pad_sequence

torch.manual_seed(0)


def exists(val):
    return val is not None


def default(val, d):
    return val if exists(val) else d


def max_neg_value(tensor):
    return -torch.finfo(tensor.dtype).max


def or_reduce(masks):
    head, *body = masks
    for rest in body:
        head = head | rest
    return head


def pad_at_dim(t, pad, dim=-1, value=0.):
    if pad == (0, 0):
        return t

    dims_from_right = (- dim - 1) if dim < 0 else (t.ndim - dim - 1)
    zeros = ((0, 0) * dims_from_right)
    return F.pad(t, (*zeros, *pad), value=value)


def align_right(t, lens, pad_id=0):
    batch, seq_len, device, dtype = *t.shape[:2], t.device, t.dtype

    assert lens.ndim == 1 and lens.shape[0] == batch
    assert lens.amax() <= seq_len

    pad_lens = seq_len - lens
    max_pad_len = pad_lens.amax()

    batch_arange = torch.arange(batch, device=device, dtype=torch.long)[..., None]
    prompt_len_arange = torch.arange(seq_len, device=device, dtype=torch.long)

    t = pad_at_dim(t, (int(max_pad_len), 0), value=pad_id, dim=1)
    offset = max_pad_len - pad_lens

    aligned = t[batch_arange, prompt_len_arange + offset[..., None], ...]
    return aligned


@dataclass
class Intermediates:
    cached_kv: tuple | None = None
    layer_type: str | None = None


@dataclass
class LayerIntermediates:
    attn_intermediates: list | None = None
    last_hidden: torch.Tensor | None = None
    cache_length: int = 0


# attend.py

def create_causal_mask(i, j, device):
    return torch.ones((i, j), device=device, dtype=torch.bool).triu(j - i + 1)


class Attend(nn.Module):
    def __init__(self, causal=False, scale=None):
        super().__init__()
        self.scale = scale
        self.causal = causal
        self.create_causal_mask = create_causal_mask

    def forward(self, q, k, v, mask=None, causal=None):
        n, heads, kv_heads, device = q.shape[-2], q.shape[1], k.shape[1], q.device

        scale = default(self.scale, q.shape[-1] ** -0.5)

        causal = default(causal, self.causal)

        if exists(mask) and mask.ndim == 2:
            mask = mask[:, None, None, :]

        # in the case of kv caching with one token (q_len == 1), just turn off causal masking

        if n == 1 and causal:
            causal = False

        sim = torch.einsum('b h i d, b h j d -> b h i j', q, k)
        sim = sim * scale

        i, j, dtype = *sim.shape[-2:], sim.dtype

        mask_value = -torch.finfo(sim.dtype).max

        attn_mask = mask

        if exists(attn_mask):
            sim = sim.masked_fill(~attn_mask, mask_value)

        if causal:
            causal_mask = self.create_causal_mask(i, j, device=device)
            sim = sim.masked_fill(causal_mask, mask_value)

        row_is_entirely_masked = None

        if exists(mask):
            row_is_entirely_masked = ~mask.any(dim=-1)

        attn = sim.softmax(dim=-1)

        out = torch.einsum('b h i j, b h j d -> b h i d', attn, v)

        if exists(row_is_entirely_masked):
            out = out.masked_fill(row_is_entirely_masked[..., None], 0.)

        return out, Intermediates()


# x_transformers.py

class TokenEmbedding(nn.Module):
    def __init__(self, dim, num_tokens):
        super().__init__()
        self.emb = nn.Embedding(num_tokens, dim)

    def forward(self, x):
        return self.emb(x.long())

    def init_(self):
        nn.init.kaiming_normal_(self.emb.weight)


class AbsolutePositionalEmbedding(nn.Module):
    def __init__(self, dim, max_seq_len):
        super().__init__()
        self.scale = dim ** -0.5
        self.max_seq_len = max_seq_len
        self.emb = nn.Embedding(max_seq_len, dim)

    def forward(self, x, pos=None, seq_start_pos=None, offset=0):
        seq_len, device = x.shape[1], x.device
        assert seq_len <= self.max_seq_len

        if not exists(pos):
            pos = arange(seq_len, device=device) + offset

        if exists(seq_start_pos):
            pos = (pos - seq_start_pos[..., None]).clamp(min=0)

        pos_emb = self.emb(pos)
        pos_emb = pos_emb * self.scale
        return pos_emb


class FeedForward(nn.Module):
    def __init__(self, dim, mult=4):
        super().__init__()
        inner_dim = int(dim * mult)
        self.ff = nn.Sequential(nn.Linear(dim, inner_dim), nn.GELU(), nn.Linear(inner_dim, dim))

    def forward(self, x):
        return self.ff(x)


class Attention(nn.Module):
    def __init__(self, dim, dim_head=8, heads=4, causal=False):
        super().__init__()
        self.scale = dim_head ** -0.5
        self.heads = heads
        self.causal = causal
        inner_dim = dim_head * heads
        self.to_q = nn.Linear(dim, inner_dim, bias=False)
        self.to_k = nn.Linear(dim, inner_dim, bias=False)
        self.to_v = nn.Linear(dim, inner_dim, bias=False)
        self.attend = Attend(causal=causal)
        self.to_out = nn.Linear(inner_dim, dim, bias=False)

    def forward(self, x, mask=None, context_mask=None, cache=None, return_intermediates=False):
        b, n, h = x.shape[0], x.shape[1], self.heads

        q = self.to_q(x)
        k = self.to_k(x)
        v = self.to_v(x)

        q, k, v = (t.reshape(b, t.shape[1], h, -1).transpose(1, 2) for t in (q, k, v))  # 'b n (h d) -> b h n d'

        # take care of caching

        if exists(cache):
            ck, cv = cache.cached_kv
            k = cat((ck, k), dim=-2)
            v = cat((cv, v), dim=-2)

        if return_intermediates:
            cached_kv = (k, v)

        input_mask = context_mask

        if not exists(input_mask):
            input_mask = mask

        # determine masking

        masks = []
        final_attn_mask = None

        if exists(input_mask):
            input_mask = input_mask[:, None, None, :]  # 'b j -> b 1 1 j'
            masks.append(~input_mask)

        if len(masks) > 0:
            final_attn_mask = ~or_reduce(masks)

        out, intermediates = self.attend(q, k, v, mask=final_attn_mask, causal=self.causal)

        out = out.transpose(1, 2).reshape(b, n, -1)  # 'b h n d -> b n (h d)'
        out = self.to_out(out)

        if not return_intermediates:
            return out

        intermediates.cached_kv = cached_kv
        return out, intermediates


class AttentionLayers(nn.Module):
    def __init__(self, dim, depth, heads=4, attn_dim_head=8, causal=False):
        super().__init__()
        self.dim = dim
        self.depth = depth
        self.causal = causal

        self.layer_types = ('a', 'f') * depth
        self.layers = nn.ModuleList([])
        for layer_type in self.layer_types:
            if layer_type == 'a':
                layer = Attention(dim, dim_head=attn_dim_head, heads=heads, causal=causal)
            else:
                layer = FeedForward(dim)
            self.layers.append(nn.ModuleList([nn.LayerNorm(dim), layer]))

        self.final_norm = nn.LayerNorm(dim)

    def forward(self, x, mask=None, self_attn_kv_mask=None, seq_start_pos=None, seq_pos_offset=None, cache=None,
                cache_age=1, return_hiddens=False):
        if not exists(seq_pos_offset):
            seq_pos_offset = cache.cache_length if exists(cache) else 0

        intermediates = []

        # handle left padded sequences

        if exists(seq_start_pos):
            seq_arange = arange(x.shape[-2] + seq_pos_offset, device=x.device, dtype=torch.long)
            left_pad_mask = seq_arange >= seq_start_pos[..., None]

            if exists(self_attn_kv_mask):
                self_attn_kv_mask = self_attn_kv_mask & left_pad_mask
            else:
                self_attn_kv_mask = left_pad_mask

        # assume cached key / values

        prev_cache_length = 0

        attn_cache = []

        if exists(cache):
            assert self.causal

            prev_cache_length = cache.cache_length

            if cache_age > 0:
                x = x[:, -cache_age:]  # for spec decoding, may be greater than 1

            attn_cache = cache.attn_intermediates

        next_cache_length = x.shape[1]

        iter_attn_cache = iter(attn_cache)

        for layer_type, (norm, block) in zip(self.layer_types, self.layers):
            residual = x
            x = norm(x)

            if layer_type == 'a':
                out, inter = block(x, mask=mask, context_mask=self_attn_kv_mask, cache=next(iter_attn_cache, None),
                                   return_intermediates=True)
            else:
                out = block(x)

            x = out + residual

            if layer_type == 'a':
                inter.layer_type = layer_type
                intermediates.append(inter)

        x = self.final_norm(x)

        if not return_hiddens:
            return x

        intermediates = LayerIntermediates(
            last_hidden=x,
            attn_intermediates=intermediates,
            cache_length=next_cache_length + prev_cache_length
        )

        return x, intermediates


class Decoder(AttentionLayers):
    def __init__(self, **kwargs):
        assert 'causal' not in kwargs, 'cannot set causality on decoder'
        super().__init__(causal=True, **kwargs)


class TransformerWrapper(nn.Module):
    def __init__(self, *, num_tokens, max_seq_len, attn_layers):
        super().__init__()
        dim = attn_layers.dim
        self.max_seq_len = max_seq_len
        self.token_emb = TokenEmbedding(dim, num_tokens)
        self.pos_emb = AbsolutePositionalEmbedding(dim, max_seq_len)
        self.attn_layers = attn_layers
        self.to_logits = nn.Linear(dim, num_tokens, bias=False)
        self.input_not_include_cache = False
        self.can_cache_kv = True
        self.can_cache_kv_outside_max_seq_len = False
        self.token_emb.init_()

    def forward(self, x, return_intermediates=False, mask=None, seq_start_pos=None, cache=None,
                input_not_include_cache=None):
        input_not_include_cache = default(input_not_include_cache, self.input_not_include_cache)

        # take care of position embedding offsets in the presence of cache and sequence is less than cache length

        seq_pos_offset = 0

        if exists(cache) and input_not_include_cache:
            seq_pos_offset = cache.cache_length

        pos_emb = self.pos_emb(x, seq_start_pos=seq_start_pos, offset=seq_pos_offset)
        x = self.token_emb(x) + pos_emb

        x, intermediates = self.attn_layers(x, mask=mask, cache=cache, return_hiddens=True,
                                            seq_start_pos=seq_start_pos, seq_pos_offset=seq_pos_offset)

        logits = self.to_logits(x)

        if return_intermediates:
            return logits, intermediates

        return logits


# autoregressive_wrapper.py

class AutoregressiveWrapper(nn.Module):
    def __init__(self, net, ignore_index=-100, pad_value=0):
        super().__init__()
        self.pad_value = pad_value
        self.ignore_index = ignore_index
        self.net = net
        self.max_seq_len = net.max_seq_len

    @torch.no_grad()
    def generate(self, prompts, seq_len, eos_token=None, temperature=1., prompt_lens=None,
                 restrict_to_max_seq_len=True, cache_kv=True, return_step_logits=False):
        max_seq_len, greedy = self.max_seq_len, temperature == 0.

        # handle prompts given as list of variable lengthed token ids

        if isinstance(prompts, list):
            assert len(prompts) > 0, 'prompts cannot be empty list'
            assert not exists(prompt_lens)

            prompt_lens = tensor([t.shape[0] for t in prompts], device=prompts[0].device)

            prompts = pad_sequence(prompts, batch_first=True)

        b, t, device = *prompts.shape, prompts.device

        # handle variable lengthed prompts (prefixes)

        seq_start_pos = None
        if exists(prompt_lens):
            prompts = align_right(prompts, prompt_lens, pad_id=self.pad_value)
            seq_start_pos = t - prompt_lens

        out = prompts

        cache = None
        step_logits = []

        for _ in range(seq_len):

            if restrict_to_max_seq_len:
                max_len_exceeded = out.shape[-1] > max_seq_len

                assert not (cache_kv and max_len_exceeded and not self.net.can_cache_kv_outside_max_seq_len)

                x = out[:, -max_seq_len:]

                if exists(cache):
                    for inter in cache.attn_intermediates:
                        if inter.layer_type == 'a':
                            inter.cached_kv = [t[..., -(max_seq_len - 1):, :] for t in inter.cached_kv]

            logits, new_cache = self.net(
                x,
                return_intermediates=True,
                cache=cache,
                seq_start_pos=seq_start_pos,
            )

            if cache_kv and self.net.can_cache_kv:
                cache = new_cache

            logits = logits[:, -1]
            step_logits.append(logits)

            if greedy:
                sample = logits.argmax(dim=-1, keepdim=True)
            else:
                probs = F.softmax(logits / temperature, dim=-1)
                sample = torch.multinomial(probs, 1)

            out = torch.cat((out, sample), dim=-1)

        out = out[:, t:]

        if return_step_logits:
            return out, torch.stack(step_logits, dim=1)
        return out


def main():
    model = TransformerWrapper(
        num_tokens=64,
        max_seq_len=16,
        attn_layers=Decoder(dim=32, depth=2, heads=4, attn_dim_head=8),
    )
    model = AutoregressiveWrapper(model).eval()

    prompts = [
        tensor([7, 21, 3, 55, 12, 40, 9]),
        tensor([33, 2]),
        tensor([18, 61, 4, 27]),
    ]
    gen_len = 6

    out, step_logits = model.generate(prompts, gen_len, temperature=0., cache_kv=True, return_step_logits=True)

    # reference: each prompt alone, no padding, no cache, no seq_start_pos
    with torch.no_grad():
        for b, p in enumerate(prompts):
            seq = p[None]
            for step in range(gen_len):
                logits = model.net(seq)[0, -1]
                torch.testing.assert_close(step_logits[b, step], logits, atol=1e-4, rtol=1e-4)
                nxt = logits.argmax()
                assert int(nxt) == int(out[b, step]), (b, step, int(nxt), out[b].tolist())
                seq = torch.cat((seq, nxt.view(1, 1)), dim=-1)
            print(f"prompt {b} (length {len(p)}): generated {out[b].tolist()} matches the lone run")

    print("ok")


if __name__ == "__main__":
    main()
