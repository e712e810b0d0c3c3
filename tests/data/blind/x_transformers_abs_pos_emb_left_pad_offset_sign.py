"""x-transformers: left-padded prompts get their absolute positions shifted the wrong way.

Citation: lucidrains/x-transformers commit 013e60a ("fix issue with abs pos offset with left padding
tokens", 1.22.15 -> 1.22.16), x_transformers/x_transformers.py (TransformerWrapper.forward,
AbsolutePositionalEmbedding.forward); the same lines are renamed to ``seq_start_pos`` in cb50439.

``AutoregressiveWrapper.generate(prompts, seq_len, prompt_lens=...)`` right-aligns the prompts with
``align_right`` (pads on the left) and passes ``seq_start_pos = t - prompt_lens`` (the number of pad
tokens in each row) to every forward, prefill and each cached decode step.
``TransformerWrapper.forward`` hands it to the absolute positional embedding as its offset.

The bug: ``self.pos_emb(x, pos = pos, offset = seq_start_pos)`` and ``pos = pos + offset[..., None]``:
a row with s pad tokens numbers its first real token at 2s instead of 0, every real token and every
generated token s + s places too far, so the same prompt gets other positions (and another
continuation) depending on how long its batch neighbours are.

The fix: ``offset = -seq_start_pos`` and ``pos = (pos + offset[..., None]).clamp(min = 0)``: the real
tokens of every row start at position 0 (the pad slots clamp to 0 and stay masked).

Ported at toy sizes with random weights: TransformerWrapper -> Decoder(AttentionLayers) with pre-norm
attention / feedforward blocks, Attention with its cached_kv, Attend's einsum path with its causal
triangle ``triu(j - i + 1)``, AutoregressiveWrapper.generate with align_right, a KV cache and top_k
filtering (k = 1). The self-attention key mask built from ``seq_start_pos`` is read as x-transformers
reads it from cb50439 on (``input_mask = context_mask``, arange over ``x.shape[-2]``), so the two runs
differ only in the positions. einops calls are written out with torch ops.
"""

import sys
from dataclasses import dataclass
from math import ceil
from typing import Optional, Tuple, List

import torch
from torch import nn, Tensor
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


def exists(val):
    return val is not None


def default(val, d):
    return val if exists(val) else d


# attend.py

@dataclass
class Intermediates:
    qk_similarities: Optional[Tensor] = None
    pre_softmax_attn: Optional[Tensor] = None
    post_softmax_attn: Optional[Tensor] = None
    cached_kv: Optional[Tuple[Tensor, Tensor]] = None


def create_causal_mask(i, j, device):
    return torch.ones((i, j), device = device, dtype = torch.bool).triu(j - i + 1)


class Attend(nn.Module):
    def __init__(self, *, causal = False, scale = None):
        super().__init__()
        self.scale = scale
        self.causal = causal
        self.create_causal_mask = create_causal_mask
        self.attn_fn = partial_softmax

    def forward(self, q, k, v, mask = None, attn_bias = None, prev_attn = None):
        n, heads, kv_heads, device = q.shape[-2], q.shape[1], k.shape[1], q.device
        scale = default(self.scale, q.shape[-1] ** -0.5)

        dots = torch.einsum('b h i d, b h j d -> b h i j', q, k) * scale

        if exists(prev_attn):
            dots = dots + prev_attn

        qk_similarities = dots.clone()

        if exists(attn_bias):
            dots = dots + attn_bias

        i, j, dtype = *dots.shape[-2:], dots.dtype
        mask_value = -torch.finfo(dots.dtype).max

        if exists(mask):
            dots = dots.masked_fill(~mask, mask_value)

        if self.causal:
            causal_mask = self.create_causal_mask(i, j, device = device)
            dots = dots.masked_fill(causal_mask, mask_value)

        pre_softmax_attn = dots.clone()
        attn = self.attn_fn(dots, dim = -1)
        attn = attn.type(dtype)
        post_softmax_attn = attn.clone()

        out = torch.einsum('b h i j, b h j d -> b h i d', attn, v)
        return out, Intermediates(qk_similarities = qk_similarities, pre_softmax_attn = pre_softmax_attn, post_softmax_attn = post_softmax_attn)


def partial_softmax(t, dim = -1):
    return F.softmax(t, dim = dim, dtype = torch.float32)


