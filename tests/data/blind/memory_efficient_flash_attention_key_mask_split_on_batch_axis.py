# lucidrains/memory-efficient-attention-pytorch commit 33fb78a ("add tests, fix bugs").
# FlashAttentionFunction.forward (memory_efficient_attention_pytorch/flash_attention.py) takes the
# key padding mask as (batch, keys) but cut it with `mask.split(q_bucket_size, dim = -2)`, i.e. along
# the batch axis, and used each piece as the row mask of a query bucket; masked_fill_ then broadcast
# the (batch, keys) piece over (batch, heads, queries, keys), so query row i of every sequence took
# sequence i's key mask. The fix rearranges the mask to (b, 1, 1, n) and splits it along the keys.
# Here: one query bucket and one key bucket (sequences shorter than the buckets), a right-padded
# batch whose size equals its padded length, run through the repo's FlashAttention module.
import sys
import math
import torch
from torch import nn, einsum
from torch.autograd.function import Function

FIXED = "--fixed" in sys.argv

EPSILON = 1e-6

def exists(val):
    return val is not None

def default(val, d):
    return val if exists(val) else d


class FlashAttentionFunction(Function):
    @staticmethod
    @torch.no_grad()
    def forward(ctx, q, k, v, mask, causal, q_bucket_size, k_bucket_size):
        device = q.device
        max_neg_value = -torch.finfo(q.dtype).max
        qk_len_diff = max(k.shape[-2] - q.shape[-2], 0)

        o = torch.zeros_like(q)
        all_row_sums = torch.zeros((*q.shape[:-1], 1), device = device)
        all_row_maxes = torch.full((*q.shape[:-1], 1), max_neg_value, device = device)

        scale = (q.shape[-1] ** -0.5)

        if not exists(mask):
            mask = (None,) * math.ceil(q.shape[-2] / q_bucket_size)
        elif FIXED:
            mask = mask[:, None, None, :]                    # rearrange(mask, 'b n -> b 1 1 n')
            mask = mask.split(q_bucket_size, dim = -1)
        else:
            mask = mask.split(q_bucket_size, dim = -2)

        row_splits = zip(
            q.split(q_bucket_size, dim = -2),
            o.split(q_bucket_size, dim = -2),
            mask,
            all_row_sums.split(q_bucket_size, dim = -2),
            all_row_maxes.split(q_bucket_size, dim = -2),
        )

        for ind, (qc, oc, row_mask, row_sums, row_maxes) in enumerate(row_splits):
            q_start_index = ind * q_bucket_size - qk_len_diff

            col_splits = zip(
                k.split(k_bucket_size, dim = -2),
                v.split(k_bucket_size, dim = -2),
            )

            for k_ind, (kc, vc) in enumerate(col_splits):
                k_start_index = k_ind * k_bucket_size

                attn_weights = einsum('... i d, ... j d -> ... i j', qc, kc) * scale

                if exists(row_mask):
                    attn_weights.masked_fill_(~row_mask, max_neg_value)

                if causal and q_start_index < (k_start_index + k_bucket_size - 1):
                    causal_mask = torch.ones((qc.shape[-2], kc.shape[-2]), dtype = torch.bool, device = device).triu(q_start_index - k_start_index + 1)
                    attn_weights.masked_fill_(causal_mask, max_neg_value)

                block_row_maxes = attn_weights.amax(dim = -1, keepdims = True)
                attn_weights -= block_row_maxes
                exp_weights = torch.exp(attn_weights)

                if exists(row_mask):
                    exp_weights.masked_fill_(~row_mask, 0.)

                block_row_sums = exp_weights.sum(dim = -1, keepdims = True).clamp(min = EPSILON)

                new_row_maxes = torch.maximum(block_row_maxes, row_maxes)

                exp_values = einsum('... i j, ... j d -> ... i d', exp_weights, vc)

                exp_row_max_diff = torch.exp(row_maxes - new_row_maxes)
                exp_block_row_max_diff = torch.exp(block_row_maxes - new_row_maxes)

                new_row_sums = exp_row_max_diff * row_sums + exp_block_row_max_diff * block_row_sums

                oc.mul_((row_sums / new_row_sums) * exp_row_max_diff).add_((exp_block_row_max_diff / new_row_sums) * exp_values)

                row_maxes.copy_(new_row_maxes)
                row_sums.copy_(new_row_sums)

        return o


class FlashAttention(nn.Module):
    def __init__(self, *, dim, heads = 8, dim_head = 64, causal = False, q_bucket_size = 512, k_bucket_size = 1024):
        super().__init__()
        self.heads = heads
        self.causal = causal
        inner_dim = heads * dim_head
        self.to_q = nn.Linear(dim, inner_dim, bias = False)
        self.to_kv = nn.Linear(dim, inner_dim * 2, bias = False)
        self.to_out = nn.Linear(inner_dim, dim, bias = False)
        self.q_bucket_size = q_bucket_size
        self.k_bucket_size = k_bucket_size

    def forward(self, x, context = None, mask = None, q_bucket_size = None, k_bucket_size = None):
        q_bucket_size = default(q_bucket_size, self.q_bucket_size)
        k_bucket_size = default(k_bucket_size, self.k_bucket_size)
        h = self.heads
        context = default(context, x)
        q = self.to_q(x)
        k, v = self.to_kv(context).chunk(2, dim = -1)
        q, k, v = map(lambda t: t.reshape(*t.shape[:2], h, -1).transpose(1, 2), (q, k, v))  # 'b n (h d) -> b h n d'
        out = FlashAttentionFunction.apply(q, k, v, mask, self.causal, q_bucket_size, k_bucket_size)
        out = out.transpose(1, 2).reshape(out.shape[0], out.shape[2], -1)  # 'b h n d -> b n (h d)'
        return self.to_out(out)


torch.manual_seed(0)
num_tokens, dim, pad_id = 32, 32, 0
emb = nn.Embedding(num_tokens, dim)
attn = FlashAttention(dim = dim, heads = 2, dim_head = 16, causal = False)

seqs = [[5, 9, 3, 7, 11, 2], [4, 8, 6, 1], [12, 3, 9], [7, 5, 14, 2, 6], [10, 13], [3, 3, 8, 9, 1, 4]]
n = max(len(s) for s in seqs)
ids = torch.tensor([s + [pad_id] * (n - len(s)) for s in seqs])
mask = ids != pad_id                      # (batch, n), True = real token

with torch.no_grad():
    out = attn(emb(ids), mask = mask)

# mean-pool the real tokens of each sequence (an encoder's sentence embedding)
pooled = (out * mask[..., None]).sum(1) / mask.sum(1, keepdim = True)
print("pooled[:, :4]:", pooled[:, :4])
print("checksum:", round(pooled.sum().item(), 6))
