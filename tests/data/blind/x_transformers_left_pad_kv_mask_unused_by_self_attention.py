"""x-transformers: generation with variable-length prompts left-pads them, but self-attention never sees the pad mask.

Citation: lucidrains/x-transformers#187 (point 3), fixed by lucidrains/x-transformers commit cb50439
("address all issues with left padding tokens"), x_transformers/x_transformers.py.

``AutoregressiveWrapper.generate(prompts, seq_len, prompt_lens=...)`` right-aligns the prompts
(``align_right``, pads on the left) and passes ``seq_start_pos = t - prompt_lens`` on every call,
prefill and each cached decode step. ``AttentionLayers.forward`` turns ``seq_start_pos`` into a
``left_pad_mask`` and hands it to every self-attention block as ``context_mask = self_attn_kv_mask``.

The bug: ``Attention.forward`` picked its key mask with
``input_mask = context_mask if has_context else mask``; a self-attention block has no context, so it
read ``mask`` (None during generation) and the left-pad mask was dropped: the padded prompt's real
tokens, and every generated token through the KV cache, attended to the pad keys. (The left pad
mask was also built over ``x.shape[-1]``, the model width, instead of ``x.shape[-2]``, the length;
it was never read, so nothing failed.)

The fix: ``input_mask = context_mask`` and fall back to ``mask`` only when there is no context mask
and no context; ``seq_arange`` over ``x.shape[-2]``.

This program keeps the library's layout (TransformerWrapper -> Decoder(AttentionLayers) with
pre-norm attention / feedforward blocks, Attention with a cached_kv in its Intermediates, Attend's
einsum path with its causal triangle ``triu(j - i + 1)``, absolute positional embedding shifted by
``seq_start_pos``, AutoregressiveWrapper.generate with align_right and a KV cache) at toy sizes
with random weights, einops calls written out with torch ops.
"""

import sys
from dataclasses import dataclass
from math import ceil
from typing import List, Optional

import torch
import torch.nn.functional as F
from torch import nn, einsum

FIXED = "--fixed" in sys.argv

DEFAULT_DIM_HEAD = 64


def exists(val):
    return val is not None


def default(val, d):
    if exists(val):
        return val
    return d() if callable(d) else d


def max_neg_value(tensor):
    return -torch.finfo(tensor.dtype).max


def or_reduce(masks):
    head, *body = masks
    for rest in body:
        head = head | rest
    return head


# attend.py


@dataclass
class Intermediates:
    qk_similarities: Optional[torch.Tensor] = None
    pre_softmax_attn: Optional[torch.Tensor] = None
    post_softmax_attn: Optional[torch.Tensor] = None
    cached_kv: Optional[tuple] = None


def create_causal_mask(i, j, device):
    return torch.ones((i, j), device=device, dtype=torch.bool).triu(j - i + 1)


class Attend(nn.Module):
    def __init__(self, *, dropout=0.0, causal=False, heads=None, scale=None):
        super().__init__()
        self.scale = scale
        self.causal = causal
        self.create_causal_mask = create_causal_mask
        self.attn_fn = lambda t, dim: F.softmax(t, dim=dim, dtype=torch.float32)
        self.attn_dropout = nn.Dropout(dropout)

    def forward(self, q, k, v, mask=None, attn_bias=None, prev_attn=None):
        n, heads, kv_heads, device = q.shape[-2], q.shape[1], k.shape[1], q.device

        scale = default(self.scale, q.shape[-1] ** -0.5)

        kv_einsum_eq = "b j d" if k.ndim == 3 else "b h j d"

        dots = einsum(f"b h i d, {kv_einsum_eq} -> b h i j", q, k) * scale

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
            causal_mask = self.create_causal_mask(i, j, device=device)
            dots = dots.masked_fill(causal_mask, mask_value)

        pre_softmax_attn = dots.clone()

        attn = self.attn_fn(dots, dim=-1)
        attn = attn.type(dtype)

        post_softmax_attn = attn.clone()

        attn = self.attn_dropout(attn)

        out = einsum(f"b h i j, {kv_einsum_eq} -> b h i d", attn, v)

        intermediates = Intermediates(
            qk_similarities=qk_similarities,
            pre_softmax_attn=pre_softmax_attn,
            post_softmax_attn=post_softmax_attn,
        )

        return out, intermediates


# x_transformers.py


@dataclass
class LayerIntermediates:
    hiddens: Optional[List[torch.Tensor]] = None
    attn_intermediates: Optional[List[Intermediates]] = None
    layer_hiddens: Optional[List[torch.Tensor]] = None


