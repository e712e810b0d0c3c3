# lucidrains/reformer-pytorch commit 9222838 ("fix bug with masking in causal case and contextual keys"):
# LSHAttention's causal mask clamps key positions to query_len - 1, so contextual keys (positions >= query_len,
# appended after the sequence by LSHSelfAttention) are hidden from every query except the last one.
import sys
import torch
from torch import nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)

TOKEN_SELF_ATTN_VALUE = -5e4


def default(val, d):
    return d if val is None else val


def sort_key_val(t1, t2, dim=-1):
    values, indices = t1.sort(dim=dim)
    t2 = t2.expand_as(t1)
    return values, t2.gather(dim, indices)


def batched_index_select(values, indices):
    last_dim = values.shape[-1]
    return values.gather(1, indices[:, :, None].expand(-1, -1, last_dim))


def max_neg_value(tensor):
    return -torch.finfo(tensor.dtype).max


class LSHAttention(nn.Module):
    # defaults: allow_duplicate_attention=True, attend_across_buckets=True, rehash_each_round=True
    def __init__(self, bucket_size=8, n_hashes=1, causal=False):
        super().__init__()
        self.causal = causal
        self.bucket_size = bucket_size
        self.n_hashes = n_hashes

    def hash_vectors(self, n_buckets, vecs):
        batch_size = vecs.shape[0]
        rotations_shape = (1, vecs.shape[-1], self.n_hashes, n_buckets // 2)
        random_rotations = torch.randn(rotations_shape, dtype=vecs.dtype).expand(batch_size, -1, -1, -1)
        rotated_vecs = torch.einsum('btf,bfhi->bhti', vecs, random_rotations)
        rotated_vecs = torch.cat([rotated_vecs, -rotated_vecs], dim=-1)
        buckets = torch.argmax(rotated_vecs, dim=-1)
        offsets = torch.arange(self.n_hashes).reshape(1, -1, 1) * n_buckets
        return torch.reshape(buckets + offsets, (batch_size, -1,))

    def forward(self, qk, v, query_len=None, input_mask=None):
        batch_size, seqlen, dim = qk.shape
        query_len = default(query_len, seqlen)
        assert seqlen % (self.bucket_size * 2) == 0
        n_buckets = seqlen // self.bucket_size
        buckets = self.hash_vectors(n_buckets, qk)
        total_hashes = self.n_hashes

        ticker = torch.arange(total_hashes * seqlen).unsqueeze(0).expand_as(buckets)
        buckets_and_t = seqlen * buckets + (ticker % seqlen)
        sbuckets_and_t, sticker = sort_key_val(buckets_and_t, ticker, dim=-1)
        _, undo_sort = sort_key_val(sticker, ticker, dim=-1)

        st = (sticker % seqlen)
        sqk = batched_index_select(qk, st)
        sv = batched_index_select(v, st)

        chunk_size = total_hashes * n_buckets
        bq_t = bkv_t = torch.reshape(st, (batch_size, chunk_size, -1))
        bqk = torch.reshape(sqk, (batch_size, chunk_size, -1, dim))
        bv = torch.reshape(sv, (batch_size, chunk_size, -1, dim))

        bq = bqk
        bk = F.normalize(bqk, p=2, dim=-1).type(bq.type())

        def look_one_back(x):
            x_extra = torch.cat([x[:, -1:, ...], x[:, :-1, ...]], dim=1)
            return torch.cat([x, x_extra], dim=2)

        bk = look_one_back(bk)
        bv = look_one_back(bv)
        bkv_t = look_one_back(bkv_t)

        dots = torch.einsum('bhie,bhje->bhij', bq, bk) * (dim ** -0.5)
        masked_value = max_neg_value(dots)

        if self.causal:
            if FIXED:
                mask = bq_t[:, :, :, None] < bkv_t[:, :, None, :]
                if seqlen > query_len:
                    mask = mask & (bkv_t[:, :, None, :] < query_len)
            else:
                mask = bq_t[:, :, :, None] < bkv_t[:, :, None, :].clamp(max=query_len - 1)
            dots.masked_fill_(mask, masked_value)
            del mask

        self_mask = bq_t[:, :, :, None] == bkv_t[:, :, None, :]
        dots.masked_fill_(self_mask, TOKEN_SELF_ATTN_VALUE)

        dots_logsumexp = torch.logsumexp(dots, dim=-1, keepdim=True)
        dots = torch.exp(dots - dots_logsumexp).type(dots.type())
        bo = torch.einsum('buij,buje->buie', dots, bv)
        so = torch.reshape(bo, (batch_size, -1, dim))
        slogits = torch.reshape(dots_logsumexp, (batch_size, -1,))

        o = batched_index_select(so, undo_sort)
        _, logits = sort_key_val(sticker, slogits, dim=-1)
        o = torch.reshape(o, (batch_size, total_hashes, seqlen, dim))
        logits = torch.reshape(logits, (batch_size, total_hashes, seqlen, 1))

        if query_len != seqlen:
            o, logits = o[:, :, :query_len], logits[:, :, :query_len]

        probs = torch.exp(logits - torch.logsumexp(logits, dim=1, keepdim=True))
        return torch.sum(o * probs, dim=1)


# LSHSelfAttention in a causal decoder with contextual keys: x = cat(x, keys), query_len = t
t, c, dim = 10, 6, 16          # kv_len = 16 = 2 * bucket_size -> 2 buckets: every query sees every chunk
attn = LSHAttention(bucket_size=8, n_hashes=1, causal=True)
qk = torch.randn(2, t + c, dim)
v = torch.randn(2, t + c, dim)

out = attn(qk, v, query_len=t)

# reference: the same shared-QK attention written densely: query i sees its own past (j <= i) and all contextual keys
k = F.normalize(qk, p=2, dim=-1)
dots = torch.einsum('bie,bje->bij', qk[:, :t], k) * (dim ** -0.5)
i = torch.arange(t)[:, None]
j = torch.arange(t + c)[None, :]
visible = (j <= i) | (j >= t)
dots = dots.masked_fill(~visible, max_neg_value(dots))
dots = dots.masked_fill(i == j, TOKEN_SELF_ATTN_VALUE)
ref = dots.softmax(dim=-1) @ v

print("max |LSH causal attention with context keys - dense reference|: %.6f" % (out - ref).abs().max().item())
