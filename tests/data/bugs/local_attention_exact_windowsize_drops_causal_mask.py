"""lucidrains/local-attention: causal + exact_windowsize combined the two masks with `&`.

Citation: lucidrains/local-attention#5 ("Bug in exact_window_size masking for Causal
Attention?"), fixed by commit 270adde ("fix exact window size masking", v1.2.2).

Bug: `LocalAttention(causal=True, exact_windowsize=True)` built the causal mask
(query position < key position) and then AND-ed it with the "too far in the past" mask
(query position > key position + window_size * look_backward).  No key is both in the
future and too far in the past, so the AND is all False: every query saw the whole of its
own bucket and the look-back bucket, future keys in its own bucket included.
Fix: combine the two masks with `|`.

This program keeps the module as the project wrote it at v1.2.1 (bucketing with
`look_around`, positions bucketed alongside the keys, -1 marking the padded look-back
bucket) and runs a small causal local-attention language-model layer over 16 tokens with
window_size=4, look_backward=1.
"""
import math
import sys
from functools import reduce
from operator import mul

import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv

TOKEN_SELF_ATTN_VALUE = -5e4


def default(value, d):
    return d if value is None else value


def max_neg_value(tensor):
    return -torch.finfo(tensor.dtype).max


def merge_dims(ind_from, ind_to, tensor):
    shape = list(tensor.shape)
    arr_slice = slice(ind_from, ind_to + 1)
    shape[arr_slice] = [reduce(mul, shape[arr_slice])]
    return tensor.reshape(*shape)


def expand_dim(t, dim, k, unsqueeze=True):
    if unsqueeze:
        t = t.unsqueeze(dim)
    expand_shape = [-1] * len(t.shape)
    expand_shape[dim] = k
    return t.expand(*expand_shape)


def pad_to_multiple(tensor, multiple, dim=-1, value=0):
    seqlen = tensor.shape[dim]
    m = seqlen / multiple
    if m.is_integer():
        return tensor
    remainder = math.ceil(m) * multiple - seqlen
    pad_offset = (0,) * (-1 - dim) * 2
    return F.pad(tensor, (*pad_offset, 0, remainder), value=value)


def look_around(x, backward=1, forward=0, pad_value=-1, dim=2):
    t = x.shape[1]
    dims = (len(x.shape) - dim) * (0, 0)
    padded_x = F.pad(x, (*dims, backward, forward), value=pad_value)
    tensors = [padded_x[:, ind:(ind + t), ...] for ind in range(forward + backward + 1)]
    return torch.cat(tensors, dim=dim)


