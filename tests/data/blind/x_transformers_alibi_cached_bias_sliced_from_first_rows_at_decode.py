# lucidrains/x-transformers commit cb50439 (issue lucidrains/x-transformers#187, left padding / kv cache fixes).
# AlibiPositionalBias kept the last bias it built in a buffer and, when the buffer was big enough, returned
# self.bias[..., :i, :j]: during kv-cached decoding (i = 1 query, j keys) after a longer forward, that is the row of
# query position 0, so the new token got the ALiBi distances of the first position (nearest keys penalised most).
# The fix slices the last rows and columns, self.bias[..., -i:, -j:].
import sys
import math
from functools import partial
from collections import namedtuple
from dataclasses import dataclass
from typing import List, Optional

import torch
from torch import nn, einsum, Tensor
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv

# helpers

def exists(val):
    return val is not None

def default(val, d):
    if exists(val):
        return val
    return d() if callable(d) else d

class always():
    def __init__(self, val):
        self.val = val
    def __call__(self, *args, **kwargs):
        return self.val

def pad_at_dim(t, pad, dim = -1, value = 0.):
    dims_from_right = (- dim - 1) if dim < 0 else (t.ndim - dim - 1)
    zeros = ((0, 0) * dims_from_right)
    return F.pad(t, (*zeros, *pad), value = value)

# attend.py

@dataclass
class Intermediates:
    qk_similarities: Optional[Tensor] = None
    pre_softmax_attn: Optional[Tensor] = None
    post_softmax_attn: Optional[Tensor] = None
    cached_kv: Optional[List[Tensor]] = None

def create_causal_mask(i, j, device):
    return torch.ones((i, j), device = device, dtype = torch.bool).triu(j - i + 1)

class Attend(nn.Module):
    def __init__(self, *, dropout = 0., causal = False, heads = None, scale = None):
        super().__init__()
        self.scale = scale
        self.causal = causal
        self.create_causal_mask = create_causal_mask
        self.attn_fn = partial(F.softmax, dtype = torch.float32)
        self.dropout = dropout
        self.attn_dropout = nn.Dropout(dropout)

    def forward(self, q, k, v, mask = None, attn_bias = None, prev_attn = None):
        n, heads, kv_heads, device = q.shape[-2], q.shape[1], k.shape[1], q.device

        scale = default(self.scale, q.shape[-1] ** -0.5)

        dots = einsum('b h i d, b h j d -> b h i j', q, k) * scale

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

        attn = self.attn_dropout(attn)

        out = einsum('b h i j, b h j d -> b h i d', attn, v)

        intermediates = Intermediates(
            qk_similarities = qk_similarities,
            pre_softmax_attn = pre_softmax_attn,
            post_softmax_attn = post_softmax_attn
        )

        return out, intermediates

# x_transformers.py

LayerIntermediates = namedtuple('LayerIntermediates', ['hiddens', 'attn_intermediates'])

class AlibiPositionalBias(nn.Module):
    def __init__(self, heads, total_heads, **kwargs):
        super().__init__()
        self.heads = heads
        self.total_heads = total_heads

        slopes = Tensor(self._get_slopes(heads))
        slopes = slopes[:, None, None]
        self.register_buffer('slopes', slopes, persistent = False)
        self.register_buffer('bias', None, persistent = False)

    def get_bias(self, i, j, device):
        i_arange = torch.arange(j - i, j, device = device)
        j_arange = torch.arange(j, device = device)
        bias = -torch.abs(j_arange[None, None, :] - i_arange[None, :, None])
        return bias

    @staticmethod
    def _get_slopes(heads):
        def get_slopes_power_of_2(n):
            start = (2**(-2**-(math.log2(n)-3)))
            ratio = start
            return [start*ratio**i for i in range(n)]

        if math.log2(heads).is_integer():
            return get_slopes_power_of_2(heads)

        closest_power_of_2 = 2 ** math.floor(math.log2(heads))
        return get_slopes_power_of_2(closest_power_of_2) + get_slopes_power_of_2(2 * closest_power_of_2)[0::2][:heads-closest_power_of_2]

    @property
    def device(self):
        return next(self.buffers()).device

    def forward(self, i, j):
        h, device = self.total_heads, self.device

        if exists(self.bias) and self.bias.shape[-1] >= j and self.bias.shape[-2] >= i:
            if FIXED:
                return self.bias[..., -i:, -j:]
            return self.bias[..., :i, :j]

        bias = self.get_bias(i, j, device)
        bias = bias * self.slopes

        num_heads_unalibied = h - bias.shape[0]
        bias = pad_at_dim(bias, (0, num_heads_unalibied), dim = 0)
        self.register_buffer('bias', bias, persistent = False)

        return self.bias