class TokenEmbedding(nn.Module):
    def __init__(self, dim, num_tokens):
        super().__init__()
        self.emb = nn.Embedding(num_tokens, dim)

    def forward(self, x):
        return self.emb(x.long())


class AbsolutePositionalEmbedding(nn.Module):
    def __init__(self, dim, max_seq_len):
        super().__init__()
        self.scale = dim ** -0.5
        self.max_seq_len = max_seq_len
        self.emb = nn.Embedding(max_seq_len, dim)

    def forward(self, x, pos=None, offset=None):
        seq_len, device = x.shape[1], x.device
        assert seq_len <= self.max_seq_len

        if not exists(pos):
            pos = torch.arange(seq_len, device=device)

        if exists(offset):
            pos = (pos + offset[..., None]).clamp(min=0)

        pos_emb = self.emb(pos)
        pos_emb = pos_emb * self.scale
        return pos_emb


class Residual(nn.Module):
    def __init__(self, dim, scale_residual=False, scale_residual_constant=1.0):
        super().__init__()
        self.residual_scale = None
        self.scale_residual_constant = scale_residual_constant

    def forward(self, x, residual):
        return x + residual


class FeedForward(nn.Module):
    def __init__(self, dim, dim_out=None, mult=4, dropout=0.0):
        super().__init__()
        inner_dim = int(dim * mult)
        dim_out = default(dim_out, dim)
        self.ff = nn.Sequential(
            nn.Sequential(nn.Linear(dim, inner_dim), nn.GELU()),
            nn.Dropout(dropout),
            nn.Linear(inner_dim, dim_out),
        )

    def forward(self, x):
        return self.ff(x)


class Attention(nn.Module):
    def __init__(self, dim, dim_head=DEFAULT_DIM_HEAD, heads=8, causal=False, dropout=0.0):
        super().__init__()
        self.scale = dim_head ** -0.5
        self.heads = heads
        self.kv_heads = heads
        self.causal = causal

        q_dim = k_dim = v_dim = out_dim = dim_head * heads

        self.to_q = nn.Linear(dim, q_dim, bias=False)
        self.to_k = nn.Linear(dim, k_dim, bias=False)
        self.to_v = nn.Linear(dim, v_dim, bias=False)

        self.attend = Attend(heads=heads, causal=causal, dropout=dropout, scale=self.scale)

        self.to_out = nn.Linear(out_dim, dim, bias=False)

    def forward(
        self,
        x,
        context=None,
        mask=None,
        context_mask=None,
        attn_mask=None,
        rel_pos=None,
        rotary_pos_emb=None,
        prev_attn=None,
        mem=None,
        return_intermediates=False,
        cache: Optional[Intermediates] = None,
    ):
        b, n, _ = x.shape
        h, kv_h, device, has_context = self.heads, self.kv_heads, x.device, exists(context)
        kv_input = default(context, x)

        q = self.to_q(x)
        k = self.to_k(kv_input)
        v = self.to_v(kv_input)

        # rearrange(t, 'b n (h d) -> b h n d')
        q = q.view(b, q.shape[1], h, -1).transpose(1, 2)
        k = k.view(b, k.shape[1], kv_h, -1).transpose(1, 2)
        v = v.view(b, v.shape[1], kv_h, -1).transpose(1, 2)

        if exists(cache) and not has_context:
            ck, cv = cache.cached_kv
            k = torch.cat((ck, k), dim=-2)
            v = torch.cat((cv, v), dim=-2)

        if return_intermediates:
            cached_kv = (k, v)

        if FIXED:
            input_mask = context_mask

            if not exists(input_mask) and not has_context:
                input_mask = mask
        else:
            input_mask = context_mask if has_context else mask

        i, j = map(lambda t: t.shape[-2], (q, k))

        # determine masking

        masks = []
        final_attn_mask = None

        if exists(input_mask):
            input_mask = input_mask[:, None, None, :]  # 'b j -> b 1 1 j'
            masks.append(~input_mask)

        if exists(attn_mask):
            if attn_mask.ndim == 2:
                attn_mask = attn_mask[None, None]
            elif attn_mask.ndim == 3:
                attn_mask = attn_mask[None]
            masks.append(~attn_mask)

        if len(masks) > 0:
            final_attn_mask = ~or_reduce(masks)

        attn_bias = None
        if exists(rel_pos):
            attn_bias = rel_pos(i, j)

        out, intermediates = self.attend(q, k, v, mask=final_attn_mask, attn_bias=attn_bias, prev_attn=prev_attn)

        # rearrange(out, 'b h n d -> b n (h d)')
        out = out.transpose(1, 2).reshape(b, out.shape[2], -1)

        out = self.to_out(out)

        if exists(mask):
            out = out.masked_fill(~mask[..., None], 0.0)

        if not return_intermediates:
            return out

        intermediates.cached_kv = cached_kv

        return out, intermediates