class LocalAttention(nn.Module):
    def __init__(self, window_size, causal=False, look_backward=1, look_forward=None, dropout=0.,
                 shared_qk=False, autopad=False, exact_windowsize=False):
        super().__init__()
        look_forward = default(look_forward, 0 if causal else 1)
        assert not (causal and look_forward > 0), 'you cannot look forward if causal'

        self.window_size = window_size
        self.causal = causal
        self.look_backward = look_backward
        self.look_forward = look_forward
        self.exact_windowsize = exact_windowsize
        self.autopad = autopad
        self.dropout = nn.Dropout(dropout)
        self.shared_qk = shared_qk

    def forward(self, q, k, v, input_mask=None):
        shape = q.shape

        merge_into_batch = lambda t: t.reshape(-1, *t.shape[-2:])
        q, k, v = map(merge_into_batch, (q, k, v))

        if self.autopad:
            orig_t = q.shape[1]
            q, k, v = map(lambda t: pad_to_multiple(t, self.window_size, dim=-2), (q, k, v))

        window_size, causal, look_backward, look_forward, shared_qk = (
            self.window_size, self.causal, self.look_backward, self.look_forward, self.shared_qk)
        b, t, e, device, dtype = *q.shape, q.device, q.dtype
        assert (t % window_size) == 0, f'sequence length {t} must be divisible by window size {window_size} for local attention'

        windows = t // window_size

        if shared_qk:
            k = F.normalize(k, 2, dim=-1).type_as(q)

        ticker = torch.arange(t, device=device, dtype=dtype)[None, :]
        b_t = ticker.reshape(1, windows, window_size)

        bucket_fn = lambda t: t.reshape(b, windows, window_size, -1)
        bq, bk, bv = map(bucket_fn, (q, k, v))

        look_around_kwargs = {'backward': look_backward, 'forward': look_forward}
        bk = look_around(bk, **look_around_kwargs)
        bv = look_around(bv, **look_around_kwargs)

        bq_t = b_t
        bq_k = look_around(b_t, **look_around_kwargs)

        dots = torch.einsum('bhie,bhje->bhij', bq, bk) * (e ** -0.5)

        mask_value = max_neg_value(dots)

        if shared_qk:
            mask = bq_t[:, :, :, None] == bq_k[:, :, None, :]
            dots.masked_fill_(mask, TOKEN_SELF_ATTN_VALUE)
            del mask

        if causal:
            mask = bq_t[:, :, :, None] < bq_k[:, :, None, :]

            if self.exact_windowsize:
                max_causal_window_size = (self.window_size * self.look_backward)
                if FIXED:
                    mask = mask | (bq_t[:, :, :, None] > (bq_k[:, :, None, :] + max_causal_window_size))
                else:
                    mask = mask & (bq_t[:, :, :, None] > (bq_k[:, :, None, :] + max_causal_window_size))

            dots.masked_fill_(mask, mask_value)
            del mask

        mask = bq_k[:, :, None, :] == -1
        dots.masked_fill_(mask, mask_value)
        del mask

        if input_mask is not None:
            h = b // input_mask.shape[0]
            if self.autopad:
                input_mask = pad_to_multiple(input_mask, window_size, dim=-1, value=False)
            input_mask = input_mask.reshape(-1, windows, window_size)
            mq = mk = input_mask
            mk = look_around(mk, pad_value=False, **look_around_kwargs)
            mask = (mq[:, :, :, None] * mk[:, :, None, :])
            mask = merge_dims(0, 1, expand_dim(mask, 1, h))
            dots.masked_fill_(~mask, mask_value)
            del mask

        attn = dots.softmax(dim=-1)
        attn = self.dropout(attn)

        out = torch.einsum('bhij,bhje->bhie', attn, bv)
        out = out.reshape(-1, t, e)

        if self.autopad:
            out = out[:, :orig_t, :]

        return out.reshape(*shape)


class LocalSelfAttention(nn.Module):
    """A causal local-attention layer of a small language model (heads folded into batch)."""

    def __init__(self, dim, heads, window_size):
        super().__init__()
        self.heads = heads
        self.to_qkv = nn.Linear(dim, dim * 3, bias=False)
        self.to_out = nn.Linear(dim, dim)
        self.attn_fn = LocalAttention(window_size=window_size, causal=True, look_backward=1,
                                      exact_windowsize=True, autopad=True)

    def forward(self, x, mask=None):
        b, n, d = x.shape
        h = self.heads
        q, k, v = self.to_qkv(x).chunk(3, dim=-1)
        q, k, v = (t.reshape(b, n, h, -1).transpose(1, 2) for t in (q, k, v))
        out = self.attn_fn(q, k, v, input_mask=mask)
        out = out.transpose(1, 2).reshape(b, n, d)
        return self.to_out(out)


def main():
    torch.manual_seed(0)
    num_tokens, dim, heads, seq_len = 64, 32, 2, 16
    emb = nn.Embedding(num_tokens, dim)
    layer = LocalSelfAttention(dim, heads, window_size=4)
    tokens = torch.randint(0, num_tokens, (2, seq_len))
    mask = torch.ones(2, seq_len, dtype=torch.bool)
    with torch.no_grad():
        out = layer(emb(tokens), mask=mask)
    print("fixed" if FIXED else "buggy", tuple(out.shape), f"{out.sum().item():.4f}")


if __name__ == "__main__":
    main()