# x_transformers.py

@dataclass
class LayerIntermediates:
    hiddens: Optional[List[Tensor]] = None
    attn_intermediates: Optional[List[Intermediates]] = None
    layer_hiddens: Optional[List[Tensor]] = None


def or_reduce(masks):
    head, *body = masks
    for rest in body:
        head = head | rest
    return head


class TokenEmbedding(nn.Module):
    def __init__(self, dim, num_tokens):
        super().__init__()
        self.emb = nn.Embedding(num_tokens, dim)

    def forward(self, x):
        return self.emb(x)


class AbsolutePositionalEmbedding(nn.Module):
    def __init__(self, dim, max_seq_len):
        super().__init__()
        self.scale = dim ** -0.5
        self.max_seq_len = max_seq_len
        self.emb = nn.Embedding(max_seq_len, dim)

    def forward(self, x, pos = None, offset = None):
        seq_len, device = x.shape[1], x.device
        assert seq_len <= self.max_seq_len, f'you are passing in a sequence length of {seq_len} but your absolute positional embedding has a max sequence length of {self.max_seq_len}'

        if not exists(pos):
            pos = torch.arange(seq_len, device = device)

        if exists(offset):
            if FIXED:
                pos = (pos + offset[..., None]).clamp(min = 0)
            else:
                pos = pos + offset[..., None]

        pos_emb = self.emb(pos)
        pos_emb = pos_emb * self.scale
        return pos_emb


class Residual(nn.Module):
    def forward(self, x, residual):
        return x + residual


class FeedForward(nn.Module):
    def __init__(self, dim, mult = 4):
        super().__init__()
        inner_dim = int(dim * mult)
        self.ff = nn.Sequential(nn.Linear(dim, inner_dim), nn.GELU(), nn.Linear(inner_dim, dim))

    def forward(self, x):
        return self.ff(x)


class Attention(nn.Module):
    def __init__(self, dim, dim_head = 16, heads = 2, causal = False):
        super().__init__()
        self.scale = dim_head ** -0.5
        self.heads = heads
        self.kv_heads = heads
        self.causal = causal

        self.to_q = nn.Linear(dim, dim_head * heads, bias = False)
        self.to_k = nn.Linear(dim, dim_head * heads, bias = False)
        self.to_v = nn.Linear(dim, dim_head * heads, bias = False)

        self.attend = Attend(causal = causal, scale = self.scale)
        self.to_out = nn.Linear(dim_head * heads, dim, bias = False)

    def forward(self, x, context = None, mask = None, context_mask = None, attn_mask = None, rel_pos = None,
                rotary_pos_emb = None, prev_attn = None, mem = None, return_intermediates = False,
                cache: Optional[Intermediates] = None):
        b, n, _, h, kv_h, device, has_context = *x.shape, self.heads, self.kv_heads, x.device, exists(context)
        kv_input = default(context, x)

        q = self.to_q(x)
        k = self.to_k(kv_input)
        v = self.to_v(kv_input)

        # rearrange 'b n (h d) -> b h n d'
        q = q.view(b, n, h, -1).transpose(1, 2)
        k, v = map(lambda t: t.view(b, t.shape[1], kv_h, -1).transpose(1, 2), (k, v))

        if exists(cache) and not has_context:
            ck, cv = cache.cached_kv
            k = torch.cat((ck, k), dim = -2)
            v = torch.cat((cv, v), dim = -2)

        if return_intermediates:
            cached_kv = (k, v)

        input_mask = context_mask

        if not exists(input_mask) and not has_context:
            input_mask = mask

        i, j = map(lambda t: t.shape[-2], (q, k))

        masks = []
        final_attn_mask = None

        if exists(input_mask):
            input_mask = input_mask[:, None, None, :]   # 'b j -> b 1 1 j'
            masks.append(~input_mask)

        if exists(attn_mask):
            masks.append(~attn_mask)

        if len(masks) > 0:
            final_attn_mask = ~or_reduce(masks)

        out, intermediates = self.attend(q, k, v, mask = final_attn_mask, attn_bias = None, prev_attn = prev_attn)

        out = out.transpose(1, 2).reshape(b, n, -1)   # 'b h n d -> b n (h d)'
        out = self.to_out(out)

        if exists(mask):
            out = out.masked_fill(~mask[..., None], 0.)

        if not return_intermediates:
            return out

        intermediates.cached_kv = cached_kv
        return out, intermediates


