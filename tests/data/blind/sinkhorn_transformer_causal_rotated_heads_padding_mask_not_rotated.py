# lucidrains/sinkhorn-transformer commit 1b9770f ("make sure masks are rotated in the causal case"):
# SinkhornCausalAttention rotates q/k/v of the second half of the heads left by bucket_size-1, but the input
# (padding) masks were bucketed unrotated, so for those heads the mask no longer lines up with the tokens.
import sys
import torch
from torch import nn
import torch.nn.functional as F
from operator import mul
from inspect import isfunction
from functools import partial, reduce

FIXED = "--fixed" in sys.argv

# helper functions (project code)

def default(x, d):
    if x is None:
        return d if not isfunction(d) else d()
    return x

def all_none(*arr):
    return all(el is None for el in arr)

def rotate_left(t, n, dim=0):
    pre_slices = (slice(None),) * dim
    l = (*pre_slices, slice(n, None))
    r = (*pre_slices, slice(0, n))
    return torch.cat((t[l], t[r]), dim=dim)

def rotate_right(t, n, dim=0):
    pre_slices = (slice(None),) * dim
    l = (*pre_slices, slice(-n, None))
    r = (*pre_slices, slice(None, -n))
    return torch.cat((t[l], t[r]), dim=dim)

def merge_dims(ind_from, ind_to, tensor):
    shape = list(tensor.shape)
    arr_slice = slice(ind_from, ind_to + 1)
    shape[arr_slice] = [reduce(mul, shape[arr_slice])]
    return tensor.reshape(*shape)

def bucket(buckets, t, dim=1):
    shape = list(t.shape)
    shape[dim:dim+1] = [buckets, -1]
    return t.reshape(*shape)

def unbucket(t, dim=1):
    shape = list(t.shape)
    shape[dim:dim+2] = [-1]
    return t.reshape(*shape)

def reorder_buckets(t, r):
    return torch.einsum('buv,bvtd->butd', r, t)

def max_neg_value(tensor):
    return -torch.finfo(tensor.dtype).max

def cumavg(t, dim):
    # the same commit added dtype=t.dtype here; true division gives the same float result either way
    r = torch.arange(1, t.shape[dim] + 1, device=t.device, dtype=t.dtype)
    expand_slice = [None] * len(t.shape)
    expand_slice[dim] = slice(None, None)
    return t.cumsum(dim=dim) / r[tuple(expand_slice)]

def batched_index_select(values, indices):
    last_dim = values.shape[-1]
    return values.gather(1, indices[:, :, None].expand(-1, -1, last_dim))

def expand_dim(t, dim, k):
    expand_shape = [-1] * len(t.shape)
    expand_shape[dim] = k
    return t.expand(*expand_shape)

def zero_all_but_top(x, dim, k=1):
    values, indices = torch.topk(x, k, dim=dim)
    return torch.zeros_like(x).scatter_(dim, indices, values)

def mask_reordering_matrix(R):
    buckets = R.shape[1]

    mask_value = max_neg_value(R)
    mask = torch.zeros(R.shape, device=R.device).bool()
    i, j = torch.triu_indices(buckets, buckets)
    mask[:, i, j + 1] = True

    R.masked_fill_(mask, mask_value)
    del mask

    R = R.softmax(dim=-1)
    R = R.tril(diagonal=-1) # extra insurance
    return R

class CausalAttentionSortNet(nn.Module):
    def __init__(self, heads, bucket_size, dim):
        super().__init__()
        self.heads = heads
        self.bucket_size = bucket_size
        self.dim = dim

    def forward(self, q, k):
        bh, *_, h, dim = *q.shape, self.heads, self.dim

        b = bh // h
        buckets = q.shape[1] // self.bucket_size
        kv_buckets = k.shape[1] // self.bucket_size

        q_r = bucket(buckets, cumavg(q, dim=1))
        k_r = bucket(kv_buckets, cumavg(k, dim=1))

        sq = q_r[:, :, 0]
        sk = k_r.sum(dim=2)
        sk = F.pad(sk, (0, 0, 1, 0))

        R = torch.einsum('bie,bje->bij', sq, sk)
        return mask_reordering_matrix(R)