class AttentionLayers(nn.Module):
    def __init__(self, dim, depth, heads=8, causal=False, cross_attend=False, attn_dim_head=DEFAULT_DIM_HEAD):
        super().__init__()
        self.dim = dim
        self.depth = depth
        self.causal = causal
        self.cross_attend = cross_attend
        self.layers = nn.ModuleList([])
        self.rel_pos = None
        self.rotary_pos_emb = None
        self.residual_attn = False

        default_block = ("a", "f")
        self.layer_types = default_block * depth
        self.num_attn_layers = len(list(filter(lambda t: t == "a", self.layer_types)))

        for layer_type in self.layer_types:
            if layer_type == "a":
                layer = Attention(dim, heads=heads, causal=causal, dim_head=attn_dim_head)
            elif layer_type == "f":
                layer = FeedForward(dim)

            residual = Residual(dim)
            pre_branch_norm = nn.LayerNorm(dim)
            norms = nn.ModuleList([pre_branch_norm, None, None])

            self.layers.append(nn.ModuleList([norms, layer, residual]))

        self.final_norm = nn.LayerNorm(dim)

    def forward(
        self,
        x,
        context=None,
        mask=None,
        context_mask=None,
        attn_mask=None,
        self_attn_kv_mask=None,
        mems=None,
        seq_start_pos: Optional[torch.Tensor] = None,
        cache: Optional[LayerIntermediates] = None,
        cache_age=1,
        return_hiddens=False,
    ):
        hiddens = []
        intermediates = []

        prev_attn = None

        mems = mems.copy() if exists(mems) else [None] * self.num_attn_layers

        # handle left padded sequences

        if exists(seq_start_pos):
            seq_len_dim = -2 if FIXED else -1
            seq_arange = torch.arange(x.shape[seq_len_dim], device=x.device, dtype=torch.long)
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
                x = x[:, -cache_age:]  # for spec decoding, may be greater than 1

            attn_cache = cache.attn_intermediates

        iter_attn_cache = iter(attn_cache)

        for ind, (layer_type, (norm, block, residual_fn)) in enumerate(zip(self.layer_types, self.layers)):
            if layer_type == "a":
                if return_hiddens:
                    hiddens.append(x)
                layer_mem = mems.pop(0) if mems else None

            inner_residual = x

            pre_norm, post_branch_norm, post_main_norm = norm

            if exists(pre_norm):
                x = pre_norm(x)

            if layer_type == "a":
                out, inter = block(
                    x,
                    mask=mask,
                    context_mask=self_attn_kv_mask,
                    attn_mask=attn_mask,
                    rel_pos=self.rel_pos,
                    rotary_pos_emb=rotary_pos_emb,
                    prev_attn=prev_attn,
                    cache=next(iter_attn_cache, None),
                    mem=layer_mem,
                    return_intermediates=True,
                )
            elif layer_type == "f":
                out = block(x)

            x = residual_fn(out, inner_residual)

            if layer_type == "a" and return_hiddens:
                intermediates.append(inter)

        x = self.final_norm(x)

        if not return_hiddens:
            return x

        intermediates = LayerIntermediates(hiddens=hiddens, attn_intermediates=intermediates)

        return x, intermediates


class Decoder(AttentionLayers):
    def __init__(self, **kwargs):
        assert "causal" not in kwargs, "cannot set causality on decoder"
        super().__init__(causal=True, **kwargs)


class TransformerWrapper(nn.Module):
    def __init__(self, *, num_tokens, max_seq_len, attn_layers):
        super().__init__()
        dim = attn_layers.dim
        self.max_seq_len = max_seq_len
        self.num_memory_tokens = 0
        self.token_emb = TokenEmbedding(dim, num_tokens)
        self.pos_emb = AbsolutePositionalEmbedding(dim, max_seq_len)
        self.post_emb_norm = nn.Identity()
        self.emb_dropout = nn.Dropout(0.0)
        self.project_emb = nn.Identity()
        self.attn_layers = attn_layers
        self.to_logits = nn.Linear(dim, num_tokens, bias=False)

    def forward(
        self,
        x,
        return_intermediates=False,
        mask=None,
        pos=None,
        seq_start_pos=None,
        cache: Optional[LayerIntermediates] = None,
        **kwargs,
    ):
        b, n, device = *x.shape, x.device

        external_pos_emb = exists(pos) and pos.dtype != torch.long
        pos_emb = self.pos_emb(x, pos=pos, offset=-seq_start_pos) if not external_pos_emb else pos
        x = self.token_emb(x) + pos_emb

        x = self.post_emb_norm(x)
        x = self.emb_dropout(x)
        x = self.project_emb(x)

        x, intermediates = self.attn_layers(
            x, mask=mask, cache=cache, return_hiddens=True, seq_start_pos=seq_start_pos, **kwargs
        )

        out = self.to_logits(x)

        if return_intermediates:
            return out, intermediates

        return out