class AttentionLayers(nn.Module):
    def __init__(self, dim, depth, heads = 2, causal = False):
        super().__init__()
        self.dim = dim
        self.depth = depth
        self.causal = causal
        self.has_pos_emb = False
        self.layers = nn.ModuleList([])
        self.layer_types = ('a', 'f') * depth
        self.num_attn_layers = depth

        for layer_type in self.layer_types:
            if layer_type == 'a':
                layer = Attention(dim, heads = heads, causal = causal)
            else:
                layer = FeedForward(dim)
            norms = nn.ModuleList([nn.LayerNorm(dim), None, None])
            self.layers.append(nn.ModuleList([norms, layer, Residual()]))

        self.final_norm = nn.LayerNorm(dim)

    def forward(self, x, context = None, mask = None, context_mask = None, attn_mask = None, self_attn_kv_mask = None,
                mems = None, seq_start_pos: Optional[Tensor] = None, cache: Optional[LayerIntermediates] = None,
                cache_age = 1, return_hiddens = False):
        hiddens = []
        intermediates = []
        prev_attn = None

        # handle left padded sequences

        if exists(seq_start_pos):
            seq_arange = torch.arange(x.shape[-2], device = x.device, dtype = torch.long)
            left_pad_mask = seq_arange >= seq_start_pos[..., None]

            if exists(self_attn_kv_mask):
                self_attn_kv_mask = self_attn_kv_mask & left_pad_mask
            else:
                self_attn_kv_mask = left_pad_mask

        rotary_pos_emb = None

        # assume cached key / values

        attn_cache = []

        if exists(cache):
            assert not self.training and self.causal and not any([*map(exists, (mask, attn_mask))])

            if cache_age > 0:
                x = x[:, -cache_age:]

            attn_cache = cache.attn_intermediates

        iter_attn_cache = iter(attn_cache)

        for layer_type, (norm, block, residual_fn) in zip(self.layer_types, self.layers):
            if layer_type == 'a' and return_hiddens:
                hiddens.append(x)

            inner_residual = x
            pre_norm, post_branch_norm, post_main_norm = norm
            x = pre_norm(x)

            if layer_type == 'a':
                out, inter = block(x, mask = mask, context_mask = self_attn_kv_mask, attn_mask = attn_mask, rel_pos = None, rotary_pos_emb = rotary_pos_emb, prev_attn = prev_attn, cache = next(iter_attn_cache, None), mem = None, return_intermediates = True)
            else:
                out = block(x)

            x = residual_fn(out, inner_residual)

            if layer_type == 'a' and return_hiddens:
                intermediates.append(inter)

        x = self.final_norm(x)

        if not return_hiddens:
            return x

        return x, LayerIntermediates(hiddens = hiddens, attn_intermediates = intermediates)


class Decoder(AttentionLayers):
    def __init__(self, **kwargs):
        super().__init__(causal = True, **kwargs)


class TransformerWrapper(nn.Module):
    def __init__(self, *, num_tokens, max_seq_len, attn_layers, use_abs_pos_emb = True):
        super().__init__()
        dim = attn_layers.dim
        self.num_tokens = num_tokens
        self.max_seq_len = max_seq_len
        self.token_emb = TokenEmbedding(dim, num_tokens)

        if not (use_abs_pos_emb and not attn_layers.has_pos_emb):
            self.pos_emb = lambda *args, **kwargs: 0
        else:
            self.pos_emb = AbsolutePositionalEmbedding(dim, max_seq_len)

        self.attn_layers = attn_layers
        nn.init.kaiming_normal_(self.token_emb.emb.weight)
        self.to_logits = nn.Linear(dim, num_tokens)

    def forward(self, x, return_intermediates = False, mask = None, pos = None, seq_start_pos = None,
                cache: Optional[LayerIntermediates] = None, **kwargs):
        # absolute positional embedding

        external_pos_emb = exists(pos) and pos.dtype != torch.long
        if FIXED:
            pos_emb = self.pos_emb(x, pos = pos, offset = -seq_start_pos) if not external_pos_emb else pos
        else:
            pos_emb = self.pos_emb(x, pos = pos, offset = seq_start_pos) if not external_pos_emb else pos
        x = self.token_emb(x) + pos_emb

        x, intermediates = self.attn_layers(x, mask = mask, cache = cache, return_hiddens = True, seq_start_pos = seq_start_pos, **kwargs)

        out = self.to_logits(x)

        if return_intermediates:
            return out, intermediates

        return out