class SinkhornCausalAttention(nn.Module):
    def __init__(self, bucket_size, dim, dim_heads, heads, max_seq_len, dropout = 0., kv_bucket_size = None):
        super().__init__()
        self.dim = dim
        self.heads = heads
        self.bucket_size = bucket_size

        # a learned null key / value for the first bucket (which has nothing in the past to sort to)
        self.null_keys = nn.Parameter(torch.randn(heads, 1, dim_heads))
        self.null_values = nn.Parameter(torch.randn(heads, 1, dim_heads))

        self.sort_net = CausalAttentionSortNet(heads, bucket_size, dim_heads)
        self.dropout = nn.Dropout(dropout)

    def forward(self, q, k, v, q_mask = None, kv_mask = None):
        b, h, t, d_h, d, bsz, device = *q.shape, self.dim, self.bucket_size, q.device

        bh = b * h
        hh = h // 2
        buckets = t // bsz

        hh_slice = (slice(None), slice(hh, None))

        q[hh_slice] = rotate_left(q[hh_slice], bsz-1, dim=2)
        k[hh_slice] = rotate_left(k[hh_slice], bsz-1, dim=2)
        v[hh_slice] = rotate_left(v[hh_slice], bsz-1, dim=2)

        # merge batch and head

        merge_batch_head = partial(merge_dims, 0, 1)
        q, k, v = map(merge_batch_head, (q, k, v))

        # bucket qkv

        b_q, b_k, b_v = map(partial(bucket, buckets), (q, k, v))

        # calculate R
        R = self.sort_net(q, k)
        R = R.type_as(q).to(q)

        # only allow one bucket to be reordered to, needed for input masking to work
        R = zero_all_but_top(R, dim=2, k=1)

        # add null key / values
        b_null_k = self.null_keys[None, :, None, :, :].expand(b, h, 1, bsz, -1).reshape(bh, 1, bsz, -1)
        b_null_v = self.null_values[None, :, None, :, :].expand(b, h, 1, bsz, -1).reshape(bh, 1, bsz, -1)

        b_k_r = torch.cat((b_null_k, b_k), dim=1)
        b_v_r = torch.cat((b_null_v, b_v), dim=1)

        # reorder buckets to buckets of the past
        b_k_r = reorder_buckets(b_k_r, R)
        b_v_r = reorder_buckets(b_v_r, R)

        # and concatenate to original buckets themselves for local attention
        b_k = torch.cat((b_k_r, b_k), dim=2)
        b_v = torch.cat((b_v_r, b_v), dim=2)

        dots = torch.einsum('buie,buje->buij', b_q, b_k) * (d ** -0.5)

        # mask
        mask_value = max_neg_value(q)

        if not all_none(q_mask, kv_mask):
            q_mask = default(q_mask, lambda: torch.ones((b, t), device=device).bool())
            kv_mask = default(kv_mask, q_mask)
            if FIXED:
                expand_head = lambda x: x.unsqueeze(1).repeat(1, h, 1)
                q_mask, kv_mask = map(expand_head, (q_mask, kv_mask))

                q_mask[hh_slice] = rotate_left(q_mask[hh_slice], bsz-1, dim=2)
                kv_mask[hh_slice] = rotate_left(kv_mask[hh_slice], bsz-1, dim=2)

                q_mask, kv_mask = map(lambda x: merge_dims(0, 1, x), (q_mask, kv_mask))
                mq, mk = bucket(buckets, q_mask), bucket(buckets, kv_mask)
            else:
                mq, mk = bucket(buckets, q_mask), bucket(buckets, kv_mask)
                expand_head_and_merge_into_batch = lambda x: merge_dims(0, 1, expand_dim(x.unsqueeze(1), 1, h))
                mq, mk = map(expand_head_and_merge_into_batch, (mq, mk))

            mk_with_null = F.pad(mk, (0, 0, 1, 0), value=True)
            mk_r = batched_index_select(mk_with_null, R.abs().argmax(dim=-1))

            mk = torch.cat((mk_r, mk), dim=2)
            mask = mq[:, :, :, None] * mk[:, :, None, :]
            dots.masked_fill_(~mask, mask_value)
            del mask

        mask = torch.ones((b, h, buckets, bsz, bsz * 2), device=device).bool()
        i, j = torch.triu_indices(bsz, bsz, 1)
        mask[:, :, :, i, j + bsz] = False
        mask[:, hh:, -1, 0:bsz, 0:bsz+1] = False
        mask[:, hh:, -1, 0, 0:bsz+1] = True
        mask = mask.reshape(b * h, buckets, bsz, bsz * 2)

        dots.masked_fill_(~mask, mask_value)
        del mask

        # attention
        dots = dots.softmax(dim=-1)
        dots = self.dropout(dots)

        out = torch.einsum('buij,buje->buie', dots, b_v)
        out = unbucket(out)

        out = out.reshape(b, h, t, d_h)
        out[hh_slice] = rotate_right(out[hh_slice], bsz-1, dim=2)
        return out


torch.manual_seed(0)
b, h, t, d_h, bsz = 2, 4, 32, 16, 4
attn = SinkhornCausalAttention(bucket_size=bsz, dim=h * d_h, dim_heads=d_h, heads=h, max_seq_len=t).eval()
lens = torch.tensor([22, 32])
input_mask = torch.arange(t)[None, :] < lens[:, None]          # True = real token, right padding

q, k, v = (torch.randn(b, h, t, d_h) for _ in range(3))
# change only the values at padded positions: the sort matrix R (built from q, k) is untouched, so any change
# in the outputs of real tokens comes from attention weight that reaches padded keys
v2 = v.clone()
v2[~input_mask[:, None, :, None].expand_as(v2)] += 5.0

with torch.no_grad():
    out1 = attn(q.clone(), k.clone(), v.clone(), q_mask=input_mask.clone())
    out2 = attn(q.clone(), k.clone(), v2, q_mask=input_mask.clone())
real = input_mask[:, None, :, None].expand_as(out1)
diff = (out1 - out2).abs()[real].max().item()
print(f"sinkhorn causal attention: change of real-token outputs when only padded values change = {diff:.6f}")
