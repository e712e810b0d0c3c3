# lucidrains/routing-transformer commit 57b1573: SelfAttention built its local-attention heads with
# LocalAttention(local_attn_window_size, causal = True, ...) even when the RoutingTransformer is a non-causal encoder,
# so encoder tokens never see later tokens of their window; the fix passes causal = causal and look_forward = 0 if causal else 1.
import sys
from functools import partial, reduce
from operator import mul

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)

TOKEN_SELF_ATTN_VALUE = -5e4


# ---------------- local_attention 1.0.3 (lucidrains/local-attention) ----------------
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


def look_around(x, backward=1, forward=0, pad_value=-1, dim=2):
    t = x.shape[1]
    dims = (len(x.shape) - dim) * (0, 0)
    padded_x = F.pad(x, (*dims, backward, forward), value=pad_value)
    tensors = [padded_x[:, ind:(ind + t), ...] for ind in range(forward + backward + 1)]
    return torch.cat(tensors, dim=dim)


class LocalAttention(nn.Module):
    def __init__(self, window_size, causal=False, look_backward=1, look_forward=None, dropout=0., shared_qk=False,
                 rel_pos_emb_config=None):
        super().__init__()
        look_forward = default(look_forward, 0 if causal else 1)
        assert not (causal and look_forward > 0), 'you cannot look forward if causal'
        self.window_size = window_size
        self.causal = causal
        self.look_backward = look_backward
        self.look_forward = look_forward
        self.dropout = nn.Dropout(dropout)
        self.shared_qk = shared_qk
        assert rel_pos_emb_config is None  # rel_pos_emb=False in this reproduction

    def forward(self, q, k, v, input_mask=None):
        shape = q.shape
        merge_into_batch = lambda t: t.reshape(-1, *t.shape[-2:])
        q, k, v = map(merge_into_batch, (q, k, v))
        b, t, e, device, dtype = *q.shape, q.device, q.dtype
        window_size, causal, look_backward, look_forward, shared_qk = (
            self.window_size, self.causal, self.look_backward, self.look_forward, self.shared_qk)
        assert (t % window_size) == 0
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
            dots.masked_fill_(mask, mask_value)
            del mask
        mask = bq_k[:, :, None, :] == -1
        dots.masked_fill_(mask, mask_value)
        del mask
        if input_mask is not None:
            h = b // input_mask.shape[0]
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
        return out.reshape(*shape)


# ---------------- routing_transformer ----------------
def reshape_dim(t, dim, split_dims):
    shape = list(t.shape)
    num_dims = len(shape)
    dim = (dim + num_dims) % num_dims
    shape[dim:dim + 1] = split_dims
    return t.reshape(shape)