# autoregressive_wrapper.py

def align_right(t, lens, pad_id = 0):
    batch, seq_len, device, dtype = *t.shape, t.device, t.dtype

    assert lens.ndim == 1 and lens.shape[0] == batch
    assert lens.amax() <= seq_len

    pad_lens = seq_len - lens
    max_pad_len = pad_lens.amax()

    batch_arange = torch.arange(batch, device = device, dtype = torch.long)[..., None]
    prompt_len_arange = torch.arange(seq_len, device = device, dtype = torch.long)

    t = F.pad(t, (max_pad_len, 0), value = 0)
    offset = max_pad_len - pad_lens

    aligned = t[batch_arange, prompt_len_arange + offset[..., None]]
    return aligned


def top_k(logits, frac_num_tokens = 0.1, k = None):
    num_tokens = logits.shape[-1]

    k = default(k, ceil(frac_num_tokens * num_tokens))
    k = min(k, num_tokens)

    val, ind = torch.topk(logits, k)
    probs = torch.full_like(logits, float('-inf'))
    probs.scatter_(1, ind, val)
    return probs


class AutoregressiveWrapper(nn.Module):
    def __init__(self, net, ignore_index = -100, pad_value = 0):
        super().__init__()
        self.pad_value = pad_value
        self.ignore_index = ignore_index
        self.net = net
        self.max_seq_len = net.max_seq_len

    @torch.no_grad()
    def generate(self, prompts, seq_len, eos_token = None, temperature = 1., prompt_lens: Optional[Tensor] = None,
                 filter_logits_fn = top_k, restrict_to_max_seq_len = True, filter_kwargs: dict = dict(), **kwargs):
        was_training = self.training
        self.eval()

        max_seq_len, device = self.max_seq_len, prompts.device

        b, t = prompts.shape

        # handle variable lengthed prompts (prefixes)

        seq_start_pos = None
        if exists(prompt_lens):
            prompts = align_right(prompts, prompt_lens, pad_id = self.pad_value)
            seq_start_pos = t - prompt_lens

        out = prompts
        cache = None

        for _ in range(seq_len):

            if restrict_to_max_seq_len:
                x = out[:, -max_seq_len:]

                if exists(cache):
                    for inter in cache.attn_intermediates:
                        inter.cached_kv = [t[..., -(max_seq_len - 1):, :] for t in inter.cached_kv]

            logits, cache = self.net(
                x,
                return_intermediates = True,
                cache = cache,
                seq_start_pos = seq_start_pos,
                **kwargs
            )

            logits = logits[:, -1]

            filtered_logits = filter_logits_fn(logits, **filter_kwargs)

            probs = F.softmax(filtered_logits / temperature, dim = -1)

            sample = torch.multinomial(probs, 1)

            out = torch.cat((out, sample), dim = -1)

        out = out[:, t:]

        self.train(was_training)
        return out, logits


def main():
    torch.manual_seed(0)

    model = TransformerWrapper(
        num_tokens = 32,
        max_seq_len = 64,
        attn_layers = Decoder(dim = 32, depth = 2, heads = 2)
    )
    model = AutoregressiveWrapper(model)

    # three prompts of different lengths, written left-aligned with trailing zeros as the caller hands them
    prompts = torch.tensor([
        [5, 9, 3, 17, 11, 2, 8, 21],
        [7, 14, 6, 0, 0, 0, 0, 0],
        [12, 4, 19, 25, 3, 0, 0, 0],
    ])
    prompt_lens = torch.tensor([8, 3, 5])

    generated, last_logits = model.generate(prompts, 6, prompt_lens = prompt_lens, filter_kwargs = dict(k = 1))

    for row, lens in zip(generated.tolist(), prompt_lens.tolist()):
        print(f'prompt length {lens}: generated {row}')
    print('last-step logits, first 4 per row:')
    print(last_logits[:, :4])


if __name__ == '__main__':
    main()
