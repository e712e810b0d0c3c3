# Citation: lucidrains/local-attention, fix in commit 5dc3792 ("make sure non-causal local attention
#   can also support exact window sizes"); the regression came in with commit f250abf ("further cleanup,
#   only mask out padding values if autopad is turned on and padding was actually added").
# Upstream: local_attention/local_attention.py LocalAttention.forward (look_around, pad_to_multiple),
#   local_attention/transformer.py LocalMHA / LocalTransformer (causal, exact_windowsize=True, autopad=True),
#   local_attention/rotary.py SinusoidalEmbeddings; buggy state read at 5dc3792^. einops replaced by torch.
# Bug: `look_around` pads the key/value buckets of the first window's look-back with pad_value (-1) and the
#   key positions with -1; that pad mask (`bq_k == pad_value`) was only applied `if autopad and needed_pad`,
#   so whenever the sequence length is already a multiple of window_size (and no key mask is given) the
#   first window's queries attend to look_backward*window_size fake keys (all -1, values -1), which the
#   causal / exact-window predicates do not catch (their position -1 is < every query position).
# Fix: `pad_mask = bq_k == pad_value` is always built and applied (`else: sim.masked_fill(pad_mask, ...)`,
#   and folded into the window mask in the non-causal exact-window branch).
import math
import sys

import torch
import torch.nn.functional as F
from torch import nn, einsum

FIXED = "--fixed" in sys.argv

torch.manual_seed(0)

# constant

TOKEN_SELF_ATTN_VALUE = -5e4

# helper functions


def exists(val):
    return val is not None


def default(value, d):
    return d if not exists(value) else value


def max_neg_value(tensor):
    return -torch.finfo(tensor.dtype).max


def l2norm(tensor):
    dtype = tensor.dtype
    normed = F.normalize(tensor, dim=-1)
    return normed.type(dtype)


def pad_to_multiple(tensor, multiple, dim=-1, value=0):
    seqlen = tensor.shape[dim]
    m = seqlen / multiple
    if m.is_integer():
        return False, tensor
    remainder = math.ceil(m) * multiple - seqlen
    pad_offset = (0,) * (-1 - dim) * 2
    return True, F.pad(tensor, (*pad_offset, 0, remainder), value=value)


def look_around(x, backward=1, forward=0, pad_value=-1, dim=2):
    t = x.shape[1]
    dims = (len(x.shape) - dim) * (0, 0)
    padded_x = F.pad(x, (*dims, backward, forward), value=pad_value)
    tensors = [padded_x[:, ind:(ind + t), ...] for ind in range(forward + backward + 1)]
    return torch.cat(tensors, dim=dim)


# rotary (local_attention/rotary.py)