class SelfAttention(nn.Module):
    def __init__(self, dim, depth, max_seq_len, heads, local_attn_heads, window_size, dim_head=None,
                 local_attn_window_size=None, local_attn_radius_blocks=1, causal=False, attn_dropout=0., dropout=0.,
                 rel_pos_emb=True, shared_qk=False):
        super().__init__()
        assert (max_seq_len % window_size) == 0
        assert local_attn_heads == heads, 'this reproduction keeps only the local heads (no k-means routed heads)'
        local_attn_window_size = default(local_attn_window_size, window_size // 2)
        self.heads = heads
        self.local_attn_heads = local_attn_heads
        self.global_attn_heads = heads - local_attn_heads
        dim_head = default(dim_head, dim // heads)
        dim_heads = dim_head * heads
        self.dim_head = dim_head
        local_dim_heads = dim_head * self.local_attn_heads
        if self.local_attn_heads > 0:
            rel_pos_emb_config = (dim_head, local_attn_heads) if rel_pos_emb else None
            if FIXED:
                self.local_attn = LocalAttention(local_attn_window_size, causal=causal, dropout=attn_dropout,
                                                 rel_pos_emb_config=rel_pos_emb_config,
                                                 look_backward=local_attn_radius_blocks,
                                                 look_forward=0 if causal else local_attn_radius_blocks)
            else:
                self.local_attn = LocalAttention(local_attn_window_size, causal=True, dropout=attn_dropout,
                                                 rel_pos_emb_config=rel_pos_emb_config)
            self.local_to_qkv = nn.Linear(dim, 3 * local_dim_heads)
        self.to_out = nn.Linear(dim_heads, dim, bias=False)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x, input_mask=None, **kwargs):
        b, t, e, h, dh = *x.shape, self.heads, self.dim_head
        split_heads = lambda v: reshape_dim(v, -1, (-1, dh)).transpose(1, 2).contiguous()
        local_qkv = self.local_to_qkv(x).chunk(3, dim=-1)
        lq, lk, lv = map(split_heads, local_qkv)
        out = []
        total_loss = torch.tensor(0., requires_grad=True)
        local_out = self.local_attn(lq, lk, lv, input_mask=input_mask)
        out.append(local_out)
        out = torch.cat(out, dim=1)
        out = out.reshape(b, h, t, -1).transpose(1, 2).reshape(b, t, -1)
        out = self.to_out(out)
        return self.dropout(out), total_loss


class PreNorm(nn.Module):
    def __init__(self, norm_class, dim, fn):
        super().__init__()
        self.norm = norm_class(dim)
        self.fn = fn

    def forward(self, x, **kwargs):
        return self.fn(self.norm(x), **kwargs)


class FeedForward(nn.Module):
    def __init__(self, dim, mult=4):
        super().__init__()
        self.w1 = nn.Linear(dim, dim * mult)
        self.act = nn.GELU()
        self.w2 = nn.Linear(dim * mult, dim)

    def forward(self, x, **kwargs):
        return self.w2(self.act(self.w1(x)))


class RoutingTransformer(nn.Module):
    def __init__(self, dim, depth, max_seq_len, heads=8, window_size=64, local_attn_window_size=None, causal=False,
                 n_local_attn_heads=0, rel_pos_emb=True):
        super().__init__()
        local_attn_window_size = default(local_attn_window_size, window_size // 2)
        fn_wrapper = partial(PreNorm, nn.LayerNorm, dim)
        self.layers = nn.ModuleList([])
        for _ in range(depth):
            attn = SelfAttention(dim, depth, max_seq_len, heads, n_local_attn_heads, window_size, causal=causal,
                                 local_attn_window_size=local_attn_window_size, rel_pos_emb=rel_pos_emb)
            self.layers.append(nn.ModuleList([fn_wrapper(attn), fn_wrapper(FeedForward(dim))]))

    def forward(self, x, input_mask=None):
        aux_loss = 0.
        for attn, ff in self.layers:
            y, loss = attn(x, input_mask=input_mask)
            x = x + y
            x = x + ff(x)
            aux_loss = aux_loss + loss
        return x, aux_loss


# Encoder (causal = False), as in RoutingTransformerEncDec's encoder, all heads local.
W = 8
enc = RoutingTransformer(dim=32, depth=2, max_seq_len=32, heads=4, window_size=2 * W, causal=False,
                         n_local_attn_heads=4, rel_pos_emb=False).eval()
print("local_attn causal =", enc.layers[0][0].fn.local_attn.causal,
      " look_forward =", enc.layers[0][0].fn.local_attn.look_forward)

x = torch.randn(2, 32, 32)
input_mask = torch.ones(2, 32, dtype=torch.bool)
input_mask[1, 27:] = False


def reference_local(lq, lk, lv, input_mask):
    # bidirectional block-local attention of an encoder: query in window w sees keys of windows w-1, w, w+1
    b, h, t, d = lq.shape
    win = torch.arange(t) // W
    allowed = (win[:, None] - win[None, :]).abs() <= 1
    allowed = allowed[None, None] & input_mask[:, None, None, :]
    dots = (lq @ lk.transpose(-1, -2)) * d ** -0.5
    dots = dots.masked_fill(~allowed, -torch.finfo(dots.dtype).max)
    return dots.softmax(-1) @ lv


with torch.no_grad():
    out, _ = enc(x, input_mask=input_mask)
    for attn, _ in enc.layers:
        attn.fn.local_attn.forward = reference_local
    ref, _ = enc(x, input_mask=input_mask)

m = input_mask[..., None]
print(f"max |encoder output - bidirectional local-attention reference| over real tokens: "
      f"{((out - ref).abs() * m).max().item():.6f}")