# autoregressive_wrapper.py


def align_right(t, lens, pad_id=0):
    batch, seq_len, device, dtype = *t.shape, t.device, t.dtype

    assert lens.ndim == 1 and lens.shape[0] == batch
    assert lens.amax() <= seq_len

    pad_lens = seq_len - lens
    max_pad_len = pad_lens.amax()

    batch_arange = torch.arange(batch, device=device, dtype=torch.long)[..., None]
    prompt_len_arange = torch.arange(seq_len, device=device, dtype=torch.long)

    t = F.pad(t, (max_pad_len, 0), value=0)
    offset = max_pad_len - pad_lens

    aligned = t[batch_arange, prompt_len_arange + offset[..., None]]
    return aligned


def top_k(logits, frac_num_tokens=0.1, k=None):
    num_tokens = logits.shape[-1]

    k = default(k, ceil(frac_num_tokens * num_tokens))
    k = min(k, num_tokens)

    val, ind = torch.topk(logits, k)
    probs = torch.full_like(logits, float("-inf"))
    probs.scatter_(1, ind, val)
    return probs


class AutoregressiveWrapper(nn.Module):
    def __init__(self, net, ignore_index=-100, pad_value=0):
        super().__init__()
        self.pad_value = pad_value
        self.ignore_index = ignore_index
        self.net = net
        self.max_seq_len = net.max_seq_len

    @torch.no_grad()
    def generate(
        self,
        prompts,
        seq_len,
        eos_token=None,
        temperature=1.0,
        prompt_lens: Optional[torch.Tensor] = None,
        filter_logits_fn=top_k,
        restrict_to_max_seq_len=True,
        filter_kwargs: dict = dict(),
        **kwargs,
    ):
        max_seq_len, device = self.max_seq_len, prompts.device

        b, t = prompts.shape

        # handle variable lengthed prompts (prefixes)

        seq_start_pos = None
        if exists(prompt_lens):
            prompts = align_right(prompts, prompt_lens, pad_id=self.pad_value)
            seq_start_pos = t - prompt_lens

        out = prompts

        cache = None

        first_logits = None

        for _ in range(seq_len):
            if restrict_to_max_seq_len:
                x = out[:, -max_seq_len:]

                if exists(cache):
                    for inter in cache.attn_intermediates:
                        inter.cached_kv = [t[..., -(max_seq_len - 1):, :] for t in inter.cached_kv]

            logits, cache = self.net(x, return_intermediates=True, cache=cache, seq_start_pos=seq_start_pos, **kwargs)

            logits = logits[:, -1]

            if first_logits is None:
                first_logits = logits.clone()

            filtered_logits = filter_logits_fn(logits, **filter_kwargs)

            probs = F.softmax(filtered_logits / temperature, dim=-1)

            sample = torch.multinomial(probs, 1)

            out = torch.cat((out, sample), dim=-1)

        out = out[:, t:]

        return out, first_logits


def main():
    torch.manual_seed(0)

    model = TransformerWrapper(
        num_tokens=64,
        max_seq_len=32,
        attn_layers=Decoder(dim=32, depth=2, heads=4, attn_dim_head=8),
    )
    wrapper = AutoregressiveWrapper(model, pad_value=0)
    wrapper.eval()

    # two prompts of different lengths, written left-aligned (the short one trailing pad_value 0)
    prompts = torch.tensor(
        [
            [5, 17, 33, 8, 41, 22, 9, 50],
            [12, 7, 44, 30, 0, 0, 0, 0],
        ]
    )
    prompt_lens = torch.tensor([8, 4])

    torch.manual_seed(1234)
    generated, first_logits = wrapper.generate(prompts, 6, prompt_lens=prompt_lens, filter_kwargs=dict(k=4))

    print("generated:", generated.tolist())
    print("first-step logits of the short prompt:", [round(v, 4) for v in first_logits[1, :6].tolist()])


if __name__ == "__main__":
    main()