class SinusoidalEmbeddings(nn.Module):
    def __init__(self, dim, scale_base=None, use_xpos=False):
        super().__init__()
        inv_freq = 1. / (10000 ** (torch.arange(0, dim, 2).float() / dim))
        self.register_buffer('inv_freq', inv_freq)
        self.use_xpos = use_xpos
        self.scale_base = scale_base
        scale = (torch.arange(0, dim, 2) + 0.4 * dim) / (1.4 * dim)
        self.register_buffer('scale', scale, persistent=False)

    def forward(self, x):
        seq_len, device = x.shape[-2], x.device
        t = torch.arange(seq_len, device=x.device).type_as(self.inv_freq)
        freqs = torch.einsum('i , j -> i j', t, self.inv_freq)
        freqs = torch.cat((freqs, freqs), dim=-1)
        if not self.use_xpos:
            return freqs, torch.ones(1, device=device)
        power = (t - (seq_len // 2)) / self.scale_base
        scale = self.scale ** power[:, None]
        scale = torch.cat((scale, scale), dim=-1)
        return freqs, scale


def rotate_half(x):
    x = x.reshape(*x.shape[:-1], 2, x.shape[-1] // 2)  # 'b ... (r d) -> b ... r d', r = 2
    x1, x2 = x.unbind(dim=-2)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, freqs, scale=1):
    q_len = q.shape[-2]
    q_freqs = freqs[..., -q_len:, :]
    inv_scale = scale ** -1
    if scale.ndim == 2:
        scale = scale[-q_len:, :]
    q = (q * q_freqs.cos() * scale) + (rotate_half(q) * q_freqs.sin() * scale)
    k = (k * freqs.cos() * inv_scale) + (rotate_half(k) * freqs.sin() * inv_scale)
    return q, k


# main class


class LocalAttention(nn.Module):
    def __init__(self, window_size, causal=False, look_backward=1, look_forward=None, dropout=0.,
                 shared_qk=False, rel_pos_emb_config=None, dim=None, autopad=False, exact_windowsize=False,
                 scale=None, use_rotary_pos_emb=True, use_xpos=False, xpos_scale_base=None):
        super().__init__()
        look_forward = default(look_forward, 0 if causal else 1)
        assert not (causal and look_forward > 0), 'you cannot look forward if causal'

        self.scale = scale
        self.window_size = window_size
        self.autopad = autopad
        self.exact_windowsize = exact_windowsize
        self.causal = causal
        self.look_backward = look_backward
        self.look_forward = look_forward
        self.dropout = nn.Dropout(dropout)
        self.shared_qk = shared_qk

        # relative positions
        self.rel_pos = None
        self.use_xpos = use_xpos
        if use_rotary_pos_emb and (exists(rel_pos_emb_config) or exists(dim)):
            if exists(rel_pos_emb_config):
                dim = rel_pos_emb_config[0]
            self.rel_pos = SinusoidalEmbeddings(dim, use_xpos=use_xpos,
                                                scale_base=default(xpos_scale_base, window_size // 2))

    def forward(self, q, k, v, mask=None, input_mask=None, attn_bias=None, window_size=None):
        mask = default(mask, input_mask)

        assert not (exists(window_size) and not self.use_xpos), 'cannot perform window size extrapolation if xpos is not turned on'

        shape, autopad, pad_value, window_size, causal, look_backward, look_forward, shared_qk = \
            q.shape, self.autopad, -1, default(window_size, self.window_size), self.causal, \
            self.look_backward, self.look_forward, self.shared_qk

        # pack([t], '* n d')
        packed_shape = q.shape[:-2]
        q, k, v = map(lambda t: t.reshape(-1, *t.shape[-2:]), (q, k, v))

        # auto padding
        if autopad:
            orig_seq_len = q.shape[1]
            (needed_pad, q), (_, k), (_, v) = map(lambda t: pad_to_multiple(t, self.window_size, dim=-2), (q, k, v))

        b, n, dim_head, device, dtype = *q.shape, q.device, q.dtype

        scale = default(self.scale, dim_head ** -0.5)

        assert (n % window_size) == 0, f'sequence length {n} must be divisible by window size {window_size} for local attention'

        windows = n // window_size

        if shared_qk:
            k = l2norm(k)

        seq = torch.arange(n, device=device)
        b_t = seq.reshape(1, windows, window_size)  # '(w n) -> 1 w n'

        # bucketing
        bq, bk, bv = map(lambda t: t.reshape(t.shape[0], windows, window_size, t.shape[-1]), (q, k, v))

        bq = bq * scale

        look_around_kwargs = dict(backward=look_backward, forward=look_forward, pad_value=pad_value)

        bk = look_around(bk, **look_around_kwargs)
        bv = look_around(bv, **look_around_kwargs)

        # rotary embeddings
        if exists(self.rel_pos):
            pos_emb, xpos_scale = self.rel_pos(bk)
            bq, bk = apply_rotary_pos_emb(bq, bk, pos_emb, scale=xpos_scale)

        # calculate positions for masking
        bq_t = b_t
        bq_k = look_around(b_t, **look_around_kwargs)

        bq_t = bq_t[..., :, None]  # '... i -> ... i 1'
        bq_k = bq_k[..., None, :]  # '... j -> ... 1 j'

        if FIXED:
            pad_mask = bq_k == pad_value

        sim = einsum('b h i e, b h j e -> b h i j', bq, bk)

        if exists(attn_bias):
            heads = attn_bias.shape[0]
            assert (b % heads) == 0
            attn_bias = attn_bias.repeat(b // heads, 1, 1)[:, None]  # 'h i j -> (b h) 1 i j'
            sim = sim + attn_bias

        mask_value = max_neg_value(sim)

        if shared_qk:
            self_mask = bq_t == bq_k
            sim = sim.masked_fill(self_mask, TOKEN_SELF_ATTN_VALUE)
            del self_mask

        if causal:
            causal_mask = bq_t < bq_k

            if self.exact_windowsize:
                max_causal_window_size = (self.window_size * self.look_backward)
                causal_mask = causal_mask | (bq_t > (bq_k + max_causal_window_size))

            sim = sim.masked_fill(causal_mask, mask_value)
            del causal_mask

        if FIXED:
            # masking out for exact window size for non-causal
            # as well as masking out for padding value
            if not causal and self.exact_windowsize:
                max_backward_window_size = (self.window_size * self.look_backward)
                max_forward_window_size = (self.window_size * self.look_forward)
                window_mask = ((bq_k - max_forward_window_size) > bq_t) | (bq_t > (bq_k + max_backward_window_size)) | pad_mask
                sim = sim.masked_fill(window_mask, mask_value)
            else:
                sim = sim.masked_fill(pad_mask, mask_value)
        else:
            # mask out padding value
            if autopad and needed_pad:
                pad_mask = bq_k == pad_value
                sim = sim.masked_fill(pad_mask, mask_value)
                del pad_mask

        # take care of key padding mask passed in
        if exists(mask):
            batch = mask.shape[0]
            assert (b % batch) == 0

            h = b // mask.shape[0]

            if autopad:
                _, mask = pad_to_multiple(mask, window_size, dim=-1, value=False)

            mask = mask.reshape(-1, windows, window_size)  # '... (w n) -> (...) w n'
            mask = look_around(mask, **{**look_around_kwargs, 'pad_value': False})
            mask = mask[..., None, :]  # '... j -> ... 1 j'
            mask = mask.repeat_interleave(h, dim=0)  # 'b ... -> (b h) ...'
            sim = sim.masked_fill(~mask, mask_value)
            del mask

        # attention
        attn = sim.softmax(dim=-1)
        attn = self.dropout(attn)

        # aggregation
        out = einsum('b h i j, b h j e -> b h i e', attn, bv)
        out = out.reshape(out.shape[0], -1, out.shape[-1])  # 'b w n d -> b (w n) d'

        if autopad:
            out = out[:, :orig_seq_len, :]

        out = out.reshape(*packed_shape, *out.shape[-2:])  # unpack
        return out


# local_attention/transformer.py


class LocalMHA(nn.Module):
    def __init__(self, *, dim, window_size, dim_head=64, heads=8, dropout=0., causal=False, prenorm=False,
                 qk_rmsnorm=False, qk_scale=8, use_xpos=False, xpos_scale_base=None, **kwargs):
        super().__init__()
        inner_dim = dim_head * heads
        self.norm = nn.LayerNorm(dim) if prenorm else None
        self.heads = heads
        self.to_qkv = nn.Linear(dim, inner_dim * 3, bias=False)
        self.qk_rmsnorm = qk_rmsnorm
        if qk_rmsnorm:
            self.q_scale = nn.Parameter(torch.ones(dim_head))
            self.k_scale = nn.Parameter(torch.ones(dim_head))

        self.attn_fn = LocalAttention(
            dim=dim_head,
            window_size=window_size,
            causal=causal,
            autopad=True,
            scale=(qk_scale if qk_rmsnorm else None),
            exact_windowsize=True,
            use_xpos=use_xpos,
            xpos_scale_base=xpos_scale_base,
            **kwargs
        )
        self.to_out = nn.Linear(inner_dim, dim, bias=False)

    def forward(self, x, mask=None, attn_bias=None):
        if exists(self.norm):
            x = self.norm(x)

        q, k, v = self.to_qkv(x).chunk(3, dim=-1)
        q, k, v = map(lambda t: t.reshape(t.shape[0], t.shape[1], self.heads, -1).transpose(1, 2), (q, k, v))

        if self.qk_rmsnorm:
            q, k = map(l2norm, (q, k))
            q = q * self.q_scale
            k = k * self.k_scale

        out = self.attn_fn(q, k, v, mask=mask, attn_bias=attn_bias)

        out = out.transpose(1, 2).reshape(out.shape[0], out.shape[2], -1)  # 'b h n d -> b n (h d)'
        return self.to_out(out)


class GEGLU(nn.Module):
    def forward(self, x):
        x, gate = x.chunk(2, dim=-1)
        return x * F.gelu(gate)


def FeedForward(dim, mult=4, dropout=0.):
    inner_dim = int(dim * mult * 2 / 3)
    return nn.Sequential(
        nn.LayerNorm(dim),
        nn.Linear(dim, inner_dim * 2, bias=False),
        GEGLU(),
        nn.Dropout(dropout),
        nn.Linear(inner_dim, dim, bias=False)
    )


class LocalTransformer(nn.Module):
    def __init__(self, *, num_tokens, max_seq_len, dim, depth, causal=True, local_attn_window_size=512,
                 dim_head=64, heads=8, ff_mult=4, attn_dropout=0., ff_dropout=0., ignore_index=-1,
                 use_xpos=False, xpos_scale_base=None, use_dynamic_pos_bias=False, **kwargs):
        super().__init__()
        self.token_emb = nn.Embedding(num_tokens, dim)
        self.pos_emb = nn.Embedding(max_seq_len, dim)
        self.max_seq_len = max_seq_len
        self.layers = nn.ModuleList([])
        self.local_attn_window_size = local_attn_window_size
        self.dynamic_pos_bias = None

        for _ in range(depth):
            self.layers.append(nn.ModuleList([
                LocalMHA(dim=dim, dim_head=dim_head, heads=heads, dropout=attn_dropout, causal=causal,
                         window_size=local_attn_window_size, use_xpos=use_xpos, xpos_scale_base=xpos_scale_base,
                         use_rotary_pos_emb=not use_dynamic_pos_bias, prenorm=True, **kwargs),
                FeedForward(dim=dim, mult=ff_mult, dropout=ff_dropout)
            ]))

        self.ignore_index = ignore_index
        self.to_logits = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, num_tokens, bias=False))

    def forward(self, x, mask=None, return_loss=False):
        if return_loss:
            x, labels = x[:, :-1], x[:, 1:]

        n, device = x.shape[1], x.device
        x = self.token_emb(x)

        assert n <= self.max_seq_len
        x = x + self.pos_emb(torch.arange(n, device=device))

        attn_bias = None

        for attn, ff in self.layers:
            x = attn(x, mask=mask, attn_bias=attn_bias) + x
            x = ff(x) + x

        logits = self.to_logits(x)

        if not return_loss:
            return logits

        logits = logits.transpose(1, 2)  # 'b n c -> b c n'
        loss = F.cross_entropy(logits, labels, ignore_index=self.ignore_index)
        return loss


def main():
    # as train.py (enwik8): SEQ_LEN a multiple of the local window, data sampled as SEQ_LEN + 1 tokens
    SEQ_LEN = 16
    WINDOW = 4
    model = LocalTransformer(num_tokens=64, dim=32, depth=2, causal=True, local_attn_window_size=WINDOW,
                             max_seq_len=SEQ_LEN, dim_head=8, heads=4)
    optim = torch.optim.Adam(model.parameters(), lr=1e-3)

    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 64, (4, SEQ_LEN + 1), generator=g) for _ in range(6)]

    model.train()
    for step, data in enumerate(batches):
        loss = model(data, return_loss=True)
        optim.zero_grad()
        loss.backward()
        optim.step()
        print(f"step {step} training loss: {loss.item():.5f}")

    model.eval()
    with torch.no_grad():
        prime = batches[0][:1, :SEQ_LEN]
        logits = model(prime)
        print("logits at positions 0..3 (first window), first 4 classes:")
        for i in range(WINDOW):
            print("  pos", i, [round(v, 4) for v in logits[0, i, :4].tolist()])
        print("next-token argmax per position:", logits[0].argmax(dim=-1).tolist())


if __name__ == "__main__":
    main()