class FeedForward(nn.Module):
    def __init__(self, dim, mult = 4, dropout = 0.):
        super().__init__()
        inner_dim = int(dim * mult)
        self.ff = nn.Sequential(
            nn.Linear(dim, inner_dim),
            nn.GELU(),
            nn.Dropout(dropout),
            nn.Linear(inner_dim, dim)
        )

    def forward(self, x):
        return self.ff(x)

class Attention(nn.Module):
    def __init__(self, dim, dim_head = 64, heads = 8, causal = False, dropout = 0.):
        super().__init__()
        self.scale = dim_head ** -0.5
        self.heads = heads
        self.causal = causal

        q_dim = k_dim = v_dim = out_dim = dim_head * heads

        self.to_q = nn.Linear(dim, q_dim, bias = False)
        self.to_k = nn.Linear(dim, k_dim, bias = False)
        self.to_v = nn.Linear(dim, v_dim, bias = False)

        self.attend = Attend(heads = heads, causal = causal, dropout = dropout, scale = self.scale)

        self.to_out = nn.Linear(out_dim, dim, bias = False)

    def forward(
        self,
        x,
        mask = None,
        rel_pos = None,
        prev_attn = None,
        return_intermediates = False,
        cache: Optional[Intermediates] = None,
    ):
        b, n, h, device = x.shape[0], x.shape[1], self.heads, x.device

        q = self.to_q(x)
        k = self.to_k(x)
        v = self.to_v(x)

        q, k, v = map(lambda t: t.reshape(b, n, h, -1).transpose(1, 2), (q, k, v))

        if exists(cache):
            ck, cv = cache.cached_kv
            k = torch.cat((ck, k), dim = -2)
            v = torch.cat((cv, v), dim = -2)

        if return_intermediates:
            cached_kv = (k, v)

        input_mask = mask

        i, j = map(lambda t: t.shape[-2], (q, k))

        final_attn_mask = None
        if exists(input_mask):
            final_attn_mask = input_mask[:, None, None, :]

        attn_bias = None
        if exists(rel_pos):
            attn_bias = rel_pos(i, j)

        out, intermediates = self.attend(
            q, k, v,
            mask = final_attn_mask,
            attn_bias = attn_bias,
            prev_attn = prev_attn
        )

        out = out.transpose(1, 2).reshape(b, n, -1)
        out = self.to_out(out)

        if not return_intermediates:
            return out

        intermediates.cached_kv = cached_kv
        return out, intermediates

class AttentionLayers(nn.Module):
    def __init__(
        self,
        dim,
        depth,
        heads = 8,
        causal = False,
        alibi_pos_bias = False,
        alibi_num_heads = None,
        attn_dim_head = 64,
        ff_mult = 4,
    ):
        super().__init__()
        self.dim = dim
        self.depth = depth
        self.causal = causal

        self.rel_pos = None
        if alibi_pos_bias:
            alibi_num_heads = default(alibi_num_heads, heads)
            assert alibi_num_heads <= heads, 'number of ALiBi heads must be less than the total number of heads'
            self.rel_pos = AlibiPositionalBias(heads = alibi_num_heads, total_heads = heads)

        self.layers = nn.ModuleList([])
        self.layer_types = ('a', 'f') * depth

        for layer_type in self.layer_types:
            if layer_type == 'a':
                layer = Attention(dim, heads = heads, causal = causal, dim_head = attn_dim_head)
            else:
                layer = FeedForward(dim, mult = ff_mult)
            self.layers.append(nn.ModuleList([nn.LayerNorm(dim), layer]))

        self.final_norm = nn.LayerNorm(dim)

    def forward(
        self,
        x,
        mask = None,
        return_hiddens = False,
        cache: Optional[LayerIntermediates] = None,
        cache_age = 1,
    ):
        hiddens = []
        intermediates = []

        attn_cache = []

        if exists(cache):
            assert not self.training and self.causal and not exists(mask)

            if cache_age > 0:
                x = x[:, -cache_age:]

            attn_cache = cache.attn_intermediates

        iter_attn_cache = iter(attn_cache)

        for layer_type, (norm, block) in zip(self.layer_types, self.layers):
            residual = x
            x = norm(x)

            if layer_type == 'a':
                hiddens.append(x)
                out, inter = block(x, mask = mask, rel_pos = self.rel_pos, cache = next(iter_attn_cache, None), return_intermediates = True)
                intermediates.append(inter)
            else:
                out = block(x)

            x = out + residual

        x = self.final_norm(x)

        if return_hiddens:
            return x, LayerIntermediates(hiddens = hiddens, attn_intermediates = intermediates)

        return x

class Decoder(AttentionLayers):
    def __init__(self, **kwargs):
        assert 'causal' not in kwargs, 'cannot set causality on decoder'
        super().__init__(causal = True, **kwargs)

class TransformerWrapper(nn.Module):
    def __init__(self, *, num_tokens, max_seq_len, attn_layers, use_abs_pos_emb = True):
        super().__init__()
        dim = attn_layers.dim
        self.max_seq_len = max_seq_len
        self.token_emb = nn.Embedding(num_tokens, dim)
        self.pos_emb = nn.Embedding(max_seq_len, dim) if use_abs_pos_emb else always(0)
        self.use_abs_pos_emb = use_abs_pos_emb
        self.attn_layers = attn_layers
        self.to_logits = nn.Linear(dim, num_tokens)

    def forward(self, x, mask = None, return_intermediates = False, cache: Optional[LayerIntermediates] = None, **kwargs):
        b, n, device = *x.shape, x.device

        pos_emb = self.pos_emb(torch.arange(n, device = device)) if self.use_abs_pos_emb else self.pos_emb(x)
        x = self.token_emb(x) + pos_emb

        x, intermediates = self.attn_layers(x, mask = mask, cache = cache, return_hiddens = True, **kwargs)

        out = self.to_logits(x)

        if return_intermediates:
            return out, intermediates

        return out

# autoregressive_wrapper.py

def top_k(logits, frac_num_tokens = 0.1, k = None):
    num_tokens = logits.shape[-1]
    k = default(k, math.ceil(frac_num_tokens * num_tokens))
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
    def generate(self, prompts, seq_len, temperature = 1., filter_logits_fn = top_k, restrict_to_max_seq_len = True, filter_kwargs: dict = dict(), **kwargs):
        was_training = self.net.training
        self.net.eval()

        max_seq_len = self.max_seq_len
        b, t = prompts.shape

        out = prompts
        cache = None

        for _ in range(seq_len):

            if restrict_to_max_seq_len:
                x = out[:, -max_seq_len:]

                if exists(cache):
                    for inter in cache.attn_intermediates:
                        inter.cached_kv = [t[..., -(max_seq_len - 1):, :] for t in inter.cached_kv]

            logits, cache = self.net(x, return_intermediates = True, cache = cache, **kwargs)

            logits = logits[:, -1]

            filtered_logits = filter_logits_fn(logits, **filter_kwargs)

            probs = F.softmax(filtered_logits / temperature, dim = -1)

            sample = torch.multinomial(probs, 1)

            out = torch.cat((out, sample), dim = -1)

        out = out[:, t:]

        self.net.train(was_training)
        return out

    def forward(self, x, **kwargs):
        inp, target = x[:, :-1], x[:, 1:]
        logits = self.net(inp, **kwargs)
        loss = F.cross_entropy(logits.transpose(1, 2), target, ignore_index = self.ignore_index)
        return loss

if __name__ == "__main__":
    torch.manual_seed(0)

    NUM_TOKENS = 64
    SEQ_LEN = 48

    model = TransformerWrapper(
        num_tokens = NUM_TOKENS,
        max_seq_len = SEQ_LEN,
        use_abs_pos_emb = False,
        attn_layers = Decoder(dim = 64, depth = 2, heads = 4, attn_dim_head = 16, alibi_pos_bias = True)
    )
    model = AutoregressiveWrapper(model)
    optim = torch.optim.Adam(model.parameters(), lr = 1e-3)

    # one training step on full-length sequences, then sample from a short prompt with the kv cache

    data = torch.randint(0, NUM_TOKENS, (4, SEQ_LEN + 1))
    loss = model(data)
    loss.backward()
    optim.step()
    optim.zero_grad()

    prompt = data[:2, :6]
    sampled = model.generate(prompt, 12, temperature = 1., filter_kwargs = dict(k = 16))
    print("fixed" if FIXED else "buggy", "loss %.4f" % loss.item(), "sampled:", sampled.tolist())
